"""Moving a running pipeline's units to the pipeline ranks a new plan gives them, in memory:
every parameter or buffer that a pipeline rank newly holds is sent to it, within each replica,
by the lowest pipeline rank that held it (point-to-point), with its gradient and its state in
each of this process's optimizers (Adam's moments and step, the param group it was in).

Every process still has the whole model's structure (the executor emptied the tensors of
others' stages, keeping the Parameter objects), so a moved tensor is re-materialised in the
same object: the stage modules, the captured modules and the optimizers keep referring to it.

Under tensor parallelism a moved parameter is a DTensor: each tp rank sends its own shard
(and its gradient's and optimizer state's shards) to the same tp rank of the new pipeline rank
(the peers of a move share the sender's tp coordinate), with the placements in the manifest;
the receiver wraps what arrives as a DTensor of the same placements on its tp mesh, a new
Parameter object put wherever the old one was held (the model, the captured and stage
modules, the optimizers), so nothing is gathered and the values are exact.

Failure safety: what arrives is staged first; only once every process has received all it
needs (an all-reduce over the job, within the timeout) is anything changed, so a rank that
fails during the move leaves every process on the old plan, and the failure protocol makes
every process raise, naming it. What crosses ranks is tensors: a JSON manifest per pair of
ranks (shapes, dtypes, optimizer keys, as uint8 bytes), then the tensors it lists."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from partitioner.rebind import rebind
from pipeline.execution.distributed.context import DistContext


class OptimizerLike(Protocol):
    """What a move reads and updates of an optimizer: its param groups and its state."""

    param_groups: list[dict[str, Any]]
    state: Any


def holders(
    model: nn.Module, modules: Sequence[nn.Module], placement: Sequence[int]
) -> dict[str, set[int]]:
    """The model's parameter and buffer names (a shared tensor once, under its first name) ->
    the pipeline ranks whose stages hold it."""
    ranks: dict[int, set[int]] = {}
    for stage, module in enumerate(modules):
        for t in (*module.parameters(), *module.buffers()):
            ranks.setdefault(id(t), set()).add(placement[stage])
    return {name: ranks[id(t)] for name, t in model_tensors(model).items() if id(t) in ranks}


def model_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The model's parameters and buffers by their first name, in the model's order."""
    return dict((*model.named_parameters(), *model.named_buffers()))


@dataclass
class Moves:
    """What this process (pipeline rank `me`) sends, receives and drops under a new plan.
    `sends[pp]` / `receives[pp]`: tensor names per peer pipeline rank, in the model's order."""

    me: int
    sends: dict[int, list[str]] = field(default_factory=dict)
    receives: dict[int, list[str]] = field(default_factory=dict)
    drops: list[str] = field(default_factory=list)
    moved: int = 0  # tensors that change hands over the whole pipeline


def plan_moves(before: dict[str, set[int]], after: dict[str, set[int]], me: int) -> Moves:
    """The moves of pipeline rank `me` from holders `before` to holders `after`."""
    moves = Moves(me)
    for name, new in after.items():
        old = before.get(name, set())
        gained = sorted(new - old)
        if not old and gained:
            raise ValueError(f"{name} is held by no pipeline rank under the old plan")
        source = min(old) if old else -1
        moves.moved += len(gained)
        for target in gained:
            if source == me:
                moves.sends.setdefault(target, []).append(name)
            if target == me:
                moves.receives.setdefault(source, []).append(name)
        if me in old and me not in new:
            moves.drops.append(name)
    return moves


def _dtype(text: str) -> torch.dtype:
    dtype = getattr(torch, text.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {text!r} in a move manifest")
    return dtype


def _spec(t: Tensor) -> list[Any]:
    """Shape, dtype, whether on the CPU; a DTensor's: its local shard's, then its placements
    and its global shape."""
    if isinstance(t, DTensor):
        return [list(t.to_local().shape), str(t.dtype), t.device.type == "cpu",
                [_placement_text(p) for p in t.placements], list(t.shape)]
    return [list(t.shape), str(t.dtype), t.device.type == "cpu"]


def _placement_text(p: Placement) -> list[Any]:
    if isinstance(p, _StridedShard):
        return ["strided", p.dim, p.split_factor]
    if isinstance(p, Shard):
        return ["shard", p.dim]
    if isinstance(p, Replicate):
        return ["replicate"]
    raise ValueError(f"a moved tensor is a DTensor placed {p}, which a move does not carry; "
                     "rebalance between steps, once the gradients are committed")


def _placement(text: list[Any]) -> Placement:
    if text[0] == "strided":
        return _StridedShard(int(text[1]), split_factor=int(text[2]))
    if text[0] == "shard":
        return Shard(int(text[1]))
    if text[0] == "replicate":
        return Replicate()
    raise ValueError(f"unknown placement {text!r} in a move manifest")


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _where(opt: OptimizerLike, p: Tensor) -> int:
    """The index of the param group holding `p` (-1: none)."""
    return next((g for g, group in enumerate(opt.param_groups)
                 if any(q is p for q in group["params"])), -1)


@dataclass
class Arrived:
    """A tensor received for this process, staged until every process has its own."""

    value: Tensor
    grad: Tensor | None
    # Per optimizer: (param group, state, the keys of the tensors its sender kept on the CPU).
    states: list[tuple[int, dict[str, Any], set[str]]]


class UnitMove:
    """Runs `moves` for this process of `ctx` over the tensors of `model`, carrying the state
    of `optimizers` (the same optimizers, in the same order, on every process)."""

    def __init__(self, ctx: DistContext, model: nn.Module, moves: Moves,
                 optimizers: Sequence[OptimizerLike], holders: Sequence[nn.Module] = ()) -> None:
        self.ctx, self.moves, self.optimizers = ctx, moves, list(optimizers)
        self.holders = [model, *holders]  # where an arriving tp shard's new Parameter goes
        self.tensors = model_tensors(model)
        self.params = {id(p) for p in model.parameters()}
        self.bytes_sent = 0

    def _peer(self, pp: int) -> int:
        return self.ctx.layout.global_rank(pp)

    def _manifest(self, names: list[str]) -> list[Any]:
        entries = []
        for name in names:
            t = self.tensors[name]
            grad = t.grad if id(t) in self.params else None
            states = []
            for opt in self.optimizers:
                state = opt.state.get(t, {})
                states.append([_where(opt, t), [
                    [k, _spec(v)] if isinstance(v, Tensor) else [k, None, v]
                    for k, v in sorted(state.items())
                ]])
            entries.append([_spec(t), None if grad is None else _spec(grad), states])
        return entries

    def _payload(self, names: list[str]) -> list[Tensor]:
        out: list[Tensor] = []
        for name in names:
            t = self.tensors[name]
            out.append(t.detach())
            grad = t.grad if id(t) in self.params else None
            if grad is not None:
                out.append(grad)
            for opt in self.optimizers:
                state = opt.state.get(t, {})
                out += [v for _, v in sorted(state.items()) if isinstance(v, Tensor)]
        device = self.ctx.device
        return [_local(x.detach()).to(device).contiguous() for x in out]

    def exchange(self, sends: dict[int, list[Tensor]], receives: dict[int, list[Tensor]],
                 what: str) -> None:
        """Send and receive every listed tensor at once (no order to deadlock on)."""
        ops, peers = [], []
        for pp, ts in sends.items():
            for t in ts:
                ops.append(dist.P2POp(dist.isend, t, self._peer(pp)))
                peers.append(self._peer(pp))
                self.bytes_sent += t.numel() * t.element_size()
        for pp, ts in receives.items():
            for t in ts:
                ops.append(dist.P2POp(dist.irecv, t, self._peer(pp)))
                peers.append(self._peer(pp))
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        for work, peer in zip(works, peers, strict=True):
            self.ctx.wait_work(work, peer, what)

    def receive(self) -> dict[str, Arrived]:
        """Exchange the manifests and the tensors; what arrived, staged (nothing changed)."""
        device = self.ctx.device
        manifests = {pp: json.dumps(self._manifest(names)).encode()
                     for pp, names in self.moves.sends.items()}
        lengths = {pp: torch.zeros(1, dtype=torch.int64, device=device)
                   for pp in self.moves.receives}
        self.exchange({pp: [torch.tensor([len(m)], dtype=torch.int64, device=device)]
                       for pp, m in manifests.items()},
                      {pp: [t] for pp, t in lengths.items()}, "the size of a move manifest")
        texts = {pp: torch.empty(int(t.item()), dtype=torch.uint8, device=device)
                 for pp, t in lengths.items()}
        self.exchange(
            {pp: [torch.frombuffer(bytearray(m), dtype=torch.uint8).to(device)]
             for pp, m in manifests.items()},
            {pp: [t] for pp, t in texts.items()}, "a move manifest",
        )
        staged: dict[str, Arrived] = {}
        buffers: dict[int, list[Tensor]] = {}
        for pp, names in self.moves.receives.items():
            entries = json.loads(bytes(texts[pp].cpu().numpy()).decode())
            if len(entries) != len(names):
                raise RuntimeError(
                    f"pipeline rank {pp} sends {len(entries)} tensors, {len(names)} expected"
                )
            for name, entry in zip(names, entries, strict=True):
                staged[name] = self._allocate(entry, buffers.setdefault(pp, []))
        self.exchange({pp: self._payload(names) for pp, names in self.moves.sends.items()},
                      buffers, "the moved units' tensors")
        return staged

    def _allocate(self, entry: list[Any], into: list[Tensor]) -> Arrived:
        """Empty tensors for one manifest entry (appended to `into` in payload order)."""
        device = self.ctx.device

        def empty(spec: list[Any]) -> Tensor:
            t = torch.empty(spec[0], dtype=_dtype(spec[1]), device=device)
            into.append(t)
            if len(spec) < 5:
                return t
            shape = torch.Size(spec[4])  # a tp shard: received into its local tensor
            return DTensor.from_local(t, self.ctx.tp_mesh, [_placement(p) for p in spec[3]],
                                      run_check=False, shape=shape,
                                      stride=torch.empty(shape, device="meta").stride())

        value_spec, grad_spec, states = entry
        if len(states) != len(self.optimizers) or any(
            g >= len(opt.param_groups) for (g, _), opt in zip(states, self.optimizers, strict=False)
        ):
            raise ValueError(
                f"{self.ctx.layout.describe()} has {len(self.optimizers)} optimizer(s) with "
                f"{[len(o.param_groups) for o in self.optimizers]} param groups, but a moved "
                f"parameter's sender has {len(states)} ({[g for g, _ in states]} its groups); "
                "build the optimizers alike on every process (pipe.optimizer(...))"
            )
        value = empty(value_spec)
        grad = None if grad_spec is None else empty(grad_spec)
        arrived = Arrived(value, grad, [])
        for group, items in states:
            state: dict[str, Any] = {}
            on_cpu = set()
            for item in items:
                state[item[0]] = empty(item[1]) if item[1] is not None else item[2]
                if item[1] is not None and item[1][2]:
                    on_cpu.add(item[0])
            arrived.states.append((group, state, on_cpu))
        return arrived

    def agree_received(self) -> None:
        """Every process has staged what it needs (an all-reduce of a count over the job)."""
        done = torch.ones(1, dtype=torch.int64, device=self.ctx.device)
        work = dist.all_reduce(done, async_op=True)
        self.ctx.wait_work(work, None, "the end of the move")
        if int(done.item()) != dist.get_world_size():
            raise RuntimeError("a process did not finish the move")

    def commit(self, staged: dict[str, Arrived]) -> None:
        """Re-materialise what arrived and let go of what left (tensors, grads, optimizer
        state and param-group membership); the executor frees the left tensors at load."""
        replaced: dict[int, Tensor] = {}
        with torch.no_grad():
            for name, arrived in staged.items():
                t = self.tensors[name]
                is_param = id(t) in self.params
                if isinstance(arrived.value, DTensor):  # a tp shard: a new object
                    new = nn.Parameter(arrived.value, requires_grad=t.requires_grad) \
                        if is_param else arrived.value
                    replaced[id(t)] = self.tensors[name] = t = new
                else:
                    t.data = arrived.value
                if is_param:
                    t.grad = arrived.grad
                for opt, (group, state, on_cpu) in zip(self.optimizers, arrived.states,
                                                        strict=True):
                    placed = {k: v.cpu() if k in on_cpu else v for k, v in state.items()}
                    self._arrive(opt, t, group, placed)
            for name in self.moves.drops:
                t = self.tensors[name]
                if id(t) in self.params:
                    t.grad = None
                for opt in self.optimizers:
                    opt.state.pop(t, None)
                    for pg in opt.param_groups:
                        pg["params"] = [q for q in pg["params"] if q is not t]
        rebind(self.holders, replaced)

    @staticmethod
    def _arrive(opt: OptimizerLike, t: Tensor, group: int,
                state: dict[str, Any]) -> None:
        if group < 0:
            return
        if not any(q is t for q in opt.param_groups[group]["params"]):
            opt.param_groups[group]["params"].append(t)
        if state:
            opt.state[t] = state


def total_bytes(staged: Iterable[Arrived]) -> int:
    """The bytes of what arrived (values, grads, optimizer state)."""
    count = 0
    for a in staged:
        for t in (a.value, a.grad, *(v for _, s, _ in a.states for v in s.values())):
            if isinstance(t, Tensor):
                count += t.numel() * t.element_size()
    return count
