"""Estimate a captured graph's costs without real tensors: run each unit on the meta device,
count its FLOPs (torch.utils.flop_counter.FlopCounterMode) for the forward, the input-grad
and the weight-grad walk, and the bytes it moves, and turn them into the seconds `profile`
would measure (the same `UnitCosts`, so partitioning and stage costs read them alike).

time = FLOPs / FLOP rate + bytes / byte rate (`rates`, by default `RATES` for the device
type): matrix products are priced by their FLOPs, element-wise work (norms, activations,
softmax; no FLOPs counted) by the bytes it reads and writes. The forward moves its inputs,
outputs and parameters; B (input grad) and W (weight grad) are each priced as moving them once
more. Only the ratio of the two rates matters for balance; the defaults are rough CPU and GPU
figures. Measured steps refine it (`Pipeline.rebalance`, calibration)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from partitioner.captured import Captured
from partitioner.probe import probe
from partitioner.unit_costs import UnitCosts

# (FLOP/s, bytes/s) per device type: the balance depends on their ratio only.
RATES = {"cpu": (5e10, 1e10), "cuda": (2e14, 2e12)}


def _bytes(value: Any) -> int:
    return sum(
        t.numel() * t.element_size() for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)
    )


def _flops(fn: Callable[[], Any]) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.grad_fn is not None:
        return value.detach()
    return value


def _meta(value: Any) -> Any:
    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, value)


class _Estimator(fx.Interpreter):
    """Runs the unit module on meta tensors, recording each unit's FLOPs and bytes."""

    def __init__(self, gm: fx.GraphModule, rates: tuple[float, float]) -> None:
        super().__init__(gm)
        self.flop_rate, self.byte_rate = rates
        self.results: dict[str, UnitCosts] = {}

    def seconds(self, flops: float, moved: float) -> float:
        return flops / self.flop_rate + moved / self.byte_rate

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "output"):
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        run = getattr(self, n.op)
        holder = []
        # Grad on (FlopCounterMode's module tracker hooks a unit whose output is a parameter,
        # which fails under no_grad), results detached as no_grad would give them.
        forward = _flops(lambda: holder.append(run(n.target, args, kwargs)))
        result = tree_map(_detached, holder[0])
        params: list[nn.Parameter] = []
        if n.op == "call_module":
            params = list(self.fetch_attr(str(n.target)).parameters())
        moved = _bytes((args, kwargs)) + _bytes(result) + _bytes(params)
        self.results[n.name] = self._backward(
            n, run, args, kwargs, params, moved,
            UnitCosts(forward=self.seconds(forward, moved), source="estimate",
                      forward_flops=float(forward)))
        return result

    def _backward(
        self, n: fx.Node, run: Any, args: Any, kwargs: Any, params: list[nn.Parameter],
        moved: float, costs: UnitCosts,
    ) -> UnitCosts:
        own: list[torch.Tensor] = [p for p in params if p.requires_grad]
        ids = {id(p) for p in own}
        got = probe(run, n.target, args, kwargs, weights=own,
                    is_param=lambda t: isinstance(t, nn.Parameter) or id(t) in ids, key=id)
        costs = dataclasses.replace(costs, activation_bytes=got.activation_bytes)
        if not got.has_backward:
            return costs
        leaves, weights = got.leaves, got.weights
        total = _flops(got.grad_of(leaves + weights))
        input_flops = _flops(got.grad_of(leaves)) if leaves and weights else (
            total if leaves else 0)
        input_flops = min(input_flops, total)
        return dataclasses.replace(
            costs, input_grad=self.seconds(input_flops, moved) if leaves else 0.0,
            weight_grad=self.seconds(total - input_flops, moved) if weights else 0.0,
            backward_flops=float(total))


def estimate(
    captured: Captured,
    example_inputs: tuple[Any, ...],
    *,
    device: str | torch.device = "cpu",
    rates: tuple[float, float] | None = None,
) -> dict[str, UnitCosts]:
    """The estimated `UnitCosts` of every unit of a `capture`d model (forward, input-grad and
    weight-grad seconds, activation bytes, forward and backward FLOPs; source "estimate"),
    running it on meta tensors (the model may be on meta: nothing is allocated). `rates`:
    (FLOP/s, bytes/s), by default `RATES` for the device type. The record is left as it was."""
    if not isinstance(example_inputs, tuple):
        raise TypeError(
            f"example_inputs must be a tuple, got {type(example_inputs).__name__}; wrap as (x,)"
        )
    kind = torch.device(device).type
    chosen = rates if rates is not None else RATES.get(kind, RATES["cpu"])
    if min(chosen) <= 0:
        raise ValueError(f"rates must be positive (FLOP/s, bytes/s), got {chosen!r}")
    gm = captured.unit_module
    if any(not p.is_meta for p in gm.parameters()):
        raise ValueError(
            "estimate runs on a model built on the meta device; profile a real model with "
            "partitioner.profile instead"
        )
    estimator = _Estimator(gm, chosen)
    estimator.run(*_meta(example_inputs))
    return dict(estimator.results)
