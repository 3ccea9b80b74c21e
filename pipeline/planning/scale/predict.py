"""One layout's predicted step time and memory per GPU on a target.

Step: the schedule simulated action by action (scheduler.validate.execute) on the stage
costs, each cross-rank input arriving after its p2p transfer on the link the placement gives
(ranks are laid out tp innermost, then pp, then dp: neighbours tp GPUs apart share a node
when they fall in the same block of gpus_per_node); then, per pipeline rank, each stage's
gradient sync on the dp group starts when that stage's last backward ends (the executor's
overlap with the drain), one after another on the network, in 25 MiB buckets (one call and
its latency each): an all-reduce, or a reduce-scatter under ZeRO-1 / FSDP; then Adam over
the rank's (shard of the) parameters, memory-bound; then ZeRO-1's parameter all-gather
(FSDP's happens before the first forward, the same cost, exposed as well).
The step is the slowest rank's.

Memory per GPU (`pipeline.planning.scale.memory`) and FLOP rates are in the `Prediction`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pipeline.planning.hardware.collectives import Placement, collective_seconds, p2p_seconds
from pipeline.planning.hardware.targets import Network
from pipeline.planning.scale.layout import SYNTH, Job, Layout, fit
from pipeline.planning.scale.memory import (
    BUCKET,
    Memory,
    memory_per_rank,
    param_bytes,
    zero3,
)
from pipeline.planning.scale.stages import StageCosts, accumulate_seconds, stage_costs
from pipeline.planning.scale.units import Units, priced_units
from scheduler import Schedule, build_schedule, synthesize
from scheduler.ir import Op
from scheduler.validate import execute

ADAM_BYTES = 80
"""Bytes torch's Adam/AdamW (its default multi-tensor "foreach" path on CUDA, not fused)
reads and writes per parameter of fp32 state beside the gradient and the weight, pass by
pass (torch/optim/adamw.py, _multi_tensor_adamw): decoupled weight decay on the master
weight (read, write: 8), lerp of the momentum toward the gradient (12), variance scaled (8)
and addcmul'd with the gradient (12), its square root into a new tensor (8), divided by the
bias correction (8), plus eps (8), and addcdiv into the master weight (weight, momentum,
root read, weight written: 16). A fused Adam does it in one pass (24); the gradient is read
and the 16-bit weight written on top (2 x its size)."""


@dataclass(frozen=True)
class Prediction:
    """A layout's prediction: seconds per step and its parts, bubble, bytes per GPU of each
    pipeline rank (and the worst rank's parts), TFLOP/s per GPU (executed FLOPs, recompute
    included, as Megatron reports) and MFU (model FLOPs, no recompute, over peak)."""

    layout: Layout
    dp: int
    microbatch_size: int
    step_time: float
    pipeline_time: float
    allreduce_time: float
    optimizer_time: float
    bubble: float
    peak_memory: tuple[float, ...]
    memory: Memory
    tflops_per_gpu: float
    mfu: float
    built: Schedule | None = field(default=None, compare=False, repr=False)

    @property
    def max_memory(self) -> float:
        return max(self.peak_memory)

    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        out: dict[str, Any] = {
            "tp": lay.tp, "pp": lay.pp, "dp": self.dp, "schedule": lay.schedule,
            "microbatches": lay.microbatches, "virtual_stages": lay.virtual_stages,
            "microbatch_size": self.microbatch_size, "recompute": lay.recompute,
            "zero": lay.zero, "sequence_parallel": lay.sequence_parallel and lay.tp > 1,
            "step_time": self.step_time, "pipeline_time": self.pipeline_time,
            "allreduce_time": self.allreduce_time, "optimizer_time": self.optimizer_time,
            "bubble": self.bubble, "peak_memory": list(self.peak_memory),
            "memory_parts": self.memory.to_dict(), "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu,
        }
        if self.built is not None:
            out["actions"] = self.built.to_text()
        return out


def _node(rank: int, tp: int, gpus_per_node: int) -> int:
    return rank * tp // gpus_per_node


def _simulate(job: Job, layout: Layout, costs: StageCosts, schedule: Schedule
              ) -> list[list[tuple[float, float]]]:
    split, act = schedule.splits_backward, job.target.action_overhead
    ops = [(f + act, b + act, w + act) if split else (f + act, b + w + act, 0.0) for f, b, w in
           zip(costs.forward, costs.input_grad, costs.weight_grad, strict=True)]
    net, g, place = job.target.network, job.gpus_per_node, schedule.placement

    def latency(src: int, dst: int, op: int) -> float:
        same = _node(place[src], layout.tp, g) == _node(place[dst], layout.tp, g)
        return p2p_seconds(net, costs.boundary[min(src, dst)], same)

    return execute(schedule, lambda s, o: ops[s][o], latency)


def dp_group(job: Job, layout: Layout, dp: int) -> Placement:
    """The data-parallel group of a rank: dp ranks, tp x pp GPUs apart."""
    stride = layout.tp * layout.pp
    per_node = max(1, min(dp, job.gpus_per_node // stride)) if stride < job.gpus_per_node else 1
    return Placement(dp, per_node)


def _last_backwards(schedule: Schedule, times: list[list[tuple[float, float]]]
                    ) -> list[list[tuple[float, int]]]:
    """Per rank, (end of its last backward, stage) for each of its stages, in end order."""
    out = []
    for rank, acts in enumerate(schedule.actions):
        last: dict[int, float] = {}
        for action, (_, end) in zip(acts, times[rank], strict=True):
            if action.op is not Op.F:
                last[action.stage] = end
        out.append(sorted((end, stage) for stage, end in last.items()))
    return out


def bucketed_seconds(net: Network, kind: str, nbytes: float, group: Placement) -> float:
    """A stage's gradient sync as the executor runs it: one collective per BUCKET bytes
    (the executor's 25 MiB gradient buckets), each paying its latency."""
    full, rest = divmod(nbytes, BUCKET)
    return full * collective_seconds(net, kind, BUCKET, group) + (
        collective_seconds(net, kind, rest, group) if rest else 0.0)


def _sync(job: Job, layout: Layout, costs: StageCosts, schedule: Schedule,
          sim: Simulated) -> tuple[list[float], list[float]]:
    """Per rank: when its last gradient sync ends, and its optimizer (+ gather) seconds."""
    net, dp = job.target.network, sim.dp
    group = dp_group(job, layout, dp)
    kind = "all_reduce" if layout.zero == "none" else "reduce_scatter"
    pbytes = param_bytes(job.precision)
    ends, after = [], []
    for rank, finishes in enumerate(sim.last_backwards):
        t = 0.0
        for finish, stage in ([] if zero3(layout) else finishes):
            t = max(t, finish) + bucketed_seconds(
                net, kind, costs.parameters[stage] * pbytes, group)
        ends.append(max(t, sim.times[rank][-1][1] if sim.times[rank] else 0.0))
        params = sum(costs.parameters[s] for s in schedule.stages_of(rank))
        shard = params / dp if layout.zero != "none" else params
        target = job.target
        optimizer = shard * (ADAM_BYTES + 2 * pbytes) / (
            target.memory_bandwidth * target.memory_efficiency)
        gather = 0.0 if layout.zero == "none" or zero3(layout) else collective_seconds(
            net, "all_gather", params * pbytes, group)
        after.append(optimizer + gather)
    return ends, after


def _zero3_exposed(job: Job, layout: Layout, sim: Simulated) -> float:
    """FSDP without a pipeline: each microbatch all-gathers the weights for its forward and
    again for its backward and reduce-scatters the gradients, unit by unit, prefetched under
    the compute; what the compute cannot hide, per microbatch."""
    costs, group = sim.costs, dp_group(job, layout, sim.dp)
    nbytes = costs.parameters[0] * param_bytes(job.precision)
    net = job.target.network
    comm = (2 * collective_seconds(net, "all_gather", nbytes, group)
            + collective_seconds(net, "reduce_scatter", nbytes, group))
    compute = costs.forward[0] + costs.input_grad[0] + costs.weight_grad[0]
    return layout.microbatches * max(0.0, comm - compute)


def _flops(job: Job, units: Units, layout: Layout) -> tuple[float, float]:
    """(model, executed) FLOPs of one microbatch through the whole model."""
    if units.chain:
        total = sum(u.forward_flops + u.backward_flops for u in units.chain)
        return total, total
    t, blk = layout.tp, units.block_unsharded
    edges = t * (units.embed.forward_flops + units.embed.backward_flops
                 + units.head.forward_flops + units.head.backward_flops)
    model = edges + job.spec.layers * (blk.forward_flops + blk.backward_flops)
    redo = {"none": 0.0, "selective": blk.core_flops, "full": blk.forward_flops}
    return model, model + job.spec.layers * redo[layout.recompute]


def build(layout: Layout, costs: StageCosts) -> Schedule:
    """The layout's schedule: its generator's, or one synthesised for these costs."""
    if layout.schedule != SYNTH:
        return build_schedule(layout.schedule, layout.pp, layout.microbatches,
                              layout.virtual_stages)
    b = list(costs.input_grad)
    limit = layout.pp * layout.virtual_stages * layout.microbatches  # memory checked after
    return synthesize(layout.pp, layout.microbatches, costs.forward, b, costs.weight_grad,
                      memory_limit=limit, virtual_stages=layout.virtual_stages,
                      time_limit=2.0)


@dataclass(frozen=True)
class Simulated:
    """A layout's pipeline simulated once: what every ZeRO variant of it shares."""

    layout: Layout
    dp: int
    microbatch_size: int
    units: Units
    costs: StageCosts
    schedule: Schedule
    times: list[list[tuple[float, float]]]
    last_backwards: list[list[tuple[float, int]]]


def costs_of(job: Job, layout: Layout) -> tuple[int, int, Units, StageCosts]:
    """(dp, microbatch size, priced units, stage costs) of `layout`; ValueError if it does
    not fit the job."""
    dp, mbs = fit(job, layout)
    units = priced_units(job.spec, job.target, job.precision, layout.tp, mbs)
    return dp, mbs, units, stage_costs(job, layout, units)


def simulate_layout(job: Job, layout: Layout, schedule: Schedule | None = None) -> Simulated:
    """Price and simulate `layout`'s pipeline (`schedule` given: run that one)."""
    dp, mbs, units, costs = costs_of(job, layout)
    sched = schedule or build(layout, costs)
    times = _simulate(job, layout, costs, sched)
    return Simulated(layout, dp, mbs, units, costs, sched, times,
                     _last_backwards(sched, times))


def finish(job: Job, sim: Simulated, zero: str | None = None) -> Prediction:
    """The `Prediction` of a simulated layout with its (or another) ZeRO choice."""
    layout = sim.layout if zero is None else replace(sim.layout, zero=zero)
    times, dp = sim.times, sim.dp
    start = min(t[0][0] for t in times if t)
    makespan = max(t[-1][1] for t in times if t) - start
    ends, after = _sync(job, layout, sim.costs, sim.schedule, sim)
    step = max(e + a for e, a in zip(ends, after, strict=True)) - start + (
        job.target.step_overhead)
    busy = sum(e - s for rank in times for s, e in rank)
    if zero3(layout):
        # Reduce-scattered per microbatch: no whole gradient accumulates (one rank, its
        # actions back to back, so the step sheds each microbatch's accumulation).
        shed = layout.microbatches * accumulate_seconds(job, layout, sum(sim.costs.parameters))
        exposed = _zero3_exposed(job, layout, sim) - shed
        makespan, busy = makespan - shed, busy - shed
        step, ends = step + exposed, [e + exposed for e in ends]
    memory = memory_per_rank(job, layout, sim.costs, sim.schedule, dp)
    model, executed = _flops(job, sim.units, layout)
    total = dp * layout.microbatches
    peak = job.target.peak(job.precision)
    return Prediction(
        layout=layout, dp=dp, microbatch_size=sim.microbatch_size, step_time=step,
        pipeline_time=makespan, allreduce_time=max(ends) - start - makespan,
        optimizer_time=max(after), bubble=max(0.0, 1 - busy / (layout.pp * makespan)),
        peak_memory=tuple(m.total for m in memory), memory=max(memory, key=lambda m: m.total),
        tflops_per_gpu=executed * total / step / job.world_size / 1e12,
        mfu=model * total / step / job.world_size / peak,
        built=sim.schedule if layout.schedule == SYNTH else None,
    )


def predict(job: Job, layout: Layout, schedule: Schedule | None = None) -> Prediction:
    """Predict `layout` for `job` (`schedule` given: run that one)."""
    return finish(job, simulate_layout(job, layout, schedule))
