"""What the captured units cost, as this process can measure them (`measure`): timed unit by
unit (partitioner.profile, each unit run as `UnitRunner` says: compiled under ``compile=``),
or estimated from FLOPs and bytes when the model is on the meta device (partitioner.estimate);
and what planning does for a model built on meta (`on_meta`, `as_meta`, and
`real_buffers_on_meta`: its real buffers stood in for while it is captured on meta). The
planner and the executor's `measure_units` measure through it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_map

from partitioner import Captured, profile
from partitioner.estimate import estimate
from partitioner.rebind import rebind
from partitioner.unit_costs import UnitCosts

UnitRunner = Callable[[torch.nn.Module], torch.nn.Module]


@contextmanager
def real_buffers_on_meta(model: torch.nn.Module) -> Iterator[Callable[..., None]]:
    """For a model whose parameters are on meta but some buffers real (`pipeline.meta_init`):
    stand in meta copies for the real buffers while planning captures and estimates it on
    meta (an op mixing the devices would fail), then put the real ones back in the model and,
    through the callback, in the modules planning made (captured graph, stage modules)."""
    real = [b for b in model.buffers() if not b.is_meta]
    if not on_meta(model) or not real:
        yield lambda *holders: None
        return
    stand_ins = {id(b): b.to("meta") for b in real}
    back = {id(m): b for m, b in zip(rebind([model], stand_ins), real, strict=True)}
    restored = False

    def restore(*holders: torch.nn.Module | None) -> None:
        nonlocal restored
        rebind([model, *(h for h in holders if h is not None)], back)
        restored = True

    try:
        yield restore
    finally:
        if not restored:
            rebind([model], back)


def on_meta(model: torch.nn.Module) -> bool:
    """Whether the model was built on the meta device (any parameter or buffer there)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def as_meta(value: Any) -> Any:
    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, value)


def measure(captured: Captured, model: torch.nn.Module, example: tuple[Any, ...],
            device: torch.device, runner: UnitRunner | None = None,
            units: set[str] | None = None) -> dict[str, UnitCosts]:
    """The captured units' costs: profiled, or estimated (FLOPs + bytes on meta,
    partitioner.estimate) when the model is on the meta device. `runner(unit)`: what runs a
    unit when it is timed (its compiled form under ``compile=``; partitioner.profile).
    `units`: time only these (see partitioner.profile)."""
    if on_meta(model):
        return estimate(captured, example, device=device)
    # A meta model materialised since it was captured: time it on zeros of those shapes.
    real = tree_map(lambda t: torch.zeros_like(t, device="cpu")
                    if isinstance(t, torch.Tensor) and t.is_meta else t, example)
    return profile(captured, model, real, device=device, runner=runner, units=units)
