"""Price one unit (a module and its inputs) op by op on a `Target`, on meta tensors: no
weights, no device. The unit runs forward, then its input-grad walk (B), then the whole
backward (B + W); a TorchDispatchMode records every aten op that launches a kernel, its
FLOPs (torch.utils.flop_counter's formulas) and the bytes it reads and writes, and each is
priced by `Target.op_seconds` (roofline with a floor). W = whole backward - B, op by op
additive. Saved-tensor hooks count what the forward keeps for the backward (each storage
once; parameters and buffers not counted), and which of it is the attention core (tensors
ending in seq x seq, the ones Korthikanti et al.'s selective recompute drops).

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


class _Recorder(TorchDispatchMode):
    """Records each kernel-launching aten op as an `Op`."""

    def __init__(self, seq: int, hidden: int | None) -> None:
        super().__init__()
        self.seq, self.hidden = seq, hidden
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
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


def _seconds(ops: list[Op], target: Target, replicated: bool = False) -> float:
    return sum(op.seconds(target) for op in ops if op.replicated or not replicated)


def price(module: nn.Module, inputs: Sequence[Any], target: Target, seq: int,
          hidden: int | None = None) -> UnitPrice:
    """Price `module(*inputs)` (module and inputs on meta; the floating inputs that require
    grad are the unit's activations from the previous unit) on `target`; `hidden` marks
    the element-wise work on whole hidden vectors (`Op.replicated`)."""
    params = [p for p in module.parameters() if p.requires_grad]
    exclude = {b.untyped_storage()._cdata for b in module.buffers()}
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    saved = _Saved(seq, exclude)
    forward = _Recorder(seq, hidden)
    with _DeviceKernels(), forward, torch.autograd.graph.saved_tensors_hooks(
            saved.pack, lambda t: t):
        out = module(*inputs)
    grad = None if out.dim() == 0 else torch.ones_like(out)
    input_walk = _Recorder(seq, hidden)
    if leaves:
        with input_walk:
            torch.autograd.grad(out, leaves, grad, retain_graph=True)
    whole = _Recorder(seq, hidden)
    with whole:
        torch.autograd.grad(out, leaves + params, grad)
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
        output_bytes=float(out.numel() * out.element_size()),
        parameters=sum(p.numel() for p in params),
        parameter_bytes=sum(p.numel() * p.element_size() for p in params),
    )
