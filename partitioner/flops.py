"""Count a captured model's FLOPs for one call, forward and backward, without computing
anything: the captured graph runs on fake tensors (torch's FakeTensorMode: shape, dtype and
device, no storage) under torch.utils.flop_counter.FlopCounterMode, the counter `estimate`
uses. The parameters' shapes are taken while the process still holds the whole model
(`stand_ins`), so the count works after an executor has freed other stages' weights, and for
a model built on the meta device."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode


class Spec(NamedTuple):
    """What a fake stand-in for a tensor needs."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


def stand_ins(gm: fx.GraphModule) -> dict[str, Spec]:
    """The shape, dtype, device and requires_grad of every parameter and buffer of `gm`."""
    return {
        name: Spec(t.shape, t.dtype, t.device, t.requires_grad)
        for name, t in (*gm.named_parameters(), *gm.named_buffers())
    }


def count_flops(
    gm: fx.GraphModule, tensors: dict[str, Spec], example: tuple[Any, ...]
) -> tuple[int, int]:
    """(forward, backward) FLOPs of ``gm(*example)`` with fake tensors of `tensors` (from
    `stand_ins`) as its parameters and buffers; backward is the gradient of every
    floating-point output that requires grad w.r.t. everything that requires grad (as a
    training step computes it)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # constants captured in gm stay real
    with mode:
        fake = {name: torch.empty(s.shape, dtype=s.dtype, device=s.device,
                                  requires_grad=s.requires_grad) for name, s in tensors.items()}
    args = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, example)
    with mode, FlopCounterMode(display=False) as counter:
        out = functional_call(gm, fake, tuple(args))
        forward = counter.get_total_flops()
        roots = [t for t in tree_leaves(out)
                 if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
        if roots:
            torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
        total = counter.get_total_flops()
    return int(forward), int(total - forward)
