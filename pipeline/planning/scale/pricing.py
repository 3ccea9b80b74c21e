"""Price one unit (a module and its inputs) op by op on a `Target`, on meta tensors: no
weights, no device. The unit runs forward, then its input-grad walk (B), then the whole
backward (B + W); a TorchDispatchMode records every aten op that launches a kernel, its
FLOPs (torch.utils.flop_counter's formulas) and the bytes it reads and writes, and each is
priced by `Target.op_seconds` (roofline with a floor). W = whole backward - B, op by op
additive. Saved-tensor hooks count what the forward keeps for the backward (each storage
once; parameters and buffers not counted), and which of it is the attention core (tensors
ending in seq x seq, the ones Korthikanti et al.'s selective recompute drops).

Working sets (`_Live`: every storage an op makes, alive until its last tensor dies, read
after each op): beyond what the forward keeps, the most the forward's temporaries add; the
most a whole backward adds (B and W in one walk, as 1F1B runs them; each weight's gradient
freed once accumulated: the runtime adds it into the step's buffer in place); and the split
backward as the runtime runs it (pipeline.execution.split_backward): B walks to the input
grads keeping the gradient that arrives where each weight's path leaves the input path
(`kept_for_weight`), W starts from those, all of a unit's weight grads made at once.

Where the CPU path differs from a GPU's, pricing runs the GPU's kernel (its meta kernel and
flop formula): `F.scaled_dot_product_attention` (on meta it falls back to the math path) as
aten's fused flash kernel, which holds no seq x seq tensor; `F.dropout` as native_dropout,
which saves a one-byte mask."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import GradientEdge, Node
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from pipeline.planning.hardware.targets import Target

aten = torch.ops.aten
_GEMMS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
_ATTENTION = {aten._scaled_dot_product_flash_attention,
              aten._scaled_dot_product_flash_attention_backward,
              aten._scaled_dot_product_efficient_attention,
              aten._scaled_dot_product_efficient_attention_backward}
_NO_KERNEL = {aten.detach, aten._unsafe_view, aten.alias, aten.lift_fresh, aten.empty,
              aten.empty_like, aten.empty_strided, aten._reshape_alias}
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
           torch.float64: "fp64"}


@dataclass(frozen=True)
class Op:
    """One kernel: its aten name, FLOPs, bytes read and written, kind ("gemm", "attention",
    "memory"), output (m, n, batch) for a gemm, dtype name, whether it is part of the
    attention core (touches a seq x seq tensor, or is the fused attention) and whether it
    is element-wise work on whole hidden vectors (norms, dropout, residuals: every tensor
    ends in the hidden size or 1), what sequence parallelism shards along the sequence."""

    name: str
    flops: float
    moved: float
    kind: str
    gemm: tuple[int, int, int] | None
    dtype: str
    core: bool
    replicated: bool = False

    def seconds(self, target: Target) -> float:
        return target.op_seconds(self.flops, self.moved, self.dtype, self.kind, self.gemm)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _is_view(func: Any) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write
               for r in func._schema.returns)


def _gemm_shape(packet: Any, args: Sequence[Any]) -> tuple[int, int, int]:
    a, b = (args[1], args[2]) if packet in (aten.addmm, aten.baddbmm) else (args[0], args[1])
    if a.dim() == 3:
        return int(a.shape[1]), int(b.shape[2]), int(a.shape[0])
    return int(a.shape[0]), int(b.shape[1]), 1


class _Live:
    """Bytes of the storages ops made that are still alive (each storage once, weak
    references: a storage dies with its last tensor, wherever autograd held it), and the
    most seen since `reset`."""

    def __init__(self) -> None:
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def now(self) -> int:
        dead = [k for k, (ref, _) in self.storages.items() if ref.expired()]
        for k in dead:
            del self.storages[k]
        return sum(n for _, n in self.storages.values())

    def track(self, value: Any) -> None:
        for t in _tensors(value):
            storage = t.untyped_storage()
            key = storage._cdata
            known = self.storages.get(key)
            if known is None or known[0].expired():
                self.storages[key] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, self.now())

    def reset(self) -> int:
        self.peak = self.now()
        return self.peak


class _Recorder(TorchDispatchMode):
    """Records each kernel-launching aten op as an `Op` (and what it allocates in `live`)."""

    def __init__(self, seq: int, hidden: int | None, live: _Live | None = None) -> None:
        super().__init__()
        self.seq, self.hidden, self.live = seq, hidden, live
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.live is not None:
            self.live.track(out)
        packet = func._overloadpacket
        if packet in _NO_KERNEL or _is_view(func):
            return out
        tensors = _tensors((args, kwargs)) + _tensors(out)
        flops = 0
        if packet in flop_registry:
            flops = int(flop_registry[packet](*args, **kwargs, out_val=out))
        kind = "gemm" if packet in _GEMMS else "attention" if packet in _ATTENTION else "memory"
        floating = [t for t in tensors if t.is_floating_point()]
        dtype = _DTYPES.get(floating[0].dtype if floating else torch.float32, "fp32")
        core = packet in _ATTENTION or any(
            t.dim() >= 2 and tuple(t.shape[-2:]) == (self.seq, self.seq) for t in tensors)
        replicated = kind == "memory" and self.hidden is not None and all(
            t.dim() >= 2 and t.shape[-1] in (self.hidden, 1) for t in tensors)
        self.ops.append(Op(
            name=str(packet), flops=flops, moved=sum(t.numel() * t.element_size()
                                                     for t in tensors),
            kind=kind, gemm=_gemm_shape(packet, args) if kind == "gemm" else None,
            dtype=dtype, core=core, replicated=replicated))
        return out


class _DeviceKernels(TorchFunctionMode):
    """Runs what a GPU runs where the CPU path differs: F.dropout as aten's native_dropout
    (a one-byte bool mask saved, as CUDA does, not a mask in the activation dtype), and
    F.scaled_dot_product_attention as aten's fused flash kernel (grouped-query k and v
    expanded as views: the kernel reads them in place)."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.dropout:
            x, p = args[0], float(kwargs.get("p", args[1] if len(args) > 1 else 0.5))
            training = bool(kwargs.get("training", args[2] if len(args) > 2 else True))
            if not training or p == 0:
                return x
            return aten.native_dropout(x, p, True)[0]
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        if k.shape[1] != q.shape[1]:
            k = k[:, :1].expand(-1, q.shape[1], -1, -1)
            v = v[:, :1].expand(-1, q.shape[1], -1, -1)
        p = float(kwargs.get("dropout_p", 0.0))
        return aten._scaled_dot_product_flash_attention(
            q, k, v, p, bool(kwargs.get("is_causal", False)))[0]


class _Saved:
    """What the forward saves for the backward: each storage once, parameters and buffers
    excluded; `core` the part in tensors ending in seq x seq."""

    def __init__(self, seq: int, exclude: set[int]) -> None:
        self.seq, self.exclude = seq, exclude
        self.storages: dict[int, tuple[int, bool]] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base
        if isinstance(base, nn.Parameter):
            return t
        key = t.untyped_storage()._cdata
        if key not in self.exclude and key not in self.storages:
            core = t.dim() >= 2 and tuple(t.shape[-2:]) == (self.seq, self.seq)
            self.storages[key] = (t.untyped_storage().nbytes(), core)
        return t

    @property
    def total(self) -> int:
        return sum(n for n, _ in self.storages.values())

    @property
    def core(self) -> int:
        return sum(n for n, core in self.storages.values() if core)


@dataclass(frozen=True)
class UnitPrice:
    """One unit's priced costs for one microbatch: seconds of F, B (input grad) and W
    (weight grad); FLOPs of F, B and the whole backward (B + W); `core_seconds` and
    `core_flops` of the forward's attention core (what selective recompute redoes); bytes
    the forward saves (`saved`; `saved_core` of them in the attention core); bytes of its
    inputs and output; parameters (elements and bytes); `replicated`: seconds of F, B and
    W spent in element-wise work on whole hidden vectors (`Op.replicated`)."""

    forward: float
    input_grad: float
    weight_grad: float
    forward_flops: float
    input_grad_flops: float
    backward_flops: float
    core_seconds: float
    core_flops: float
    replicated: tuple[float, float, float]
    saved: float
    saved_core: float
    input_bytes: float
    output_bytes: float
    parameters: int
    parameter_bytes: int
    forward_extra: float = 0.0
    backward_extra: float = 0.0
    input_extra: float = 0.0
    kept_for_weight: float = 0.0
    weight_extra: float = 0.0


def _seconds(ops: list[Op], target: Target, replicated: bool = False) -> float:
    return sum(op.seconds(target) for op in ops if op.replicated or not replicated)


def _grad_node(t: torch.Tensor) -> Node | None:
    if t.grad_fn is not None:
        return t.grad_fn
    view = t.view_as(t).grad_fn if t.requires_grad else None
    return view.next_functions[0][0] if view is not None else None


def _meeting_nodes(out: torch.Tensor, leaves: list[torch.Tensor],
                   params: list[torch.Tensor]) -> list[Node]:
    """The nodes on the input-grad path where a weight's gradient path leaves it (where the
    runtime's split B keeps the arriving gradient for W)."""
    parents: dict[Node, list[Node]] = {}
    root = out.grad_fn
    seen, queue = ({root}, [root]) if root is not None else (set(), [])
    while queue:
        node = queue.pop()
        for child, _ in node.next_functions:
            if child is not None:
                parents.setdefault(child, []).append(node)
                if child not in seen:
                    seen.add(child)
                    queue.append(child)

    def up(starts: list[Node], stop: set[Node]) -> tuple[set[Node], set[Node]]:
        reached, met, todo = set(starts), set(), list(starts)
        while todo:
            for parent in parents.get(todo.pop(), ()):
                if parent in stop:
                    met.add(parent)
                elif parent not in reached:
                    reached.add(parent)
                    todo.append(parent)
        return reached, met

    path, _ = up([n for n in map(_grad_node, leaves) if n is not None], set())
    meeting: list[Node] = []
    for p in params:
        acc = _grad_node(p)
        if acc in seen:
            meeting += [m for m in up([acc], path)[1] if m not in meeting]
    return meeting


@dataclass
class _Walks:
    """The three backward walks of one forward: B (input grads, gradients kept for W at the
    meeting nodes), W from those, then the whole backward; recorders and working sets."""

    input_walk: _Recorder
    whole: _Recorder
    input_extra: float = 0.0
    kept: float = 0.0
    weight_extra: float = 0.0
    backward_extra: float = 0.0


def _walk(out: torch.Tensor, leaves: list[torch.Tensor], params: list[torch.Tensor],
          live: _Live, seq: int, hidden: int | None) -> _Walks:
    walks = _Walks(_Recorder(seq, hidden, live), _Recorder(seq, hidden, live))
    with _Recorder(seq, hidden, live):
        grad = None if out.dim() == 0 else torch.ones_like(out)
    if leaves:
        kept: list[tuple[Node, tuple[Any, ...]]] = []
        nodes = _meeting_nodes(out, leaves, params)
        hooks = [n.register_prehook(lambda g, n=n: kept.append((n, g))) for n in nodes]
        start = live.reset()
        with walks.input_walk:
            dx = torch.autograd.grad(out, leaves, grad, retain_graph=True, allow_unused=True)
        del dx
        for h in hooks:
            h.remove()
        walks.input_extra, walks.kept = live.peak - start, live.now() - start
        edges = [GradientEdge(n, k) for n, gs in kept for k, g in enumerate(gs)
                 if g is not None]
        held = [g for _, gs in kept for g in gs if g is not None]
        start = live.reset()
        if edges:
            with _Recorder(seq, hidden, live):
                got = torch.autograd.grad(edges, params, held, retain_graph=True,
                                          allow_unused=True)
            made = sum(g.numel() * g.element_size() for g in got if g is not None)
            walks.weight_extra = max(0.0, live.peak - start - made)
            del got
        del kept, held, edges
    hooks = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
             for p in params]
    start = live.reset()
    with walks.whole:
        torch.autograd.backward(out, grad, inputs=leaves + params)
    for h in hooks:
        h.remove()
    walks.backward_extra = live.peak - start
    for t in leaves:
        t.grad = None
    return walks


def price(module: nn.Module, inputs: Sequence[Any], target: Target, seq: int,
          hidden: int | None = None) -> UnitPrice:
    """Price `module(*inputs)` (module and inputs on meta; the floating inputs that require
    grad are the unit's activations from the previous unit) on `target`; `hidden` marks
    the element-wise work on whole hidden vectors (`Op.replicated`)."""
    params: list[torch.Tensor] = [p for p in module.parameters() if p.requires_grad]
    exclude = {b.untyped_storage()._cdata for b in module.buffers()}
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    saved, live = _Saved(seq, exclude), _Live()
    forward = _Recorder(seq, hidden, live)
    with _DeviceKernels(), forward, torch.autograd.graph.saved_tensors_hooks(
            saved.pack, lambda t: t):
        out = module(*inputs)
    forward_extra = live.peak - live.now()
    output_bytes = float(out.numel() * out.element_size())
    walks = _walk(out, leaves, params, live, seq, hidden)
    input_walk, whole = walks.input_walk, walks.whole
    f, b, total = (_seconds(r.ops, target) for r in (forward, input_walk, whole))
    rep_b = _seconds(input_walk.ops, target, True)
    return UnitPrice(
        forward=f, input_grad=b, weight_grad=max(0.0, total - b),
        forward_flops=float(sum(op.flops for op in forward.ops)),
        input_grad_flops=float(sum(op.flops for op in input_walk.ops)),
        backward_flops=float(sum(op.flops for op in whole.ops)),
        core_seconds=sum(op.seconds(target) for op in forward.ops if op.core),
        core_flops=float(sum(op.flops for op in forward.ops if op.core)),
        replicated=(_seconds(forward.ops, target, True), rep_b,
                    max(0.0, _seconds(whole.ops, target, True) - rep_b)),
        saved=float(saved.total), saved_core=float(saved.core),
        input_bytes=float(sum(t.numel() * t.element_size() for t in leaves)),
        output_bytes=output_bytes,
        parameters=sum(p.numel() for p in params),
        parameter_bytes=sum(p.numel() * p.element_size() for p in params),
        forward_extra=float(forward_extra), backward_extra=float(walks.backward_extra),
        input_extra=float(walks.input_extra), kept_for_weight=float(walks.kept),
        weight_extra=float(walks.weight_extra),
    )
