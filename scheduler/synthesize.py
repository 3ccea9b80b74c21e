"""`synthesize`: a split-backward schedule searched from per-stage F, B, W and communication
costs under a per-rank memory limit, and `lower_bound`, the step no schedule can beat.

Method (a heuristic, in the spirit of the Zero Bubble paper's automatic scheduler):

1. Seeds: every hand-written generator whose placement fits `virtual_stages` (a generator that
   does not split backward gets each W right after its B, which is never slower: a B's output
   leaves earlier and memory is freed at the same time), kept if it fits the limit, plus the
   one-microbatch-at-a-time order that fits any limit >= virtual_stages.
2. List scheduling (`scheduler.listsched`) under a grid of policies: six op priorities (B or F
   first with W filling idle time, with and without holding for a coming B; F, W, B; W, F,
   B), per-rank in-flight caps (flat, and 1F1B's / ZB-H2's staircases) up to the limit.
3. Local search from the best few: moves on the critical path of the simulated step (an action
   that waited for its rank moves up to 4 places earlier, or the action it waited for up to
   4 places later), first improvement of (step, sum of rank finish times) accepted, until no
   move improves or the evaluation budget is spent.

Of the schedules with the shortest step, the one holding the fewest activations is returned.

Why not an exact model: an ILP (what the Zero Bubble paper uses for small sizes) needs a
solver dependency this pure-Python package does not have and grows past seconds well before
p=8, m=32. The list scheduler reaches the generators' shapes from the costs and the local
search polishes them; benchmarks/bench_synth.py reports the gap left to `lower_bound` (25x
the evaluation budget moved no result at p=8, m=32: the search ends in a local optimum, not
for lack of time).

Every result is checked by the simulator itself (which raises on a deadlock) and by the
memory count `Timeline.peak_inflight` uses. The search is deterministic: the same inputs give
the same schedule, unless `time_limit` cuts the local search short on a slow machine.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from scheduler.generators import SCHEDULES, _v_placement
from scheduler.ir import Action, Op, Schedule
from scheduler.listsched import Policy, list_schedule
from scheduler.simulate import Cost
from scheduler.timeline import per_stage
from scheduler.validate import dependencies, execute

Orders = list[list[Action]]
Times = list[list[tuple[float, float]]]
_PRIORITIES = (((1, 0, 2), False), ((1, 0, 2), True), ((0, 1, 2), False), ((0, 1, 2), True),
               ((0, 2, 1), False), ((2, 0, 1), False))
SYNTH = "synth"
"""The name a synthesised schedule carries (and that the planners and the CLI take)."""
_SEEDS_SEARCHED = 3
_REACH = 4


def _placements(ranks: int, virtual_stages: int) -> dict[str, list[int]]:
    """The placements tried, with the generators written for each."""
    if virtual_stages == 1:
        return {"line": list(range(ranks))}
    rounds = [s % ranks for s in range(ranks * virtual_stages)]
    if virtual_stages == 2:
        return {"v": _v_placement(ranks), "round-robin": rounds}
    return {"round-robin": rounds}


_GENERATORS = {
    "line": ("gpipe", "1f1b", "1f1b-eager", "zb-h1", "zb-h2"),
    "v": ("zbv", "dualpipev"),
    "round-robin": ("interleaved-1f1b",),
}


def _split(schedule: Schedule) -> Orders:
    """The schedule's orders with each W right after its B (unchanged if already split)."""
    if schedule.splits_backward:
        return [list(acts) for acts in schedule.actions]
    return [
        [x for a in acts for x in ((a, Action(a.stage, Op.W, a.microbatch)) if a.op is Op.B
                                   else (a,))]
        for acts in schedule.actions
    ]


def _one_at_a_time(placement: Sequence[int], ranks: int, m: int) -> Orders:
    """Each microbatch's forwards, backwards and weights before the next one starts: a
    topological order cut by rank, so it cannot deadlock, holding one microbatch at a time."""
    n = len(placement)
    out: Orders = [[] for _ in range(ranks)]
    for k in range(m):
        for a in [Action(s, Op.F, k) for s in range(n)] + [
            x for s in reversed(range(n)) for x in (Action(s, Op.B, k), Action(s, Op.W, k))
        ]:
            out[placement[a.stage]].append(a)
    return out


class _Evaluator:
    """Simulated step, memory check and call count of candidate orders on one cost profile."""

    def __init__(
        self, placement: Sequence[int], ranks: int, m: int,
        cost: Sequence[tuple[float, float, float]], comm: float, limits: Sequence[int],
    ) -> None:
        self.placement, self.ranks, self.m = tuple(placement), ranks, m
        self.cost, self.comm, self.limits = cost, comm, limits
        self.calls = 0

    def schedule(self, orders: Orders, name: str = SYNTH) -> Schedule:
        return Schedule(
            num_ranks=self.ranks, num_stages=len(self.placement), num_microbatches=self.m,
            placement=self.placement, actions=tuple(tuple(a) for a in orders),
            splits_backward=True, name=name,
        )

    def times(self, orders: Orders) -> Times | None:
        """Per rank (start, end) of each action, or None if the orders deadlock or break the
        memory limit."""
        self.calls += 1
        comm, placement = self.comm, self.placement
        try:
            times = execute(
                self.schedule(orders), lambda s, o: self.cost[s][o],
                lambda a, b, o: comm if placement[a] != placement[b] else 0.0,
            )
        except ValueError:
            return None
        if any(_peak_inflight(acts, ts) > limit
               for acts, ts, limit in zip(orders, times, self.limits, strict=True)):
            return None
        return times


def _peak_inflight(actions: Sequence[Action], times: Sequence[tuple[float, float]]) -> int:
    """`Timeline.peak_inflight` of one rank: held from an F's start to its W's end, a free
    counted first when both fall at one instant."""
    deltas = sorted(
        (start, 1) if a.op is Op.F else (stop, -1)
        for a, (start, stop) in zip(actions, times, strict=True) if a.op is not Op.B
    )
    count = peak = 0
    for _, step in deltas:
        count += step
        peak = max(peak, count)
    return peak


def _score(times: Times) -> tuple[float, float]:
    ends = [t[-1][1] for t in times if t]
    return max(ends, default=0.0), sum(ends)


def _critical_moves(orders: Orders, times: Times, n: int) -> list[tuple[int, int, int]]:
    """Moves (rank, from, to) around the critical path of the simulated step: where an action
    started the moment its rank's previous action ended (the rank held it up), move it up to
    `_REACH` places earlier, or move the action before it up to `_REACH` places later. Walked
    from the step's end backwards, so the moves nearest the end come first."""
    where = {a: (r, i) for r, acts in enumerate(orders) for i, a in enumerate(acts)}
    r = max(range(len(times)), key=lambda q: times[q][-1][1] if times[q] else -1.0)
    i = len(orders[r]) - 1
    moves: list[tuple[int, int, int]] = []
    while i >= 0:
        start = times[r][i][0]
        if i > 0 and times[r][i - 1][1] == start:
            last = len(orders[r]) - 1
            moves += [(r, i, i - k) for k in range(1, _REACH + 1) if i - k >= 0]
            moves += [(r, i - 1, i - 1 + k) for k in range(1, _REACH + 1) if i - 1 + k <= last]
            i -= 1
            continue
        feeders = [where[d] for d in dependencies(orders[r][i], n)]
        late = [(q, j) for q, j in feeders if times[q][j][1] <= start]
        if not late or start == 0.0:
            break
        r, i = max(late, key=lambda qj: times[qj[0]][qj[1]][1])
    return moves


def _local_search(
    ev: _Evaluator, orders: Orders, times: Times, budget: int, deadline: float
) -> tuple[Orders, Times]:
    """First-improvement descent over `_critical_moves` on (step, sum of rank finish times)."""
    n = len(ev.placement)
    score = _score(times)
    improved = True
    while improved and ev.calls < budget and time.perf_counter() < deadline:
        improved = False
        for r, i, j in _critical_moves(orders, times, n):
            trial = [list(acts) for acts in orders]
            trial[r].insert(j, trial[r].pop(i))
            new = ev.times(trial)
            if new is not None and _score(new) < score:
                orders, times, score, improved = trial, new, _score(new), True
                break
            if ev.calls >= budget or time.perf_counter() >= deadline:
                break
    return orders, times


def _check_limits(memory_limit: int | Sequence[int], ranks: int, v: int) -> list[int]:
    if isinstance(memory_limit, int):
        values: list[object] = [memory_limit] * ranks
    elif isinstance(memory_limit, Sequence):
        values = list(memory_limit)
    else:
        values = []
    if len(values) != ranks or any(isinstance(x, bool) or not isinstance(x, int) for x in values):
        raise TypeError(
            f"memory_limit must be an int or one int per rank ({ranks}), got {memory_limit!r}"
        )
    limits = [x for x in values if isinstance(x, int)]
    if min(limits) < v:
        raise ValueError(
            f"memory_limit={memory_limit!r} is below virtual_stages={v}: a rank holds each of "
            f"its {v} stages' activations of a microbatch at once; use memory_limit >= {v}"
        )
    return limits


def _policies(ranks: int, limits: Sequence[int], v: int, m: int) -> list[Policy]:
    """The list-scheduling grid: caps (the limit, two flat ones between it and `v`, 1F1B's and
    ZB-H2's staircases) x the op priorities that won most often on random profiles (B or F
    first with W filling idle time, each with and without holding for B; F, W, B; W, F, B)."""
    top = min(max(limits), v * m)
    flat = sorted({top - (top - v) * i // 3 for i in range(3)}, reverse=True)
    shapes = [tuple(c for _ in range(ranks)) for c in flat]
    shapes += [tuple(v * (ranks - r) for r in range(ranks)),
               tuple(v * (2 * (ranks - r) - 1) for r in range(ranks))]
    caps = list(dict.fromkeys(tuple(min(c, lim) for c, lim in zip(shape, limits, strict=True))
                              for shape in shapes))
    return [Policy(order, cap, hold) for cap in caps for order, hold in _PRIORITIES]


def synthesize(
    ranks: int,
    microbatches: int,
    forward: Cost,
    backward: Cost,
    weight: Cost,
    comm: float = 0.0,
    *,
    memory_limit: int | Sequence[int],
    virtual_stages: int = 1,
    time_limit: float = 10.0,
    evaluations: int | None = None,
) -> Schedule:
    """A split-backward Schedule for `ranks` x `virtual_stages` stages and `microbatches`
    microbatches, searched for the shortest simulated step (see the module docstring).

    Costs are as `scheduler.simulate` takes them: scalars or one per stage (stage s of
    ranks x virtual_stages); `backward` is the input-grad part, `weight` the weight-grad part,
    `comm` the delay of a cross-rank input. `memory_limit`: the most (stage, microbatch)
    activations a rank may hold at once, as `Timeline.peak_inflight` counts them (one int, or
    one per rank). With v > 1 the V placement (as zbv) and the round-robin one (as
    interleaved-1f1b, v=2 also tries both) are searched. `evaluations` bounds the simulations
    of the local search (default: about 600k simulated actions' worth, e.g. 781 at p=8,
    m=32), `time_limit` (seconds) its wall time. The result's simulated step is
    never longer than that of any generator that fits the limit."""
    for what, value in (("ranks", ranks), ("microbatches", microbatches),
                        ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be an int >= 1, got {value!r}")
    if comm < 0:
        raise ValueError(f"comm={comm} is negative; give a latency >= 0")
    started = time.perf_counter()
    n, m = ranks * virtual_stages, microbatches
    f, b, w = (per_stage(c, n, what) for c, what in
               ((forward, "forward"), (backward, "backward"), (weight, "weight")))
    if any(x < 0 for x in (*f, *b, *w)):
        raise ValueError(f"costs must be >= 0, got forward={f}, backward={b}, weight={w}")
    limits = _check_limits(memory_limit, ranks, virtual_stages)
    cost = [(f[s], b[s], w[s]) for s in range(n)]
    found: list[tuple[tuple[float, float], int, _Evaluator, Orders, Times]] = []
    for kind, placement in _placements(ranks, virtual_stages).items():
        ev = _Evaluator(placement, ranks, m, cost, comm, limits)
        seeds = [_one_at_a_time(placement, ranks, m)]
        for name in _GENERATORS[kind]:
            try:
                seeds.append(_split(SCHEDULES[name](ranks, m, virtual_stages)))
            except ValueError:
                continue  # this generator does not take these sizes
        for policy in _policies(ranks, limits, virtual_stages, m):
            orders = list_schedule(placement, ranks, m, cost, comm, policy)
            if orders is not None:
                seeds.append(orders)
        for orders in {tuple(map(tuple, o)): o for o in seeds}.values():
            times = ev.times(orders)
            if times is not None:
                found.append((_score(times), len(found), ev, orders, times))
    found.sort(key=lambda x: (x[0], x[1]))
    deadline = started + time_limit
    if evaluations is None:
        evaluations = min(2000, max(100, 200_000 // (n * m)))
    for _, index, ev, orders, times in found[:_SEEDS_SEARCHED]:
        orders, times = _local_search(ev, orders, times, ev.calls + evaluations
                                      // _SEEDS_SEARCHED, deadline)
        found.append((_score(times), index, ev, orders, times))
    # The shortest step; among steps equal to it (up to rounding), the least memory.
    shortest = min(x[0][0] for x in found) * (1 + 1e-12)

    def memory(x: tuple[tuple[float, float], int, _Evaluator, Orders, Times]) -> list[int]:
        peaks = [_peak_inflight(a, t) for a, t in zip(x[3], x[4], strict=True)]
        return [max(peaks), sum(peaks)]

    best = min((x for x in found if x[0][0] <= shortest),
               key=lambda x: (memory(x), x[0], x[1]))
    return best[2].schedule(best[3], name=SYNTH)


def lower_bound(
    ranks: int, microbatches: int, forward: Cost, backward: Cost, weight: Cost,
    comm: float = 0.0, *, placement: Sequence[int] | None = None,
) -> float:
    """A step no schedule can beat: the larger of (a) per rank, the first forward's arrival
    at the rank's first stage plus all its work, and (b) one microbatch's chain of forwards
    and backwards through every stage, then stage 0's W. `placement` defaults to one stage per
    rank (give it when stages outnumber ranks)."""
    place = list(placement) if placement is not None else list(range(ranks))
    n = len(place)
    f, b, w = (per_stage(c, n, what) for c, what in
               ((forward, "forward"), (backward, "backward"), (weight, "weight")))

    def hop(s: int) -> float:
        return comm if s + 1 < n and place[s] != place[s + 1] else 0.0

    by_rank = []
    for r in range(ranks):
        mine = [s for s in range(n) if place[s] == r]
        if not mine:
            continue
        first = min(mine)
        head = sum(f[s] + hop(s) for s in range(first))
        by_rank.append(head + microbatches * sum(f[s] + b[s] + w[s] for s in mine))
    chain = sum(f) + sum(b) + w[0] + 2 * sum(hop(s) for s in range(n))
    return max([chain, *by_rank])
