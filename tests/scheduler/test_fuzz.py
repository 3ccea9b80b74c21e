"""Fuzzing (hypothesis, bounded): generated schedules always validate and simulate; mutated ones
are always rejected with ValueError; a random reorder is accepted exactly when an independent
oracle (cycle check on dependencies + program order) finds it deadlock-free; simulated step
times respect the busiest-rank bound."""

from __future__ import annotations

from collections import Counter
from graphlib import CycleError, TopologicalSorter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import SCHEDULES, Action, Op, Schedule, build_schedule, simulate, validate
from scheduler.validate import dependencies

DEADLOCK = r"deadlock, the ranks' orders can never all finish:\n  rank \d+ step \d+: "
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def schedules(draw: st.DrawFn) -> Schedule:
    """A schedule from any generator, at a random size that generator accepts."""
    name = draw(st.sampled_from(sorted(SCHEDULES)))
    p = draw(st.integers(1, 8))
    if name == "interleaved-1f1b":
        v = draw(st.integers(2, 3))
        m = p * draw(st.integers(1, 32 // p))
    elif name in ("zbv", "dualpipev"):
        v = 2
        m = draw(st.integers(2 * p - (name == "zbv"), 32))
    else:
        v = 1
        m = draw(st.integers(1, 32))
    return build_schedule(name, p, m, v)


def _required(s: Schedule) -> Counter[Action]:
    ops = (Op.F, Op.B, Op.W) if s.splits_backward else (Op.F, Op.B)
    return Counter(
        Action(st_, op, m)
        for st_ in range(s.num_stages)
        for op in ops
        for m in range(s.num_microbatches)
    )


def _replace(s: Schedule, rank: int, actions: list[Action]) -> Schedule:
    per_rank = list(s.actions)
    per_rank[rank] = tuple(actions)
    return Schedule(
        s.num_ranks,
        s.num_stages,
        s.num_microbatches,
        s.placement,
        tuple(per_rank),
        s.splits_backward,
        name=s.name,
    )


@FUZZ
@given(schedules())
def test_generated_schedules_validate_and_simulate(s: Schedule) -> None:
    validate(s)
    assert Counter(a for acts in s.actions for a in acts) == _required(s)
    t = simulate(s, 1.0, 2.0, 1.0)
    assert len(t.events) == sum(len(acts) for acts in s.actions)


@FUZZ
@given(schedules(), st.data())
def test_random_costs_respect_the_busiest_rank_bound(s: Schedule, data: st.DataObject) -> None:
    costs = st.lists(st.floats(0.01, 10.0), min_size=s.num_stages, max_size=s.num_stages)
    f, b, w = data.draw(costs), data.draw(costs), data.draw(costs)
    comm = data.draw(st.floats(0.0, 5.0))
    t = simulate(s, f, b, w, comm)
    busy = [0.0] * s.num_ranks
    for stage, rank in enumerate(s.placement):
        busy[rank] += s.num_microbatches * (f[stage] + b[stage] + w[stage])
    assert t.step_time >= max(busy) * (1 - 1e-9)
    assert 0.0 <= t.bubble_fraction < 1.0


@FUZZ
@given(schedules(), st.data())
def test_mutations_are_rejected(s: Schedule, data: st.DataObject) -> None:
    rank = data.draw(st.sampled_from([r for r, acts in enumerate(s.actions) if acts]))
    acts = list(s.actions[rank])
    kind = data.draw(st.sampled_from(["drop", "duplicate", "swap"]))
    if kind == "drop":
        del acts[data.draw(st.integers(0, len(acts) - 1))]
    elif kind == "duplicate":
        i = data.draw(st.integers(0, len(acts) - 1))
        acts.insert(data.draw(st.integers(0, len(acts))), acts[i])
    else:
        # Swap an action with one it depends on, both on this rank (always such a pair: every
        # B follows its own F on the same rank).
        index = {a: i for i, a in enumerate(acts)}
        pairs = [
            (index[d], j)
            for j, a in enumerate(acts)
            for d in dependencies(a, s.num_stages)
            if d in index
        ]
        i, j = data.draw(st.sampled_from(pairs))
        acts[i], acts[j] = acts[j], acts[i]
    mutated = _replace(s, rank, acts)
    try:
        validate(mutated)
    except ValueError:
        pass
    else:
        raise AssertionError(f"{kind} mutation of {s.name} accepted:\n{mutated.to_text()}")
    try:
        simulate(mutated, 1.0, 2.0, 1.0)
    except ValueError:
        return
    raise AssertionError(f"simulate accepted a {kind} mutation of {s.name}")


def _deadlock_free(s: Schedule) -> bool:
    """Independent oracle (not the validator's worklist engine): in-order ranks with blocking
    receives and buffered sends all finish iff the graph of data dependencies plus each rank's
    program order has no cycle."""
    graph: dict[Action, list[Action]] = {}
    for acts in s.actions:
        for i, a in enumerate(acts):
            graph[a] = dependencies(a, s.num_stages) + ([acts[i - 1]] if i else [])
    try:
        TopologicalSorter(graph).prepare()
    except CycleError:
        return False
    return True


@FUZZ
@given(schedules(), st.data())
def test_arbitrary_reorders_are_accepted_exactly_when_deadlock_free(
    s: Schedule, data: st.DataObject
) -> None:
    rank = data.draw(st.sampled_from([r for r, acts in enumerate(s.actions) if acts]))
    acts = list(s.actions[rank])
    i = data.draw(st.integers(0, len(acts) - 1))
    # Neighbours often commute (a valid reorder); far swaps usually deadlock: draw both.
    j = data.draw(st.one_of(st.just(min(i + 1, len(acts) - 1)), st.integers(0, len(acts) - 1)))
    acts[i], acts[j] = acts[j], acts[i]
    mutated = _replace(s, rank, acts)
    if not _deadlock_free(mutated):
        with pytest.raises(ValueError, match=DEADLOCK):
            validate(mutated)
        with pytest.raises(ValueError, match="deadlock"):
            simulate(mutated, 1.0, 2.0, 1.0)
        return
    validate(mutated)
    t = simulate(mutated, 1.0, 2.0, 1.0)
    # Every action starts only after each of its inputs has finished.
    end = {(e.stage, e.op, e.microbatch): e.end for e in t.events}
    for e in t.events:
        for d in dependencies(Action(e.stage, e.op, e.microbatch), s.num_stages):
            assert e.start >= end[(d.stage, d.op, d.microbatch)], (e, d)
