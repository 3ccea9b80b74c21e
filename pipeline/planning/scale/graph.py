"""Any model as a chain of priced units: the model built on meta is captured
(partitioner.capture, as `Pipeline` captures it) and each unit of the captured graph is run
on meta tensors and priced op by op on the target (`pricing`: the same recorder, the same
roofline), F, B and W apart, what it saves counted by partitioner.probe. The result, a
`GraphSpec`, plans like a transformer family with tp=1 and no recompute policy (pipeline and
data parallelism, schedules, ZeRO); a microbatch of another size is priced as the captured
one scaled by the sample count (linear in samples)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten, tree_map

from partitioner import capture
from partitioner.probe import probe
from pipeline.planning.hardware.targets import Target
from pipeline.planning.scale.pricing import UnitPrice, _DeviceKernels, _Recorder, _seconds


@dataclass(frozen=True)
class GraphSpec:
    """A captured model's units priced for microbatches of `batch` samples."""

    name: str
    units: tuple[UnitPrice, ...]
    batch: int
    family: str = "graph"
    seq: int = 0

    @property
    def layers(self) -> int:
        """Units besides the first and the last (as a family's blocks)."""
        return len(self.units) - 2

    def check_tp(self, tp: int) -> None:
        if tp != 1:
            raise ValueError(f"tp={tp}: tensor parallelism is priced for the gpt:/llama: "
                             f"families only; plan {self.name} with tp=1")

    def scaled(self, samples: int) -> tuple[UnitPrice, ...]:
        """The units for microbatches of `samples` (linear in samples; parameters kept)."""
        f = samples / self.batch
        keep = {"parameters", "parameter_bytes", "replicated"}
        return tuple(dataclasses.replace(u, **{
            k.name: getattr(u, k.name) * f for k in dataclasses.fields(u)
            if k.name not in keep}) for u in self.units)


def _nbytes(value: Any) -> float:
    return float(sum(t.numel() * t.element_size() for t in tree_flatten(value)[0]
                     if isinstance(t, torch.Tensor)))


class _Pricer(fx.Interpreter):
    """Runs the unit module on meta tensors, pricing each unit."""

    def __init__(self, gm: fx.GraphModule, target: Target) -> None:
        super().__init__(gm)
        self.target = target
        self.prices: list[UnitPrice] = []

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "output", "get_attr"):
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        run = getattr(self, n.op)
        params: list[torch.Tensor] = []
        if n.op == "call_module":
            params = [p for p in self.fetch_attr(str(n.target)).parameters() if p.requires_grad]
        ids = {id(p) for p in params}
        forward = _Recorder(0, None)
        with torch.enable_grad(), _DeviceKernels(), forward:
            got = probe(run, n.target, args, kwargs, weights=params,
                        is_param=lambda t: isinstance(t, nn.Parameter) or id(t) in ids,
                        key=lambda t: t.untyped_storage()._cdata)
        walks = []
        for wrt in (got.leaves, got.leaves + got.weights):
            rec = _Recorder(0, None)
            if got.has_backward and wrt:
                with rec:
                    got.grad_of(wrt)()
            walks.append(rec)
        f, b, total = (_seconds(r.ops, self.target) for r in (forward, *walks))
        with torch.no_grad():
            result = run(n.target, args, kwargs)
        self.prices.append(UnitPrice(
            forward=f, input_grad=b, weight_grad=max(0.0, total - b),
            forward_flops=float(sum(op.flops for op in forward.ops)),
            input_grad_flops=float(sum(op.flops for op in walks[0].ops)),
            backward_flops=float(sum(op.flops for op in walks[1].ops)),
            core_seconds=0.0, core_flops=0.0, replicated=(0.0, 0.0, 0.0),
            saved=got.activation_bytes, saved_core=0.0,
            input_bytes=_nbytes(got.leaves), output_bytes=_nbytes(result),
            parameters=sum(p.numel() for p in params),
            parameter_bytes=int(sum(p.numel() * p.element_size() for p in params))))
        return result


def price_graph(name: str, model: nn.Module, example_inputs: tuple[Any, ...],
                target: Target) -> GraphSpec:
    """Capture `model` (built on meta) with `example_inputs` (moved to meta; dim 0 is the
    microbatch) and price every unit on `target`."""
    if any(not p.is_meta for p in model.parameters()):
        raise ValueError(f"{name}: build the model on the meta device to plan it for a target")
    inputs = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t,
                      tuple(example_inputs))
    captured = capture(model, inputs)
    pricer = _Pricer(captured.unit_module, target)
    pricer.run(*inputs)
    if len(pricer.prices) < 2:
        raise ValueError(f"{name} captured as {len(pricer.prices)} unit(s); nothing to split")
    return GraphSpec(name, tuple(pricer.prices), int(inputs[0].shape[0]))
