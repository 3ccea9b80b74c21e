"""Which op outputs "selective" keeps in one block: a knapsack over the outputs of the
candidate ops (matmuls, convolutions, fused attention: `Selective.save`), decided once per
block from one probing forward, and the checkpoint context that keeps exactly those.

The rule (`keep_plan`):
- the block's budget is ``budget`` x the bytes it keeps under "none" (every tensor autograd
  saves, each storage once, parameters not counted), less the inputs the checkpoint keeps
  for it: those that need grad (the activations it receives) and those "none" saves too (a
  rotary table); an input needing no grad that no op of the block saves (token ids a
  stage's block reads for their shape) is the stage's to hold, not the block's: how a
  stage's blocks pass such values around must not change the choice;
- a candidate output is worth keeping only if the recomputation would run its op: the
  non-reentrant checkpoint stops recomputing once the last tensor the backward needs is
  back, so an op running after the block's last saved tensor (the last matmul of a block,
  feeding only the residual add) never runs again, and keeping its output is waste;
- of those, the outputs with the most recompute FLOPs per byte are kept (the FLOPs from
  ``torch.utils.flop_counter``'s formulas; an op with none counts one FLOP per output
  element), the larger first among equals, while they fit the budget.
With ``budget=None`` every candidate output the recomputation would use is kept.

The plan names outputs by op and call ordinal inside the block (the 3rd ``aten.addmm``), which
the forward and its recomputation share; the probe runs on clones of the inputs, draws from a
forked RNG, and its outputs are dropped. A block that traces is probed on fake tensors
(``fake=True``: the same sizes and ops, no memory), so planning it inside a training step does
not hold its "none" bytes on top of the step's."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.flop_counter import flop_registry

from partitioner.saved_bytes import SavedBytes, storage_key

_aten = torch.ops.aten
# Fused attention on CPU has no formula of its own; its leading (query, key, value)
# arguments are the GPU kernels'.
_FLOPS_AS = {_aten._scaled_dot_product_flash_attention_for_cpu:
             _aten._scaled_dot_product_flash_attention}


def op_flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> float:
    packet = _FLOPS_AS.get(func.overloadpacket, func.overloadpacket)
    formula = flop_registry.get(packet)
    if formula is None:
        return float(sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)))
    return float(formula(*args, **kwargs, out_val=out))


@dataclass(frozen=True)
class Candidate:
    """One call of a candidate op in the block's forward: its op, ordinal among that op's
    calls, output bytes (new storages only), FLOPs, and whether a recomputation runs it."""

    func: Any
    ordinal: int
    nbytes: float
    flops: float
    recomputed: bool


class _Probe(TorchDispatchMode):
    """Records the calls of the candidate ops and how many ops ran before each save."""

    def __init__(self, save: Sequence[Any]) -> None:
        super().__init__()
        self.save = set(save)
        self.ops = 0
        self.calls: list[tuple[int, Candidate]] = []  # (ops run before it, the call)
        self.counts: dict[Any, int] = defaultdict(int)
        self.seen: set[tuple[Any, ...]] = set()  # storages counted already
        self.held: list[torch.Tensor] = []  # so that no counted storage's memory is reused

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in self.save:
            nbytes = 0.0
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and storage_key(t) not in self.seen:
                    self.seen.add(storage_key(t))
                    self.held.append(t)
                    nbytes += t.untyped_storage().nbytes()
            self.calls.append((self.ops, Candidate(func, self.counts[func], nbytes,
                                                   op_flops(func, args, kwargs, out), False)))
            self.counts[func] += 1
        self.ops += 1
        return out


@dataclass(frozen=True)
class KeepPlan:
    """The outputs one block keeps under "selective" (by op and ordinal), with the figures
    the choice was made from (bytes per microbatch, FLOPs of the candidate ops)."""

    keep: dict[Any, frozenset[int]]
    none_bytes: float
    input_bytes: float
    kept_bytes: float  # the inputs charged (see the module docstring) and the kept outputs
    candidates: tuple[Candidate, ...] = field(default=())

    @property
    def recompute_flops(self) -> float:
        """Candidate-op FLOPs a recomputation runs (the rest of its work is pointwise)."""
        return sum(c.flops for c in self.candidates
                   if c.recomputed and c.ordinal not in self.keep.get(c.func, ()))

    @property
    def full_recompute_flops(self) -> float:
        """The same under "full" (nothing kept)."""
        return sum(c.flops for c in self.candidates if c.recomputed)

    def contexts(self) -> tuple[Any, Any]:
        """A ``context_fn`` for ``torch.utils.checkpoint``: one forward's caching and
        recomputation contexts keeping the planned outputs (fresh call counts each time)."""
        counts: dict[Any, int] = defaultdict(int)

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            kept = self.keep.get(func)
            if kept is None:
                return CheckpointPolicy.PREFER_RECOMPUTE
            n = counts[func]
            counts[func] += 1
            return (CheckpointPolicy.MUST_SAVE if n in kept
                    else CheckpointPolicy.PREFER_RECOMPUTE)

        return create_selective_checkpoint_contexts(policy)


def probe_inputs(values: Sequence[Any]) -> list[Any]:
    """`values` as a block sees them inside a stage: a tensor needing grad as the output of an
    earlier op (not a leaf: a leaf needing grad counts as a parameter), the rest as is."""
    return [v.detach().requires_grad_().clone()
            if isinstance(v, torch.Tensor) and v.requires_grad else v for v in values]


def choose(candidates: Sequence[Candidate], room: float | None) -> list[Candidate]:
    usable = [c for c in candidates if c.recomputed and c.nbytes > 0]
    if room is None:
        return usable
    usable.sort(key=lambda c: (-c.flops / c.nbytes, -c.nbytes))
    chosen = []
    for c in usable:
        if c.nbytes <= room:
            chosen.append(c)
            room -= c.nbytes
    return chosen


def keep_plan(run: Callable[..., Any], values: Sequence[Any], save: Sequence[Any],
              budget: float | None, *, fake: bool = False) -> KeepPlan:
    """The plan of the block `run` on `values` (see the module docstring): one forward of it,
    its saved tensors counted. `fake`: that forward runs on fake tensors (FakeTensorMode: the
    same shapes, sizes and ops, no memory and no side effects), for a block that traces."""
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fakes = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in values]
            return keep_plan(run, fakes, save, budget)
    args = probe_inputs(values)
    devices = sorted({a.device.index or 0 for a in args
                      if isinstance(a, torch.Tensor) and a.device.type == "cuda"})
    meter, probe = SavedBytes(), _Probe(save)
    last = [0]  # ops run before the last save
    saved: set[tuple[Any, ...]] = set()  # storages saved

    def pack(t: torch.Tensor) -> Any:
        last[0] = probe.ops
        saved.add(storage_key(t))
        return meter._pack(t)

    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        with torch.autograd.graph.saved_tensors_hooks(pack, meter._unpack), probe:
            out = run(*args)
        none = float(meter.held)
        del out
    inputs: dict[tuple[Any, ...], float] = {
        storage_key(a): float(a.untyped_storage().nbytes()) for a in args
        if isinstance(a, torch.Tensor) and (a.requires_grad or storage_key(a) in saved)}
    candidates = tuple(Candidate(c.func, c.ordinal, c.nbytes, c.flops, before < last[0])
                       for before, c in probe.calls)
    room = None if budget is None else budget * none - sum(inputs.values())
    chosen = choose(candidates, room)
    keep: dict[Any, set[int]] = defaultdict(set)
    for c in chosen:
        keep[c.func].add(c.ordinal)
    return KeepPlan({f: frozenset(k) for f, k in keep.items()}, none,
                    sum(inputs.values()), sum(inputs.values()) + sum(c.nbytes for c in chosen),
                    candidates)
