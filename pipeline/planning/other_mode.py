"""The model in its other train/eval mode. torch.export bakes each module's mode into the
captured ops (dropout, batch norm), so running the model in another mode needs another capture;
this one is made on a stand-in of the model with the same modules and modes and every
parameter and buffer a fake tensor (`fake_clone`), so that it copies no weight and every
process can make it, also one that has freed the other stages' weights. The fakes are on the
device the first capture ran on (that of its inputs), not on meta: autocast acts by device type
and not on meta tensors, so under a model's own ``torch.autocast`` block or the Pipeline's
``mixed_precision`` a meta capture would record fp32 where the first one (and the run) has
bf16, and its dtype checks would fail at run time. Its stages are cut by
the running plan (`plan_onto`): the same units on the same stages, so each stage reads the same
parameters and sends the same boundary tensors as before; only its code differs."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch._functorch import config as functorch_config
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._pytree import TreeSpec, tree_unflatten

from partitioner import Captured, Plan, StageModule, capture, split_model


class Shape(NamedTuple):
    """What a fake stand-in of a parameter or buffer needs."""

    shape: torch.Size
    dtype: torch.dtype
    parameter: bool
    requires_grad: bool


def shapes_of(model: nn.Module) -> dict[str, Shape]:
    """Every parameter's and buffer's shape by name (every name of a tied one); taken while
    the process holds the whole model (a distributed executor frees the other stages' ones)."""
    return {
        name: Shape(t.shape, t.dtype, isinstance(t, nn.Parameter), t.requires_grad)
        for name, t in (*model.named_parameters(remove_duplicate=False),
                        *model.named_buffers(remove_duplicate=False))
    }


def fake_mode() -> FakeTensorMode:
    """A fake tensor mode that torch.export takes for its own (as `make_fake_inputs` builds
    one), so that the stand-in's fake parameters and the inputs it fakes share it."""
    with functorch_config.patch(fake_tensor_allow_unsafe_data_ptr_access=False):
        return FakeTensorMode(shape_env=ShapeEnv(tracked_fakes=[], trace_asserts=True),
                              allow_non_fake_inputs=True, export=True)


def fake_clone(model: nn.Module, shapes: dict[str, Shape], mode: FakeTensorMode,
               device: torch.device) -> nn.Module:
    """A copy of `model` (its modules, their modes and attributes) whose parameters and
    buffers are fake tensors of `mode` on `device`, of the shapes in `shapes`: nothing is
    allocated, ties are kept."""
    memo: dict[int, Any] = {}
    for name, t in (*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)):
        if id(t) in memo:
            continue
        shape = shapes[name]
        with mode:
            empty = torch.empty(shape.shape, dtype=shape.dtype, device=device)
        memo[id(t)] = (nn.Parameter(empty, requires_grad=shape.requires_grad)
                       if shape.parameter else empty)
    return copy.deepcopy(model, memo)


def plan_onto(plan: Plan, old: Captured, new: Captured) -> Plan:
    """`plan` (of `old`'s units) for `new`'s units: each unit on the stage of the unit of the
    same name, a unit `old` lacks on the stage of the unit before it. ValueError when that is
    not a contiguous cut with every stage kept."""
    stage_of = {name: k for k, names in enumerate(plan.stages) for name in names}
    stages: list[list[str]] = [[] for _ in plan.stages]
    current = 0
    for name in new.order:
        current = stage_of.get(name, current)
        stages[current].append(name)
    order = [name for names in stages for name in names]
    if order != list(new.order) or not all(stages):
        raise ValueError(
            f"the model captured in its new train/eval mode has {len(new.order)} units that "
            f"do not cut like the running plan's stages of {plan.sizes} units; build a "
            "Pipeline in this mode, or pass capture_method='fx' (it follows modes as it runs)"
        )
    return dataclasses.replace(plan, stages=stages)


def stages_in_mode(
    model: nn.Module, shapes: dict[str, Shape], running: Captured, plan: Plan,
    rows: Sequence[Any], call_spec: TreeSpec, *, leaf_modules: tuple[type, ...] | None,
    dynamic: frozenset[tuple[int, int]] | set[tuple[int, int]],
) -> list[StageModule]:
    """The stage modules of the model in the modes its modules have now, captured (export) on
    a fake stand-in called with `rows` (the running capture's flat inputs, which export fakes)
    and cut by `plan`; their parameters are the stand-in's: only their code is for running.
    Called under the autocast the first capture ran under (`Precision.planning`)."""
    device = next((t.device for t in rows if isinstance(t, torch.Tensor)),
                  torch.device("cpu"))
    mode = fake_mode()
    clone = fake_clone(model, shapes, mode, device)
    args, kwargs = tree_unflatten(list(rows), call_spec)
    with tracing(TracingContext(mode)):  # export fakes the inputs in the stand-in's mode
        captured = capture(clone, args, kwargs, leaf_modules=leaf_modules, method="export",
                           dynamic_dims=set(dynamic))
    return split_model(captured, plan_onto(plan, running, captured))
