"""fp16 loss scaling for a pipeline, with ``torch.amp.GradScaler``'s semantics and kernels:
each step's backward starts from the scale instead of 1, the step's gradients are unscaled
(and checked for inf/NaN) as soon as the step returns, and `optimizer_step` skips the
optimizer's step when any process of the job found an inf/NaN since the last optimizer step,
then updates the scale (backoff on overflow, growth after `growth_interval` clean steps) the
same way everywhere. `state_dict` has GradScaler's keys."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor


class Stepper(Protocol):
    """Anything with ``step()``: a torch optimizer, or one a sharding mode wraps."""

    def step(self, *args: Any, **kwargs: Any) -> Any: ...


def _check_positive(name: str, value: object, *, above_one: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    low = 1.0 if above_one else 0.0
    if not value > low:
        raise ValueError(f"{name} must be > {low:g}, got {value!r}")
    return float(value)


class LossScaler:
    """The dynamic loss scale of one Pipeline (the same on every process of a job).

    `seed(loss)`: the backward's starting gradient (the scale, as ``GradScaler.scale(loss)``
    would multiply in). `unscale_(grads)`: divide one step's fresh gradients by the scale in
    place and remember whether any was inf/NaN (``GradScaler.unscale_``'s kernel).
    `optimizer_step(optimizer, any_rank)`: the optimizer's step unless an inf/NaN was found
    here or (`any_rank`, a MAX over every process) anywhere, then the scale update
    (``torch._amp_update_scale_``); returns whether the optimizer stepped."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        device: torch.device | str = "cpu",
    ) -> None:
        _check_positive("init_scale", init_scale)
        self.growth_factor = _check_positive("growth_factor", growth_factor, above_one=True)
        self.backoff_factor = _check_positive("backoff_factor", backoff_factor)
        if not self.backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be < 1, got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or (
            growth_interval < 1
        ):
            raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
        self.growth_interval = growth_interval
        self.device = torch.device(device)
        self._scale = torch.full((), float(init_scale), dtype=torch.float32, device=self.device)
        self._growth_tracker = torch.zeros((), dtype=torch.int32, device=self.device)
        self._found_inf = torch.zeros((), dtype=torch.float32, device=self.device)

    def get_scale(self) -> float:
        return float(self._scale)

    @property
    def found_inf(self) -> bool:
        """Whether this process saw an inf/NaN gradient since the last optimizer step."""
        return bool(self._found_inf)

    def seed(self, loss: Tensor) -> Tensor:
        return self._scale.to(device=loss.device, dtype=loss.dtype).expand_as(loss)

    def unscale_(self, grads: Sequence[Tensor]) -> None:
        """Divide `grads` (one step's fresh gradients) by the scale in place, recording an
        inf/NaN among them. Grouped by device and dtype, as GradScaler does."""
        inv = self._scale.double().reciprocal().float()
        groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for g in grads:
            if isinstance(g, DTensor):  # a sharded gradient: this process's shard, in place
                g = g.to_local()
            groups.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), group in groups.items():
            found = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv.to(device))
            self._found_inf = torch.maximum(self._found_inf, found.to(self.device))

    def optimizer_step(
        self,
        optimizer: Stepper,
        any_rank: Callable[[Tensor], Tensor] = lambda t: t,
        *args: Any,
        **kwargs: Any,
    ) -> bool:
        """`optimizer.step(*args, **kwargs)` unless some process found an inf/NaN gradient
        since the last call; then update the scale. Every process of a job must call it."""
        found = any_rank(self._found_inf.clone()).to(self.device, torch.float32)
        stepped = not bool(found)
        if stepped:
            optimizer.step(*args, **kwargs)
        torch._amp_update_scale_(
            self._scale, self._growth_tracker, found, self.growth_factor,
            self.backoff_factor, self.growth_interval,
        )
        self._found_inf.zero_()
        return stepped

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys: scale, growth_factor, backoff_factor, growth_interval,
        _growth_tracker."""
        return {
            "scale": self.get_scale(),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": int(self._growth_tracker),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a `state_dict` (this scaler's or a torch.amp.GradScaler's)."""
        missing = {"scale", "_growth_tracker"} - set(state)
        if missing:
            raise ValueError(
                f"a loss scaler state needs keys {sorted(missing)}, got {sorted(state)}; pass "
                "LossScaler.state_dict() or torch.amp.GradScaler.state_dict()"
            )
        self._scale.fill_(_check_positive("scale", state["scale"]))
        self._growth_tracker.fill_(int(state["_growth_tracker"]))
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
