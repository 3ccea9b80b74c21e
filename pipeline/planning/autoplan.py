"""The auto-planner: choose (tensor-parallel ranks, pipeline ranks, data-parallel replicas,
schedule, microbatches, virtual stages) for a profiled model by simulating every candidate
through the one cost model (`pipeline.planning.costs`) under a per-device memory cap, and
rank them by predicted step time.

Model of one candidate (tp ranks x pp ranks x dp replicas = world size, global batch B):
- tp > 1 (`widths`, pipeline.planning.tp_costs): every unit at its shard shapes plus its
  collectives on the tp group, parameter bytes per tp rank; a tp group is one pipeline rank
  of the simulation (its ranks run in step);
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

import enum
import heapq
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from partitioner import Captured
from pipeline.planning.activation_plan import choose
from pipeline.planning.costs import (
    StageCosts,
    costs_for_stages,
    predict,
    predict_summary,
    with_policies,
)
from pipeline.planning.synthesis import OPTIMIZER_FACTOR, inflight_limits, synthesized
from pipeline.planning.tp_costs import Width, whole
from scheduler import SCHEDULES, SYNTH, Schedule, Timeline, build_schedule
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
    activations: tuple[str, ...] = ()  # the policy per stage, when the search chose them
    tp: int = 1  # tensor-parallel ranks per pipeline rank

    def label(self) -> str:
        """The layout in a few words."""
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return (f"tp={self.tp} pp={self.pp} dp={self.dp} {self.schedule} "
                f"m={self.microbatches}{v}")

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
    widths: tuple[str, ...] = ()  # what each tensor-parallel degree tried splits

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

    def why(self) -> str:
        """Why the best candidate won: its prediction against the runner-up and against the
        best layout of every other tensor-parallel degree tried (or what ruled those out)."""
        best = self.best
        lines = [f"chosen {best.label()}: predicted {1e3 * best.step_time:.3f} ms per step, "
                 f"peak {best.max_memory / 2**20:.1f} MiB per rank"]
        others = [c for c in self.candidates[1:]]
        if others:
            c = others[0]
            lines.append(f"  runner-up {c.label()}: {1e3 * c.step_time:.3f} ms "
                         f"({c.step_time / best.step_time - 1:+.1%})")
        for tp in sorted({c.tp for c in self.candidates} - {best.tp}):
            c = min((c for c in self.candidates if c.tp == tp), key=lambda c: c.step_time)
            lines.append(f"  best at tp={tp}: {c.label()}: {1e3 * c.step_time:.3f} ms "
                         f"({c.step_time / best.step_time - 1:+.1%})")
        lines.extend(f"  {w}" for w in self.widths)
        return "\n".join(lines)

    def table(self, top: int = 20) -> str:
        """The ranked table: (tp, pp, dp, schedule, m, v), predicted step, bubble, peak
        memory (the `top` rows, and the best of each tp degree below them); then the counts,
        and why the best won when several tp degrees were tried."""
        rows = [
            f"{'#':>3} {'tp':>3} {'pp':>5} {'dp':>5} {'schedule':<17}{'m':>5}{'v':>3} "
            f"{'step ms':>10} {'bubble':>7} {'peak MiB/rank (max; min..max)':>30}"
        ]
        first: dict[int, Candidate] = {}  # the best of each tp degree, shown below the top
        for c in self.candidates:
            first.setdefault(c.tp, c)
        shown = [(i, c) for i, c in enumerate(self.candidates, 1)
                 if i <= top or first[c.tp] is c]
        for i, c in shown:
            lo, hi = min(c.peak_memory) / 2**20, c.max_memory / 2**20
            rows.append(
                f"{i:>3} {c.tp:>3} {c.pp:>5} {c.dp:>5} {c.schedule:<17}{c.microbatches:>5}"
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
        if len({c.tp for c in self.candidates}) > 1:
            rows.append(self.why())
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
            "widths": list(self.widths),
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
        prices=None if costs.prices is None else costs.prices.scaled(factor),
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


@dataclass(frozen=True)
class Pricing:
    """How `search` prices a candidate: bytes per parameter byte held (weights, grads and
    optimizer state), seconds per cross-rank transfer and per action, the data-parallel
    all-reduce bandwidth (None: free) and the per-device memory cap (None: none)."""

    optimizer_factor: float = OPTIMIZER_FACTOR
    latency: float = 0.0
    overhead: float = 0.0
    dp_bandwidth: float | None = None
    memory_limit: float | None = None
    choose_activations: bool = False


@dataclass(frozen=True)
class Trial:
    """One configuration to price: its schedule, the costs of its stages profiled on one
    microbatch of `profiled_batch` samples, `factor` = its microbatch over that one, and its
    data-parallel replicas."""

    schedule: Schedule
    base: StageCosts
    factor: float
    dp: int
    tp: int = 1


class Rejection(enum.Enum):
    """Why a trial was not simulated."""

    PARAMETERS = "its parameters alone exceed the memory limit"
    ACTIVATIONS = "its peak held activations exceed the memory limit"
    BOUND = "its lower bound cannot beat the kept candidates"


@dataclass(frozen=True)
class _Group:
    """The trials of one (pipeline ranks, schedule, chunks), differing in microbatches."""

    pp: int
    dp: int
    per_replica: int
    schedule: str
    virtual_stages: int
    base: StageCosts
    tp: int = 1


class _Ranking:
    """The `keep` fastest candidates found so far (a max-heap on step time) and the counts
    `AutoPlan` reports."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.heap: list[tuple[float, int, Candidate]] = []
        self.simulated = self.over_memory = self.pruned = 0
        self.notes: list[str] = []
        self.best_of: dict[int, Candidate] = {}  # the fastest of each tp degree

    def bound(self) -> float | None:
        """The step time a trial must beat to be kept (None while fewer than `keep`)."""
        return -self.heap[0][0] if len(self.heap) >= self.keep else None

    def offer(self, candidate: Candidate) -> None:
        self.simulated += 1
        mine = self.best_of.get(candidate.tp)
        if mine is None or candidate.step_time < mine.step_time:
            self.best_of[candidate.tp] = candidate
        entry = (-candidate.step_time, self.simulated, candidate)
        if len(self.heap) < self.keep:
            heapq.heappush(self.heap, entry)
        elif candidate.step_time < -self.heap[0][0]:
            heapq.heapreplace(self.heap, entry)

    def configs(self) -> list[tuple[int, int, int, int]]:
        """The kept (tp, pp, m, v), fastest first, once each."""
        kept = sorted(self.heap, key=lambda e: (-e[0], e[1]))
        return list(dict.fromkeys((c.tp, c.pp, c.microbatches, c.virtual_stages)
                                  for _, _, c in kept))

    def ranked(self) -> list[Candidate]:
        """The kept candidates, and the fastest of each tp degree tried where none of its
        is among them, fastest first."""
        kept = [c for _, _, c in self.heap]
        kept += [c for c in self.best_of.values() if all(c is not k for k in kept)]
        return sorted(kept, key=lambda c: (c.step_time, c.max_memory, c.tp, c.pp, c.schedule))


def search(
    captured: Captured,
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
    choose_activations: bool = False,
    widths: Sequence[Width] | None = None,
) -> AutoPlan:
    """Rank configurations of a profiled `captured` model (profiled on microbatches of
    `profiled_batch` samples) for `world_size` devices and `batch_size` samples per step.

    `pp`: pipeline rank counts to try (default: every divisor of world_size that the model
    can be cut into); dp = world_size // pp. `schedules` (default all, "synth" included),
    `microbatches` (default `default_microbatches`) and `virtual_stages` restrict the search.
    `keep` best candidates are returned; a schedule is synthesised for the
    `synthesized_configs` best (pp, m, v). With `choose_activations` (units priced by
    partitioner.activation_cost), each candidate runs the activation policy per stage that
    `pipeline.planning.activation_plan.choose` picks for its schedule under the limit, at
    the time it adds. `widths`: the tensor-parallel degrees to try, each `captured` priced
    at that degree (pipeline.planning.tp_costs.width; default tp=1 alone): pp then divides
    world_size / tp. See the module docstring for the model."""
    started = time.perf_counter()
    names = _checked_names(world_size, batch_size, profiled_batch, memory_limit, schedules)
    nodes = len(captured)
    tried = list(widths) if widths is not None else [whole(captured)]
    _check_widths(tried, world_size)
    pricing = Pricing(optimizer_factor, latency, overhead, dp_bandwidth, memory_limit,
                      choose_activations)
    ranking = _Ranking(keep)
    costs = _StageCostsCache(tried, ranking.notes)
    for w in tried:
        pps = _pipeline_depths(pp, world_size // w.tp, nodes)
        for group in _groups(pps, names, virtual_stages, world_size // w.tp, batch_size,
                             nodes, costs, ranking.notes, w.tp):
            counts = (microbatches if microbatches is not None
                      else default_microbatches(group.pp, group.per_replica))
            _try_counts(group, counts, profiled_batch, pricing, ranking)
    if SYNTH in names and synthesized_configs > 0:
        _add_synthesized(ranking, costs, synthesized_configs, pricing, world_size=world_size,
                         batch_size=batch_size, profiled_batch=profiled_batch)
    return AutoPlan(
        world_size=world_size, batch_size=batch_size, memory_limit=memory_limit,
        candidates=ranking.ranked(), simulated=ranking.simulated,
        over_memory=ranking.over_memory, pruned=ranking.pruned,
        seconds=time.perf_counter() - started, notes=ranking.notes,
        widths=tuple(w.describe() for w in tried if w.tp > 1),
    )


def _check_widths(widths: Sequence[Width], world_size: int) -> None:
    bad = [w.tp for w in widths if w.tp < 1 or world_size % w.tp]
    if bad or not widths:
        raise ValueError(f"tensor-parallel degrees {bad} must divide world_size={world_size} "
                         "(give at least one)")


def _checked_names(world_size: int, batch_size: int, profiled_batch: int,
                   memory_limit: float | None, schedules: Sequence[str] | None) -> list[str]:
    """The schedule names to try, once the sizes and the limit are checked."""
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
    return names


def _pipeline_depths(pp: Sequence[int] | None, world_size: int, nodes: int) -> list[int]:
    pps = list(pp) if pp is not None else [d for d in _divisors(world_size) if d <= nodes]
    bad = [p for p in pps if p < 1 or world_size % p]
    if bad:
        raise ValueError(f"pp {bad} must divide world_size={world_size}; use one of "
                         f"{_divisors(world_size)}")
    return pps


class _StageCostsCache:
    """The profiled costs of the graph cut into n stages at each tp degree, computed once per
    (tp, n) (None, with a note, when it cannot be cut so)."""

    def __init__(self, widths: Sequence[Width], notes: list[str]) -> None:
        self.widths = {w.tp: w for w in widths}
        self.notes = notes
        self.cache: dict[tuple[int, int], StageCosts | None] = {}

    def get(self, stages: int, tp: int = 1) -> StageCosts | None:
        if (tp, stages) not in self.cache:
            try:
                self.cache[(tp, stages)] = self.widths[tp].stage_costs(stages)
            except ValueError as err:  # e.g. fewer places to cut than stages
                if tp == 1 or (1, stages) not in self.cache:
                    self.notes.append(f"{stages} stages: {err}")
                self.cache[(tp, stages)] = None
        return self.cache[(tp, stages)]


def _groups(
    pps: Sequence[int], names: Sequence[str], virtual_stages: Sequence[int] | None,
    world_size: int, batch_size: int, nodes: int, costs: _StageCostsCache, notes: list[str],
    tp: int = 1,
) -> Iterator[_Group]:
    """Every (pp, generator schedule, chunks) the graph and the batch allow, on `world_size`
    groups of `tp` ranks."""
    for p in pps:
        dp = world_size // p
        if batch_size % dp:
            notes.append(f"tp={tp} pp={p}: batch {batch_size} does not split over dp={dp} "
                         "replicas")
            continue
        for name in (n for n in names if n != SYNTH):
            for v in _variants(name, virtual_stages):
                if p * v > nodes:
                    continue
                base = costs.get(p * v, tp)
                if base is None or (p == 1 and v > 1):
                    continue  # chunks on a single rank only repeat the one-chunk schedules
                yield _Group(p, dp, batch_size // dp, name, v, base, tp)


def _try_counts(group: _Group, counts: Sequence[int], profiled_batch: int, pricing: Pricing,
                ranking: _Ranking) -> None:
    """Price the group's microbatch counts. Largest m first: a rank holds min(k, m)
    microbatches of 1/m of the replica's batch for a schedule-given k, so its activations
    only grow as m shrinks, and the first count over the cap ends the group."""
    for m in sorted(counts, reverse=True):
        if m > group.per_replica:
            continue
        try:
            schedule = build_schedule(group.schedule, group.pp, m, group.virtual_stages)
        except ValueError:
            continue
        trial = Trial(schedule, group.base, group.per_replica / m / profiled_batch, group.dp,
                      group.tp)
        # The first candidate of each tp degree is simulated whatever the bound: the
        # ranking shows the best of every degree tried.
        bound = ranking.bound() if group.tp in ranking.best_of else None
        result = _evaluate(trial, pricing, bound)
        if result is Rejection.BOUND:
            ranking.pruned += 1
        elif isinstance(result, Rejection):
            ranking.over_memory += 1
            return  # more microbatches fit no better
        else:
            ranking.offer(result)


def _add_synthesized(ranking: _Ranking, costs: _StageCostsCache, configs: int, pricing: Pricing,
                     *, world_size: int, batch_size: int, profiled_batch: int) -> None:
    """A schedule synthesised for each of the `configs` best kept (tp, pp, m, v), offered as a
    candidate. One rank runs its actions back to back in any order: nothing to search there."""
    best = [c for c in ranking.configs() if c[1] > 1]
    for tp, p, m, v in best[:configs]:
        if p * v * m > SYNTH_MAX_CELLS:
            ranking.notes.append(
                f"synth: not searched for pp={p}, m={m}, v={v} (over {SYNTH_MAX_CELLS} stage x "
                "microbatch cells, seconds or more; call scheduler.synthesize for it)")
            continue
        dp = world_size // tp // p
        base = costs.get(p * v, tp)
        if base is None:
            continue
        factor = batch_size // dp / m / profiled_batch
        candidate = _synthesized(base, p, m, v, dp, factor, pricing, tp)
        if candidate is not None:
            ranking.offer(candidate)


def predicted(
    captured: Captured, candidate: Candidate, batch_size: int, profiled_batch: int, *,
    latency: float = 0.0, overhead: float = 0.0, width: Width | None = None,
) -> tuple[Schedule, Timeline]:
    """A candidate's schedule (its `built` one, or the generator's) and its predicted pipeline
    Timeline, from the costs `search` used (memory curve in activation bytes); `width`: the
    tensor-parallel costs `search` was given for the candidate's tp."""
    p, m, v = candidate.pp, candidate.microbatches, candidate.virtual_stages
    schedule = candidate.built or build_schedule(candidate.schedule, p, m, v)
    factor = batch_size / candidate.dp / m / profiled_batch
    stages = (width.stage_costs(schedule.num_stages) if width is not None
              else costs_for_stages(captured, schedule.num_stages))
    costs = _scaled(stages, factor)
    return schedule, predict(schedule, costs, latency=latency, overhead=overhead)


def _synthesized(base: StageCosts, p: int, m: int, v: int, dp: int, factor: float,
                 pricing: Pricing, tp: int = 1) -> Candidate | None:
    """The candidate of a schedule synthesised for this (pp, m, v) from the scaled costs, in
    the memory the parameters leave (None if not even one microbatch fits)."""
    costs = _scaled(base, factor)
    fixed = [x * pricing.optimizer_factor
             for x in _rank_sums(base.param_bytes, list(range(p)) * v, p)]
    limits = inflight_limits(costs, p, m, v, pricing.memory_limit, fixed)
    if limits is None:
        return None
    schedule = synthesized(costs, p, m, limits, virtual_stages=v, latency=pricing.latency,
                           overhead=pricing.overhead)
    result = _evaluate(Trial(schedule, base, factor, dp, tp), pricing, None)
    return None if isinstance(result, Rejection) else replace(result, built=schedule)


def _evaluate(trial: Trial, pricing: Pricing, bound: float | None) -> Candidate | Rejection:
    """Simulate one trial, unless its memory breaks the cap or its lower bound cannot beat
    `bound` (the `Rejection` says which)."""
    schedule, limit = trial.schedule, pricing.memory_limit
    p, m, dp = schedule.num_ranks, schedule.num_microbatches, trial.dp
    params = _rank_sums(trial.base.param_bytes, schedule.placement, p)
    fixed = [x * pricing.optimizer_factor for x in params]
    if limit is not None and max(fixed) > limit:
        return Rejection.PARAMETERS
    allreduce = 0.0
    if dp > 1 and pricing.dp_bandwidth is not None:
        allreduce = 2 * (dp - 1) / dp * max(params) / pricing.dp_bandwidth
    costs = _scaled(trial.base, trial.factor)
    # Peak memory needs only the action order, so over-cap candidates are never simulated.
    held = peak_held(schedule, costs.activation_bytes)
    if pricing.choose_activations and costs.prices is not None:
        choice = choose(schedule, costs.prices, fixed, limit)
        if choice is None:
            return Rejection.ACTIVATIONS
        costs = with_policies(costs, choice.policies)
        held = choice.peaks
    memory = tuple(f + a for f, a in zip(fixed, held, strict=True))
    if limit is not None and max(memory) > limit:
        return Rejection.ACTIVATIONS
    if bound is not None and _lower_bound(schedule, costs, pricing.overhead) + allreduce >= bound:
        return Rejection.BOUND
    timeline = predict_summary(schedule, costs, latency=pricing.latency,
                               overhead=pricing.overhead)
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
        activations=costs.policies,
        tp=trial.tp,
    )


def _lower_bound(schedule: Schedule, costs: StageCosts, overhead: float) -> float:
    """Rank r starts when microbatch 0 has run the forwards of every stage below its first
    one, then has all its own work to do: the slowest rank's such time."""
    ops = 3 if schedule.splits_backward else 2
    work = [f + b + w + ops * overhead for f, b, w in
            zip(costs.forward, costs.input_grad, costs.weight_grad, strict=True)]
    totals = _rank_sums(work, schedule.placement, schedule.num_ranks)
    m = schedule.num_microbatches
    return max(sum(costs.forward[:min(schedule.stages_of(r))]) + totals[r] * m
               for r in range(schedule.num_ranks))
