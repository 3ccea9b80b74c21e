"""Memory per GPU of one layout, per pipeline rank:

- parameters, gradients and optimizer state (Rajbhandari et al., ZeRO, SC20): mixed
  precision keeps a 16-bit weight (2 bytes), a 16-bit gradient (2) and fp32 master weight,
  momentum and variance (12); fp32 keeps 4 + 4 + 8. ZeRO-1 shards the optimizer state over
  the dp replicas. FSDP2 shards all three; without a pipeline (pp=1) it reshards after each
  unit's forward (ZeRO-3: only the unit running and the one prefetched are gathered, with
  their gradients), while per pipeline stage (torchtitan keeps stages unsharded through
  the step: reshard_after_forward off) it holds the gathered weights and the unsharded
  gradients during the step;
- the step, walked action by action in the rank's order (`_Walk`), unit by unit inside
  each action, as the runtime frees and allocates:
  - the activations each F keeps until its microbatch's B (a split B keeps more, the
    gradients W starts from, until W): 1F1B's first rank holds p microbatches;
  - each action's working set on top (pricing.UnitPrice: the forward's temporaries, the
    backward's gradients, the recompute working set; W makes a unit's weight grads at once
    and holds them until the stage's W ends);
  - the weight gradients, from the stage's first backward (B, or W when split) on: the
    runtime's step buffers, committed into `.grad` (cleared before the step, as a training
    loop's zero_grad does); the step's peak is the most the walk holds, and the rank's peak
    the larger of it and the state after the step (weights, gradients, optimizer state);
  - the p2p buffers: a received activation is the stage input the runtime keeps until the
    microbatch's B; a received gradient lives until its B ends; a sent activation is the
    stage output, kept until its B. The gloo transport (the CPU target) posts every receive
    of the step (up to AHEAD_BYTES per peer) when the step starts and keeps each send until
    the step's end (the runtime's p2p transport under gloo);
  - two 25 MiB gradient buckets under data parallelism (torch DDP's bucket_cap_mb default).
`Memory` is the rank's peak moment, by part.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pipeline.planning.scale.layout import Job, Layout
from pipeline.planning.scale.stages import StageCosts, Working
from scheduler import Schedule
from scheduler.ir import Op

BUCKET = 25 * 2**20
AHEAD_BYTES = 64 * 2**20
"""Bytes of receives the gloo transport posts ahead per peer (the runtime's AHEAD_BYTES)."""


def param_bytes(precision: str) -> int:
    """Bytes of one weight (and of its gradient) in `precision`."""
    return 4 if precision == "fp32" else 2


@dataclass(frozen=True)
class Memory:
    """One pipeline rank's bytes per GPU by part."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    recompute: float
    buffers: float

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer + self.activations
                + self.recompute + self.buffers)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}


def state(params: float, precision: str, zero: str, dp: int, reshard: bool = False
          ) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes of `params` parameters (`reshard`: FSDP
    resharding after forward, all three sharded)."""
    pb = param_bytes(precision)
    kept = 8 if precision == "fp32" else 12
    if zero == "fsdp" and reshard:
        return params * pb / dp, params * pb / dp, params * kept / dp
    if zero == "zero1":
        return params * pb, params * pb, params * kept / dp
    if zero == "fsdp":
        return params * pb * (1 + 1 / dp), params * pb, params * kept / dp
    return params * pb, params * pb, params * kept


def zero3(layout: Layout) -> bool:
    """Whether FSDP reshards after forward (no pipeline: ZeRO-3 per unit)."""
    return layout.zero == "fsdp" and layout.pp == 1


@dataclass(frozen=True)
class _StagePeaks:
    """One stage's actions, unit by unit, folded into what each adds at its peak over the
    bytes the rank holds when it starts (so the walk is one step per action): `held` and
    `kept` per microbatch, its gradients' bytes, and the peaks of F, of a whole backward
    (`backward`; `first_backward` when it makes the stage's gradients), of a split B, and
    of W (from what B kept; stage 0's W is a whole backward making every weight grad)."""

    held: float
    kept: float
    grads: float
    forward: float
    backward: float
    first_backward: float
    input_grad: float
    weight_grad: float
    plain_weight_grad: float


def _stage_peaks(units: tuple[Working, ...], grad_byte: float) -> _StagePeaks:
    forward = backward = first = input_grad = weight = plain = 0.0
    held = freed = made = kept = 0.0
    for u in units:
        held += u.held
        forward = max(forward, held + u.forward)
    for u in reversed(units):  # the backward runs the units last to first
        backward = max(backward, u.backward - freed)
        first = max(first, u.backward - freed + made)
        input_grad = max(input_grad, u.input_grad + kept)
        kept += u.kept
        grads = u.grads * grad_byte
        weight = max(weight, made + grads + u.weight_grad)
        freed += u.held
        made += grads
    plain = first
    return _StagePeaks(held, kept, made, forward, backward, first, input_grad, weight, plain)


_Peak = tuple[float, float, float, float, float]
_WALKED: dict[tuple[int, int, int, str, tuple[float, ...]], tuple[Schedule, StageCosts, _Peak]] = {}
"""Walks done, by schedule, costs, rank, transport and gradient bytes: a search finishes
each simulated layout under every ZeRO choice, which mostly leave the walk as it was."""


def _walk(job: Job, schedule: Schedule, costs: StageCosts, rank: int,
          grads: dict[int, float]) -> _Peak:
    """(total, activations, working, gradients, p2p) at the rank's step peak."""
    key = (id(schedule), id(costs), rank, job.target.transport, tuple(grads.values()))
    seen = _WALKED.get(key)
    if seen is not None and seen[0] is schedule and seen[1] is costs:
        return seen[2]
    if len(_WALKED) > 4096:
        _WALKED.clear()
    peak = _walked(job, schedule, costs, rank, grads)
    _WALKED[key] = (schedule, costs, peak)
    return peak


def _posted(schedule: Schedule, costs: StageCosts, rank: int, gets_act: list[bool],
            gets_grad: list[bool]) -> float:
    """The bytes of every receive of the step, per peer up to AHEAD_BYTES (gloo)."""
    per_peer: dict[int, float] = {}
    place, boundary = schedule.placement, costs.boundary
    for a in schedule.actions[rank]:
        if a.op is Op.F and gets_act[a.stage]:
            peer = place[a.stage - 1]
            per_peer[peer] = per_peer.get(peer, 0.0) + boundary[a.stage - 1]
        if a.op is Op.B and gets_grad[a.stage]:
            peer = place[a.stage + 1]
            per_peer[peer] = per_peer.get(peer, 0.0) + boundary[a.stage]
    return sum(min(b, AHEAD_BYTES) for b in per_peer.values())


def _walked(job: Job, schedule: Schedule, costs: StageCosts, rank: int,
            grads: dict[int, float]) -> _Peak:
    """The walk itself, one pass over the rank's actions (a search runs it thousands of
    times: kept to plain locals). Working sets are each action's peak over what it starts
    with (`_StagePeaks`); a received activation is kept until its microbatch's B, as is the
    stage output unless gloo keeps the send to the step's end."""
    gloo, n, m = job.target.transport == "gloo", schedule.num_stages, schedule.num_microbatches
    place, boundary, split = schedule.placement, costs.boundary, schedule.splits_backward
    peaks = {s: _stage_peaks(costs.units[s], grads[s] / max(1, costs.parameters[s]))
             for s in grads}
    gets_act = [s > 0 and place[s - 1] != place[s] for s in range(n)]
    gets_grad = [s < n - 1 and place[s + 1] != place[s] for s in range(n)]
    later = [0.0] * (n * m)  # p2p bytes freed at a microbatch's B
    started = [False] * n
    held = kept = made = 0.0
    p2p = _posted(schedule, costs, rank, gets_act, gets_grad) if gloo else 0.0
    best: _Peak = (0.0, 0.0, 0.0, 0.0, 0.0)
    for a in schedule.actions[rank]:
        s, op, st = a.stage, a.op, peaks[a.stage]
        key = s * m + a.microbatch
        if op is Op.F:
            if gets_act[s]:
                p2p += 0.0 if gloo else boundary[s - 1]
                later[key] += boundary[s - 1]
            work = st.forward
        elif op is Op.B:
            p2p += boundary[s] if gets_grad[s] and not gloo else 0.0
            work = (st.input_grad if s > 0 else 0.0) if split else (
                st.backward if started[s] else st.first_backward)
        else:
            work = st.plain_weight_grad if s == 0 else st.weight_grad
        total = held + kept + work + made + p2p
        if total > best[0]:
            best = (total, held + kept, work, made, p2p)
        if op is Op.F:
            held += st.held
            if s < n - 1:  # the stage output: sent, or mailed to a stage on this rank
                p2p += boundary[s]
                if not (gloo and gets_grad[s]):
                    later[key] += boundary[s]
            continue
        if op is Op.B:
            kept += st.kept if split and s > 0 else 0.0
            p2p -= boundary[s] if gets_grad[s] else 0.0
            p2p += boundary[s - 1] if gets_act[s] and gloo else 0.0  # kept to the step's end
        elif s > 0:
            kept -= st.kept
        if op is Op.W or not split:  # the microbatch's last backward action
            held -= st.held
            p2p -= later[key]
            later[key] = 0.0
            if not started[s]:
                started[s] = True
                made += st.grads
        total = held + kept + made + p2p
        if total > best[0]:
            best = (total, held + kept, 0.0, made, p2p)
    return best


def memory_per_rank(job: Job, layout: Layout, costs: StageCosts, schedule: Schedule,
                    dp: int) -> list[Memory]:
    """Each pipeline rank's `Memory` at its peak."""
    out = []
    for rank in range(schedule.num_ranks):
        stages = schedule.stages_of(rank)
        params = sum(costs.parameters[s] for s in stages)
        reshard = zero3(layout)
        weights, grads, optimizer = state(params, job.precision, layout.zero, dp, reshard)
        buffers = 2 * BUCKET if dp > 1 else 0.0
        if reshard:  # the unit running and the one prefetched, weights and gradients
            buffers += 2 * 2 * max(costs.largest_unit[s] for s in stages) * param_bytes(
                job.precision)
        share = {s: grads * costs.parameters[s] / max(1, params) for s in stages}
        total, held, working, step_grads, p2p = _walk(job, schedule, costs, rank, share)
        if total < grads:  # the state after the step weighs more than the step did
            held, working, step_grads, p2p = 0.0, 0.0, grads, 0.0
        out.append(Memory(weights, step_grads, optimizer, held, working, buffers + p2p))
    return out
