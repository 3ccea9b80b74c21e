"""The auto-planner: choose (pipeline ranks, data-parallel replicas, schedule, microbatches,
virtual stages) for a profiled model by simulating every candidate through the one cost model
(`pipeline.planning.costs`) under a per-device memory cap, and rank them by predicted step time.

Model of one candidate (pp ranks x dp replicas = world size, global batch B):
- each replica runs B / dp samples in m microbatches; a microbatch's F/B/W seconds and
  activation bytes are the profiled ones scaled by its size over the profiled microbatch's
  (linear in samples: a fixed per-op cost would make small microbatches dearer than this says;
  a calibration's `overhead` per action covers the runtime's share of that);
- the graph is partitioned for pp x v stages exactly as `Pipeline` would (balance="profile");
- step = simulated pipeline makespan (+ `latency` per cross-rank transfer, `overhead` per
  action) + the gradient all-reduce over dp replicas, a ring of 2 (dp-1)/dp x the rank's
  parameter bytes at `dp_bandwidth` (not overlapped: an upper bound);
- memory per rank = parameter bytes x optimizer_factor (weights, grads, Adam's two moments) +
  the simulated peak of held activation bytes.
Candidates over `memory_limit` are dropped before they are simulated (a rank's peak held
activations follow from its action order alone: `scheduler.simulate.peak_held`), and so are
those whose lower bound (a rank's wait for microbatch 0's forwards below it plus all its
work, plus the all-reduce) cannot beat the `keep`-th best found so far.

"synth" among the schedules (the default) adds, for the `synthesized_configs` best (pp, m, v)
found, a schedule searched for those very costs under the memory left beside the parameters
(`scheduler.synthesize` via `pipeline.planning.synthesis`); the candidate carries it as
`built`.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import networkx as nx

from pipeline.planning.costs import StageCosts, costs_for_stages, predict, predict_summary
from pipeline.planning.synthesis import OPTIMIZER_FACTOR, SYNTH, inflight_limits, synthesized
from scheduler import SCHEDULES, Schedule, Timeline, build_schedule
from scheduler.simulate import peak_held


@dataclass(frozen=True)
class Candidate:
    """One configuration and its prediction: seconds per step, bubble fraction of the
    pipeline part, and peak bytes per pipeline rank (parameters x optimizer factor + held
    activations)."""

    pp: int
    dp: int
    schedule: str
    microbatches: int
    virtual_stages: int
    step_time: float
    pipeline_time: float
    allreduce_time: float
    bubble: float
    peak_memory: tuple[float, ...]
    built: Schedule | None = field(default=None, compare=False, repr=False)

    @property
    def max_memory(self) -> float:
        return max(self.peak_memory)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "built"}
        out["peak_memory"] = list(self.peak_memory)
        if self.built is not None:
            out["actions"] = self.built.to_text()
        return out


@dataclass(frozen=True)
class AutoPlan:
    """The ranked feasible candidates (fastest first) and how the search went."""

    world_size: int
    batch_size: int
    memory_limit: float | None
    candidates: list[Candidate]
    simulated: int
    over_memory: int
    pruned: int
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Candidate:
        if not self.candidates:
            limit = "no cap" if self.memory_limit is None else f"{self.memory_limit:.4g} bytes"
            raise ValueError(
                f"no configuration fits: {self.over_memory} candidates exceed the memory limit "
                f"({limit}) per device; raise memory_limit, "
                "add ranks, or allow more microbatches / other schedules"
            )
        return self.candidates[0]

    def table(self, top: int = 20) -> str:
        """The ranked table: (pp, dp, schedule, m, v), predicted step, bubble, peak memory."""
        rows = [
            f"{'#':>3} {'pp':>5} {'dp':>5} {'schedule':<17}{'m':>5}{'v':>3} {'step ms':>10} "
            f"{'bubble':>7} {'peak MiB/rank (max; min..max)':>30}"
        ]
        for i, c in enumerate(self.candidates[:top], 1):
            lo, hi = min(c.peak_memory) / 2**20, c.max_memory / 2**20
            rows.append(
                f"{i:>3} {c.pp:>5} {c.dp:>5} {c.schedule:<17}{c.microbatches:>5}"
                f"{c.virtual_stages:>3} {1e3 * c.step_time:>10.3f} {c.bubble:>7.1%} "
                f"{f'{hi:.1f}; {lo:.1f}..{hi:.1f}':>30}"
            )
        limit = "none" if self.memory_limit is None else f"{self.memory_limit / 2**20:.1f} MiB"
        rows.append(
            f"world {self.world_size}, batch {self.batch_size}, memory limit {limit}: "
            f"{self.simulated} simulated, {self.over_memory} over the limit, {self.pruned} "
            f"pruned by bound; {len(self.candidates)} kept; {self.seconds:.2f} s"
        )
        rows.extend(self.notes)
        return "\n".join(rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "memory_limit": self.memory_limit,
            "simulated": self.simulated,
            "over_memory": self.over_memory,
            "pruned": self.pruned,
            "seconds": self.seconds,
            "notes": self.notes,
            "candidates": [c.to_dict() for c in self.candidates],
        }


def _scaled(costs: StageCosts, factor: float) -> StageCosts:
    """Costs of a microbatch `factor` times the profiled one (time and activations linear)."""
    return replace(
        costs,
        forward=[x * factor for x in costs.forward],
        input_grad=[x * factor for x in costs.input_grad],
        weight_grad=[x * factor for x in costs.weight_grad],
        activation_bytes=[x * factor for x in costs.activation_bytes],
    )


def _rank_sums(values: Sequence[float], placement: Sequence[int], ranks: int) -> list[float]:
    out = [0.0] * ranks
    for stage, rank in enumerate(placement):
        out[rank] += values[stage]
    return out


SYNTH_MAX_CELLS = 512
"""Largest stages x microbatches the planner synthesises for (p=8, m=64 takes seconds)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def default_microbatches(pp: int, per_replica: int) -> list[int]:
    """Microbatch counts tried: powers of two and pp x powers of two, up to the replica's
    batch and 8 x pp (past that the 1F1B bubble is below 11% and microbatches only shrink)."""
    top = min(per_replica, 8 * pp)
    counts = {1 << k for k in range(top.bit_length()) if 1 << k <= top}
    counts |= {pp << k for k in range(top.bit_length()) if pp << k <= top}
    return sorted(counts)


def _variants(name: str, virtual_stages: Sequence[int] | None) -> list[int]:
    if name == "interleaved-1f1b":
        return [v for v in (virtual_stages or (2, 4)) if v >= 2]
    if name in ("zbv", "dualpipev"):
        return [2] if virtual_stages is None or 2 in virtual_stages else []
    return [1] if virtual_stages is None or 1 in virtual_stages else []


def search(
    graph: nx.DiGraph,
    *,
    world_size: int,
    batch_size: int,
    profiled_batch: int,
    memory_limit: float | None = None,
    pp: Sequence[int] | None = None,
    schedules: Sequence[str] | None = None,
    microbatches: Sequence[int] | None = None,
    virtual_stages: Sequence[int] | None = None,
    optimizer_factor: float = OPTIMIZER_FACTOR,
    latency: float = 0.0,
    overhead: float = 0.0,
    dp_bandwidth: float | None = None,
    keep: int = 20,
    synthesized_configs: int = 2,
) -> AutoPlan:
    """Rank configurations of a profiled `graph` (profiled on microbatches of
    `profiled_batch` samples) for `world_size` devices and `batch_size` samples per step.

    `pp`: pipeline rank counts to try (default: every divisor of world_size that the graph
    can be cut into); dp = world_size // pp. `schedules` (default all, "synth" included),
    `microbatches` (default `default_microbatches`) and `virtual_stages` restrict the search.
    `keep` best candidates are returned; a schedule is synthesised for the
    `synthesized_configs` best (pp, m, v). See the module docstring for the model."""
    started = time.perf_counter()
    if world_size < 1 or batch_size < 1 or profiled_batch < 1:
        raise ValueError(
            f"world_size, batch_size and profiled_batch must be >= 1, got {world_size}, "
            f"{batch_size}, {profiled_batch}"
        )
    if memory_limit is not None and memory_limit <= 0:
        raise ValueError(f"memory_limit must be > 0 bytes, got {memory_limit}")
    names = list(schedules) if schedules is not None else [*sorted(SCHEDULES), SYNTH]
    unknown = [n for n in names if n not in SCHEDULES and n != SYNTH]
    if unknown:
        raise ValueError(
            f"unknown schedules {unknown}; choose from {[*sorted(SCHEDULES), SYNTH]}"
        )
    nodes = len(graph.graph["order"])
    pps = list(pp) if pp is not None else [d for d in _divisors(world_size) if d <= nodes]
    bad = [p for p in pps if p < 1 or world_size % p]
    if bad:
        raise ValueError(f"pp {bad} must divide world_size={world_size}; use one of "
                         f"{_divisors(world_size)}")
    costs_cache: dict[int, StageCosts | None] = {}
    heap: list[tuple[float, int, Candidate]] = []  # max-heap on step time (negated)
    simulated = over = pruned = 0
    notes: list[str] = []
    for p in pps:
        dp = world_size // p
        if batch_size % dp:
            notes.append(f"pp={p}: batch {batch_size} does not split over dp={dp} replicas")
            continue
        per_replica = batch_size // dp
        for name in (n for n in names if n != SYNTH):
            for v in _variants(name, virtual_stages):
                stages = p * v
                if stages > nodes:
                    continue
                if stages not in costs_cache:
                    try:
                        costs_cache[stages] = costs_for_stages(graph, stages)
                    except ValueError as err:  # e.g. fewer places to cut than stages
                        notes.append(f"{stages} stages: {err}")
                        costs_cache[stages] = None
                base = costs_cache[stages]
                if base is None:
                    continue
                counts = (
                    microbatches if microbatches is not None
                    else default_microbatches(p, per_replica)
                )
                if p == 1 and v > 1:
                    continue  # chunks on a single rank only repeat the one-chunk schedules
                # Largest m first: a rank holds min(k, m) microbatches of 1/m of the replica's
                # batch for a schedule-given k, so its activations only grow as m shrinks,
                # and the first count over the cap ends the group.
                for m in sorted(counts, reverse=True):
                    if m > per_replica:
                        continue
                    try:
                        schedule = build_schedule(name, p, m, v)
                    except ValueError:
                        continue
                    candidate, lower = _evaluate(
                        schedule, base, per_replica / m / profiled_batch, dp, optimizer_factor,
                        latency, overhead, dp_bandwidth, memory_limit,
                        -heap[0][0] if len(heap) >= keep else None,
                    )
                    if lower == "memory":
                        over += 1
                        break  # the parameters alone do not fit, whatever m is
                    if lower == "activations":
                        over += 1
                        break
                    if candidate is None:
                        pruned += 1
                        continue
                    simulated += 1
                    _offer(heap, keep, candidate, simulated)
    if SYNTH in names and synthesized_configs > 0:
        # One rank runs its actions back to back in any order: nothing to search there.
        configs = list(dict.fromkeys((c.pp, c.microbatches, c.virtual_stages) for _, _, c in
                                     sorted(heap, key=lambda e: (-e[0], e[1])) if c.pp > 1))
        for p, m, v in configs[:synthesized_configs]:
            if p * v * m > SYNTH_MAX_CELLS:
                notes.append(f"synth: not searched for pp={p}, m={m}, v={v} (over "
                             f"{SYNTH_MAX_CELLS} stage x microbatch cells, seconds or more; "
                             "call scheduler.synthesize for it)")
                continue
            dp = world_size // p
            base = costs_cache.get(p * v) or costs_for_stages(graph, p * v)
            costs_cache[p * v] = base
            candidate = _synthesized(
                base, p, m, v, dp, batch_size // dp / m / profiled_batch, optimizer_factor,
                latency, overhead, dp_bandwidth, memory_limit,
            )
            if candidate is not None:
                simulated += 1
                _offer(heap, keep, candidate, simulated)
    ranked = sorted(
        (c for _, _, c in heap), key=lambda c: (c.step_time, c.max_memory, c.pp, c.schedule)
    )
    return AutoPlan(
        world_size=world_size,
        batch_size=batch_size,
        memory_limit=memory_limit,
        candidates=ranked,
        simulated=simulated,
        over_memory=over,
        pruned=pruned,
        seconds=time.perf_counter() - started,
        notes=notes,
    )


def predicted(
    graph: nx.DiGraph, candidate: Candidate, batch_size: int, profiled_batch: int, *,
    latency: float = 0.0, overhead: float = 0.0,
) -> tuple[Schedule, Timeline]:
    """A candidate's schedule (its `built` one, or the generator's) and its predicted pipeline
    Timeline, from the costs `search` used (memory curve in activation bytes)."""
    p, m, v = candidate.pp, candidate.microbatches, candidate.virtual_stages
    schedule = candidate.built or build_schedule(candidate.schedule, p, m, v)
    factor = batch_size / candidate.dp / m / profiled_batch
    costs = _scaled(costs_for_stages(graph, schedule.num_stages), factor)
    return schedule, predict(schedule, costs, latency=latency, overhead=overhead)


def _offer(heap: list[tuple[float, int, Candidate]], keep: int, candidate: Candidate,
           order: int) -> None:
    """Keep `candidate` if it is among the `keep` fastest (heap: max-heap on step time)."""
    entry = (-candidate.step_time, order, candidate)
    if len(heap) < keep:
        heapq.heappush(heap, entry)
    elif candidate.step_time < -heap[0][0]:
        heapq.heapreplace(heap, entry)


def _synthesized(
    base: StageCosts, p: int, m: int, v: int, dp: int, factor: float, optimizer_factor: float,
    latency: float, overhead: float, dp_bandwidth: float | None, memory_limit: float | None,
) -> Candidate | None:
    """The candidate of a schedule synthesised for this (pp, m, v) from the scaled costs, in
    the memory the parameters leave (None if not even one microbatch fits)."""
    costs = _scaled(base, factor)
    fixed = [x * optimizer_factor for x in _rank_sums(base.param_bytes, list(range(p)) * v, p)]
    limits = inflight_limits(costs, p, m, v, memory_limit, fixed)
    if limits is None:
        return None
    schedule = synthesized(costs, p, m, limits, virtual_stages=v, latency=latency,
                           overhead=overhead)
    candidate, _ = _evaluate(schedule, base, factor, dp, optimizer_factor, latency, overhead,
                             dp_bandwidth, memory_limit, None)
    return None if candidate is None else replace(candidate, built=schedule)


def _evaluate(
    schedule: Schedule,
    base: StageCosts,
    factor: float,
    dp: int,
    optimizer_factor: float,
    latency: float,
    overhead: float,
    dp_bandwidth: float | None,
    memory_limit: float | None,
    bound: float | None,
) -> tuple[Candidate | None, str]:
    """Simulate one candidate, unless its parameters alone break the cap ("memory") or its
    lower bound cannot beat `bound` ("bound")."""
    p, m = schedule.num_ranks, schedule.num_microbatches
    params = _rank_sums(base.param_bytes, schedule.placement, p)
    fixed = [x * optimizer_factor for x in params]
    if memory_limit is not None and max(fixed) > memory_limit:
        return None, "memory"
    allreduce = 0.0
    if dp > 1 and dp_bandwidth is not None:
        allreduce = 2 * (dp - 1) / dp * max(params) / dp_bandwidth
    costs = _scaled(base, factor)
    # Peak memory needs only the action order, so over-cap candidates are never simulated.
    memory = tuple(f + a for f, a in zip(fixed, peak_held(schedule, costs.activation_bytes),
                                           strict=True))
    if memory_limit is not None and max(memory) > memory_limit:
        return None, "activations"
    if bound is not None:
        # Rank r starts when microbatch 0 has run the forwards of every stage below its first
        # one, then has all its own work to do.
        ops = 3 if schedule.splits_backward else 2
        work = [f + b + w + ops * overhead for f, b, w in
                zip(costs.forward, costs.input_grad, costs.weight_grad, strict=True)]
        totals = _rank_sums(work, schedule.placement, p)
        lower = max(
            sum(costs.forward[:min(schedule.stages_of(r))]) + totals[r] * m for r in range(p)
        )
        if lower + allreduce >= bound:
            return None, "bound"
    timeline = predict_summary(schedule, costs, latency=latency, overhead=overhead)
    return Candidate(
        pp=p,
        dp=dp,
        schedule=schedule.name,
        microbatches=m,
        virtual_stages=schedule.virtual_stages,
        step_time=timeline.step_time + allreduce,
        pipeline_time=timeline.step_time,
        allreduce_time=allreduce,
        bubble=timeline.bubble_fraction,
        peak_memory=memory,
    ), ""
