"""Checks a Schedule before anything runs: every action present once, on its stage's rank, and
the ranks' orders free of deadlock when each rank runs its list in order with blocking receives.

The in-order execution engine (`execute`) lives here because the validator and the simulator
must agree exactly on what deadlocks: the validator runs it with zero costs, the simulator with
real ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from scheduler.ir import Action, Op, Schedule
from scheduler.lowering import producer

_OP_INDEX = {Op.F: 0, Op.B: 1, Op.W: 2}
_OPS = (Op.F, Op.B, Op.W)


def dependencies(action: Action, num_stages: int) -> list[Action]:
    """The actions whose outputs `action` consumes.

    F(s,m) needs F(s-1,m); B(s,m) needs F(s,m) and B(s+1,m) (the last stage's B needs only its
    own F: the loss is computed inside the last stage's F); W(s,m) needs B(s,m).
    """
    s, m = action.stage, action.microbatch
    own = {Op.F: [], Op.B: [Action(s, Op.F, m)], Op.W: [Action(s, Op.B, m)]}[action.op]
    source = producer(action, num_stages)
    return own if source is None else [*own, source]


def format_grid(schedule: Schedule, marks: dict[tuple[int, int], str] | None = None) -> str:
    """The rank-by-step table of `schedule`, marked cells shown as ``>1B0<``.

    `marks` maps (rank, step) to a mark; a mark past the end of a rank's list shows as an empty
    slot. Wide schedules are cut to a window of columns around the marks.
    """
    marks = marks or {}
    steps = max((len(acts) for acts in schedule.actions), default=0)
    steps = max([steps] + [step + 1 for _, step in marks])
    first, last = 0, steps
    if steps > 48 and marks:
        lo = min(step for _, step in marks)
        hi = max(step for _, step in marks)
        first, last = max(0, lo - 8), min(steps, hi + 9)
    width = max([3] + [len(str(a)) for acts in schedule.actions for a in acts]) + 2
    label = len(f"rank {schedule.num_ranks - 1}") + 1
    header = " " * label + "".join(f"{step:^{width}}" for step in range(first, last))
    rows = [("step".ljust(label) + header[label:]).rstrip()]
    for rank, acts in enumerate(schedule.actions):
        cells = []
        for step in range(first, last):
            text = str(acts[step]) if step < len(acts) else ("." if (rank, step) in marks else "")
            if (rank, step) in marks:
                cells.append(f">{text}<".center(width))
            else:
                cells.append(text.center(width))
        rows.append((f"rank {rank}".ljust(label) + "".join(cells)).rstrip())
    if first > 0 or last < steps:
        rows.append(f"(steps {first}..{last - 1} of {steps} shown)")
    return "\n".join(rows)


def _fail(schedule: Schedule, problem: str, marks: dict[tuple[int, int], str]) -> ValueError:
    return ValueError(
        f"schedule {schedule.name!r} ({schedule.num_ranks} ranks, {schedule.num_stages} stages, "
        f"{schedule.num_microbatches} microbatches) is invalid: {problem}\n"
        f"{format_grid(schedule, marks)}"
    )


def check_structure(schedule: Schedule) -> None:
    """Raise ValueError unless each required (stage, op, microbatch) appears exactly once, on
    the rank its stage is placed on, and nothing else appears."""
    num_stages, num_mb = schedule.num_stages, schedule.num_microbatches
    if num_stages < 1 or num_mb < 1 or schedule.num_ranks < 1:
        raise ValueError(
            f"schedule needs >= 1 rank, stage and microbatch (got {schedule.num_ranks} ranks, "
            f"{num_stages} stages, {num_mb} microbatches)"
        )
    bad_place = [r for r in schedule.placement if not 0 <= r < schedule.num_ranks]
    if bad_place:
        raise ValueError(
            f"placement {schedule.placement} names ranks {bad_place} outside "
            f"0..{schedule.num_ranks - 1}; place every stage on an existing rank"
        )
    ops = _OPS if schedule.splits_backward else _OPS[:2]
    seen: dict[Action, tuple[int, int]] = {}
    for rank, acts in enumerate(schedule.actions):
        for step, a in enumerate(acts):
            where = {(rank, step): "x"}
            if not (0 <= a.stage < num_stages and 0 <= a.microbatch < num_mb):
                raise _fail(
                    schedule,
                    f"rank {rank} step {step}: {a} is out of range (stages 0..{num_stages - 1}, "
                    f"microbatches 0..{num_mb - 1})",
                    where,
                )
            if a.op not in ops:
                raise _fail(
                    schedule,
                    f"rank {rank} step {step}: {a} is a W but this schedule does not split "
                    "backward (mark it splits_backward=True, or drop the W)",
                    where,
                )
            if schedule.placement[a.stage] != rank:
                raise _fail(
                    schedule,
                    f"rank {rank} step {step}: {a} belongs to stage {a.stage}, which is placed "
                    f"on rank {schedule.placement[a.stage]}; move it there",
                    where,
                )
            if a in seen:
                first = seen[a]
                raise _fail(
                    schedule,
                    f"rank {rank} step {step}: {a} is repeated (first at rank {first[0]} step "
                    f"{first[1]}); each action must appear exactly once",
                    {**where, first: "x"},
                )
            seen[a] = (rank, step)
    expected = num_stages * num_mb * len(ops)
    if len(seen) != expected:
        missing = [
            Action(s, op, m)
            for s in range(num_stages)
            for op in ops
            for m in range(num_mb)
            if Action(s, op, m) not in seen
        ]
        shown = " ".join(str(a) for a in missing[:12]) + (" ..." if len(missing) > 12 else "")
        raise _fail(
            schedule,
            f"{len(missing)} actions missing: {shown}; add each on its stage's rank",
            {},
        )


def execute(
    schedule: Schedule,
    duration: Callable[[int, int], float],
    latency: Callable[[int, int, int], float],
    scale: Callable[[int, int, int], float] | None = None,
) -> list[list[tuple[float, float]]]:
    """Run each rank's list in order; return per rank the (start, end) of each action.
    `scale(stage, op, microbatch)`, when given, multiplies each action's cost (a replay of
    measured spread).

    An action starts when its rank is free and every input has arrived: `duration(stage, op)`
    gives its cost (op 0/1/2 = F/B/W) and `latency(from_stage, to_stage, op)` the delay of a
    cross-rank input (same-rank handoffs are free). Sends are buffered, receives block.
    A worklist wakes only the ranks waiting on a just-finished action, so the cost is linear in
    the number of actions. Raises ValueError (grid marked) when some rank can never proceed.
    Call `check_structure` first: this assumes every action appears exactly once.
    """
    num_stages, num_mb = schedule.num_stages, schedule.num_microbatches
    placement = schedule.placement
    n_ranks = schedule.num_ranks
    # Precompute per (stage, op) cost once; the hot loop indexes it.
    cost = [[duration(s, o) for o in range(3)] for s in range(num_stages)]
    done: dict[int, float] = {}  # key (stage*3 + op)*num_mb + mb -> end time
    waiting: dict[int, list[int]] = {}
    pointer = [0] * n_ranks
    free = [0.0] * n_ranks
    times: list[list[tuple[float, float]]] = [[] for _ in range(n_ranks)]
    ranks = [[(a.stage, _OP_INDEX[a.op], a.microbatch) for a in acts] for acts in schedule.actions]
    # (stage, op index) pairs each (stage, op) waits for, from the one dependency rule.
    needs = [
        [
            tuple((d.stage, _OP_INDEX[d.op]) for d in dependencies(Action(s, op, 0), num_stages))
            for op in _OPS
        ]
        for s in range(num_stages)
    ]
    queue = deque(range(n_ranks))
    while queue:
        rank = queue.popleft()
        acts, i, t_free, out = ranks[rank], pointer[rank], free[rank], times[rank]
        while i < len(acts):
            s, o, m = acts[i]
            start = t_free
            blocked = -1
            for ds, do in needs[s][o]:
                key = (ds * 3 + do) * num_mb + m
                end = done.get(key)
                if end is None:
                    blocked = key
                    break
                if placement[ds] != rank:
                    end += latency(ds, s, do)
                if end > start:
                    start = end
            if blocked >= 0:
                waiting.setdefault(blocked, []).append(rank)
                break
            t_free = start + (cost[s][o] if scale is None else cost[s][o] * scale(s, o, m))
            out.append((start, t_free))
            key = (s * 3 + o) * num_mb + m
            done[key] = t_free
            woken = waiting.pop(key, None)
            if woken:
                queue.extend(woken)
            i += 1
        pointer[rank], free[rank] = i, t_free
    stuck = [r for r in range(n_ranks) if pointer[r] < len(ranks[r])]
    if stuck:
        raise _deadlock(schedule, pointer, stuck)
    return times


def _deadlock(schedule: Schedule, pointer: Sequence[int], stuck: list[int]) -> ValueError:
    position = {a: (r, i) for r, acts in enumerate(schedule.actions) for i, a in enumerate(acts)}
    reasons = []
    for rank in stuck:
        step = pointer[rank]
        action = schedule.actions[rank][step]
        for dep in dependencies(action, schedule.num_stages):
            dr, di = position[dep]
            if di < pointer[dr]:
                continue
            if dr == rank:
                reasons.append(
                    f"rank {rank} step {step}: {action} needs {dep}, which rank {rank} only runs "
                    f"later, at step {di}"
                )
            else:
                reasons.append(
                    f"rank {rank} step {step}: {action} waits for {dep} from rank {dr} step {di}, "
                    f"but rank {dr} is itself blocked at step {pointer[dr]}"
                )
            break
    problem = (
        "deadlock, the ranks' orders can never all finish:\n  "
        + "\n  ".join(reasons)
        + "\nreorder so every action comes after what it needs"
    )
    return _fail(schedule, problem, {(r, pointer[r]): "x" for r in stuck})


def validate(schedule: Schedule) -> None:
    """Raise ValueError (with the rank-by-step grid, offending steps marked) unless `schedule`
    can run: each required action exactly once on its stage's rank, and no deadlock when each
    rank runs its list in order with blocking receives and buffered sends.

    Dependencies: F(s,m) needs F(s-1,m); B(s,m) needs F(s,m) and B(s+1,m); W(s,m) needs B(s,m).
    """
    check_structure(schedule)
    execute(schedule, lambda s, o: 0.0, lambda a, b, o: 0.0)
