"""The search over layouts for a job on a target: every (tp, pp, microbatch size, schedule
with its chunks, recompute) that fits, each priced and simulated once (`predict`) and
finished for every ZeRO choice (none, ZeRO-1, FSDP2), ranked by predicted step time under
the memory cap (the target's capacity unless given), plus schedules synthesised for the
best few configurations. A layout is not simulated when its memory at the least (under
FSDP without a pipeline, ZeRO-1 with one) already exceeds the cap, or when its lower bound
(the slowest rank's wait for the first forwards plus all its work) cannot beat the
`keep`-th best; the plan counts each reason."""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pipeline.planning.scale.graph import GraphSpec
from pipeline.planning.scale.layout import RECOMPUTE, SYNTH, ZERO, Job, Layout
from pipeline.planning.scale.memory import memory_per_rank, state, zero3
from pipeline.planning.scale.predict import (
    Prediction,
    Simulated,
    build,
    costs_of,
    finish,
    simulate_layout,
)
from pipeline.planning.scale.stages import StageCosts
from scheduler import SCHEDULES, Schedule

MICROBATCH_SIZES = (1, 2, 4, 8)
_CHUNKS = {"interleaved-1f1b": (2, 4), "zbv": (2,), "dualpipev": (2,)}


@dataclass(frozen=True)
class ScalePlan:
    """The ranked feasible predictions (fastest first) and how many layouts were
    rejected, by reason."""

    job: Job
    memory_limit: float
    candidates: list[Prediction]
    simulated: int
    rejected: dict[str, int]
    seconds: float
    notes: list[str] = field(default_factory=list)

    def table(self, top: int = 20) -> str:
        """The ranked table: layout, step, TFLOP/s per GPU, MFU, memory per GPU."""
        rows = [f"{'#':>3} {'tp':>3} {'pp':>4} {'dp':>5} {'mbs':>4} {'m':>5} {'v':>2} "
                f"{'schedule':<17}{'recompute':<10}{'zero':<6}{'step s':>9} {'TFLOP/s':>8} "
                f"{'MFU':>6} {'GiB/GPU':>8} {'bubble':>7}"]
        for i, c in enumerate(self.candidates[:top], 1):
            lay = c.layout
            rows.append(
                f"{i:>3} {lay.tp:>3} {lay.pp:>4} {c.dp:>5} {c.microbatch_size:>4} "
                f"{lay.microbatches:>5} {lay.virtual_stages:>2} {lay.schedule:<17}"
                f"{lay.recompute:<10}{lay.zero:<6}{c.step_time:>9.3f} "
                f"{c.tflops_per_gpu:>8.1f} {c.mfu:>6.1%} {c.max_memory / 2**30:>8.1f} "
                f"{c.bubble:>7.1%}")
        job = self.job
        reasons = "; ".join(f"{n} {why}" for why, n in sorted(self.rejected.items(),
                                                              key=lambda kv: -kv[1]))
        rows.append(
            f"{job.spec.family} on {job.world_size} x {job.target.name}, batch "
            f"{job.batch_size}{f' x {job.spec.seq} tokens' if job.spec.seq else ''}, "
            f"{job.precision}, memory cap "
            f"{self.memory_limit / 2**30:.1f} GiB/GPU: {self.simulated} simulated, "
            f"{sum(self.rejected.values())} rejected ({reasons or 'none'}); "
            f"{len(self.candidates)} kept; {self.seconds:.1f} s")
        rows.extend(self.notes)
        return "\n".join(rows)

    def to_dict(self) -> dict[str, Any]:
        job = self.job
        return {
            "model": job.spec.name if isinstance(job.spec, GraphSpec) else job.spec.__dict__,
            "target": job.target.name,
            "world_size": job.world_size, "batch_size": job.batch_size,
            "precision": job.precision, "memory_limit": self.memory_limit,
            "simulated": self.simulated, "rejected": self.rejected, "seconds": self.seconds,
            "notes": self.notes, "candidates": [c.to_dict() for c in self.candidates],
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _one_rank(schedules: Sequence[str]) -> list[str]:
    """The schedule a single pipeline rank is tried with (1F1B when asked for)."""
    plain = [n for n in schedules if n not in _CHUNKS]
    return ["1f1b"] if "1f1b" in plain else plain[:1]


def layouts(job: Job, schedules: Sequence[str]) -> Iterator[Layout]:
    """Every layout of generator schedules the sizes allow (ZeRO left to `finish`)."""
    g = job.gpus_per_node
    graph = isinstance(job.spec, GraphSpec)
    for tp in (t for t in _divisors(1 if graph else g) if job.world_size % t == 0):
        for pp in _divisors(job.world_size // tp):
            if pp > job.spec.layers:
                continue
            dp = job.world_size // (tp * pp)
            for mbs in MICROBATCH_SIZES:
                if job.batch_size % (dp * mbs):
                    continue
                m = job.batch_size // (dp * mbs)
                if pp > 1 and not pp <= m <= 8 * pp:
                    continue  # past 8 x pp the 1F1B bubble is under 11%: m only shrinks
                # One rank runs its actions back to back whatever the schedule: try one.
                for name in schedules if pp > 1 else _one_rank(schedules):
                    for v in (_CHUNKS.get(name, (1,)) if pp > 1 else (1,)):
                        if pp * v > job.spec.layers + 2:
                            continue
                        for recompute in ("none",) if graph else RECOMPUTE:
                            yield Layout(tp, pp, m, v, name, recompute)


def _stages_of(layout: Layout, rank: int) -> list[int]:
    p, v = layout.pp, layout.virtual_stages
    if v == 1:
        return [rank]
    if layout.schedule in ("zbv", "dualpipev"):
        return [rank, 2 * p - 1 - rank]
    return [rank + k * p for k in range(v)]


def _lower_bound(costs: StageCosts, layout: Layout) -> float:
    """The slowest rank's wait for microbatch 0's forwards below it plus all its work."""
    work = [f + b + w for f, b, w in zip(costs.forward, costs.input_grad, costs.weight_grad,
                                         strict=True)]
    return max(sum(costs.forward[:min(_stages_of(layout, r))])
               + layout.microbatches * sum(work[s] for s in _stages_of(layout, r))
               for r in range(layout.pp))


class _Ranking:
    def __init__(self, keep: int, limit: float) -> None:
        self.keep, self.limit = keep, limit
        self.heap: list[tuple[float, int, Prediction]] = []
        self.simulated = 0
        self.rejected: Counter[str] = Counter()

    def bound(self) -> float:
        return -self.heap[0][0] if len(self.heap) >= self.keep else float("inf")

    def offer(self, sim: Simulated, job: Job) -> None:
        self.simulated += 1
        fits = [p for p in (finish(job, sim, z) for z in ZERO) if p.max_memory <= self.limit]
        if not fits:
            self.rejected["over the memory cap"] += 1
            return
        best = min(fits, key=lambda p: (p.step_time, p.max_memory))
        entry = (-best.step_time, self.simulated, best)
        if len(self.heap) < self.keep:
            heapq.heappush(self.heap, entry)
        elif best.step_time < -self.heap[0][0]:
            heapq.heapreplace(self.heap, entry)

    def ranked(self) -> list[Prediction]:
        return sorted((p for _, _, p in self.heap), key=lambda p: (p.step_time, p.max_memory))


class _Memo:
    """Stage costs and schedules shared by the layouts that differ only elsewhere."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.costs: dict[tuple[Any, ...], tuple[int, StageCosts]] = {}
        self.schedules: dict[tuple[Any, ...], Schedule] = {}

    def costs_of(self, layout: Layout) -> tuple[int, StageCosts]:
        key = (layout.tp, layout.pp, layout.virtual_stages, layout.microbatches,
               layout.recompute, layout.sequence_parallel)
        if key not in self.costs:
            dp, _, _, costs = costs_of(self.job, layout)
            self.costs[key] = (dp, costs)
        return self.costs[key]

    def schedule(self, layout: Layout, costs: StageCosts) -> Schedule:
        key = (layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages)
        if key not in self.schedules:
            self.schedules[key] = build(layout, costs)
        return self.schedules[key]


def _bounded(job: Job, names: Sequence[str], ranking: _Ranking, memo: _Memo
             ) -> list[tuple[float, int, Layout]]:
    """Every layout that fits and whose floor on memory is under the cap, with its lower
    bound, most promising first (so the kept set fills with fast ones and the bound prunes
    the rest)."""
    out = []
    for i, layout in enumerate(layouts(job, names)):
        try:
            dp, costs = memo.costs_of(layout)
        except ValueError as err:
            ranking.rejected[_reason(str(err))] += 1
            continue
        if _least_memory(job, layout, costs, dp) > ranking.limit:
            ranking.rejected["over the memory cap"] += 1
        else:
            out.append((_lower_bound(costs, layout), i, layout))
    return sorted(out)


def _try(job: Job, layout: Layout, ranking: _Ranking, memo: _Memo) -> None:
    dp, costs = memo.costs_of(layout)
    try:
        schedule = memo.schedule(layout, costs)
    except ValueError as err:
        ranking.rejected[_reason(str(err))] += 1
        return
    least = memory_per_rank(job, _leanest(layout), costs, schedule, dp)
    if max(m.total for m in least) > ranking.limit:
        ranking.rejected["over the memory cap"] += 1
    else:
        ranking.offer(simulate_layout(job, layout, schedule), job)


def _leanest(layout: Layout) -> Layout:
    """The layout with the ZeRO choice that holds the least: FSDP resharding after forward
    without a pipeline, ZeRO-1 with one."""
    return replace(layout, zero="fsdp" if layout.pp == 1 else "zero1")


def _least_memory(job: Job, layout: Layout, costs: StageCosts, dp: int) -> float:
    """A floor on the largest rank's bytes under its leanest ZeRO choice, with no schedule
    built: its parameter state plus one microbatch held in each of its stages."""
    lean = _leanest(layout)
    return max(sum(sum(state(costs.parameters[s], job.precision, lean.zero, dp,
                             zero3(lean))) + costs.held[s] for s in _stages_of(layout, r))
               for r in range(layout.pp))


def _reason(message: str) -> str:
    for key, why in (("tp=", "tp does not divide the model"), ("batch", "batch split"),
                     ("stages exceed", "more stages than units")):
        if key in message:
            return why
    return "schedule does not take these sizes"


def search(job: Job, *, memory_limit: float | None = None, keep: int = 20,
           schedules: Sequence[str] | None = None, synthesized_configs: int = 2) -> ScalePlan:
    """Rank the layouts of `job` (see the module docstring)."""
    started = time.perf_counter()
    limit = memory_limit if memory_limit is not None else job.target.memory_capacity
    names = list(schedules) if schedules is not None else [*sorted(SCHEDULES), SYNTH]
    unknown = [n for n in names if n not in SCHEDULES and n != SYNTH]
    if unknown:
        raise ValueError(f"unknown schedules {unknown}; use {[*sorted(SCHEDULES), SYNTH]}")
    ranking, memo = _Ranking(keep, limit), _Memo(job)
    ordered = _bounded(job, [n for n in names if n != SYNTH], ranking, memo)
    for i, (bound, _, layout) in enumerate(ordered):
        if bound >= ranking.bound():
            ranking.rejected["bound cannot beat the kept"] += len(ordered) - i
            break
        _try(job, layout, ranking, memo)
    notes: list[str] = []
    if SYNTH in names:
        _synthesized(job, ranking, synthesized_configs, notes)
    return ScalePlan(job, limit, ranking.ranked(), ranking.simulated, dict(ranking.rejected),
                     time.perf_counter() - started, notes)


def _synthesized(job: Job, ranking: _Ranking, configs: int, notes: list[str]) -> None:
    """A schedule synthesised for each of the best `configs` pipelined layouts' costs."""
    seen = []
    for p in ranking.ranked():
        lay = p.layout
        key = (lay.tp, lay.pp, lay.microbatches, lay.virtual_stages, lay.recompute)
        if lay.pp == 1 or key in seen:
            continue
        seen.append(key)
        if lay.pp * lay.virtual_stages * lay.microbatches > 1024:
            notes.append(f"synth: not searched for {lay.describe()} (over 1024 cells)")
        else:
            ranking.offer(simulate_layout(job, replace(lay, schedule=SYNTH, zero="none")), job)
        if len(seen) == configs:
            return
