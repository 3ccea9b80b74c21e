"""Simulator: hand-computed timelines, and the published bubble / step-time / memory formulas."""

from __future__ import annotations

import pytest

from scheduler import Event, Op, Schedule, Timeline, build_schedule, simulate, validate

P_RANGE = range(2, 9)
M_RANGE = range(1, 33)


def _idle(t: Timeline) -> float:
    return t.num_ranks * t.step_time - sum(e.duration for e in t.events)


def test_hand_computed_timeline_with_latency_and_bandwidth() -> None:
    s = build_schedule("gpipe", 2, 1)
    t = simulate(s, 1, 2, comm=0.5)
    assert t.events == (
        Event(0, 0, Op.F, 0, 0.0, 1.0),
        Event(0, 0, Op.B, 0, 5.0, 7.0),
        Event(1, 1, Op.F, 0, 1.5, 2.5),
        Event(1, 1, Op.B, 0, 2.5, 4.5),
    )
    # 100 bytes at 100 bytes per unit adds 1 to each crossing.
    t = simulate(s, 1, 2, comm=0.5, bandwidth=100.0, message_bytes=[100.0])
    assert [(e.start, e.end) for e in t.events] == [(0, 1), (7, 9), (2.5, 3.5), (3.5, 5.5)]
    assert t.step_time == 9.0 and t.name == "gpipe"


def test_per_stage_costs_and_unsplit_backward_includes_weight() -> None:
    t = simulate(build_schedule("1f1b", 2, 2), forward=[1, 3], backward=[2, 1], weight=1)
    # B costs backward + weight = [3, 2] because 1f1b does not split backward.
    assert [
        (e.rank, str(e.stage) + e.op.value + str(e.microbatch), e.start, e.end) for e in t.events
    ] == [
        (0, "0F0", 0, 1),
        (0, "0F1", 1, 2),
        (0, "0B0", 6, 9),
        (0, "0B1", 11, 14),
        (1, "1F0", 1, 4),
        (1, "1B0", 4, 6),
        (1, "1F1", 6, 9),
        (1, "1B1", 9, 11),
    ]


def test_same_rank_handoff_is_free() -> None:
    # zbv: stages 1 and 2 share rank 1; 2F0 starts right when 1F0 ends despite comm.
    t = simulate(build_schedule("zbv", 2, 3), 1, 1, 1, comm=10)
    start = {(e.stage, e.op, e.microbatch): e.start for e in t.events}
    end = {(e.stage, e.op, e.microbatch): e.end for e in t.events}
    assert start[(2, Op.F, 0)] == end[(1, Op.F, 0)]
    assert start[(1, Op.F, 0)] == end[(0, Op.F, 0)] + 10


def test_activation_memory_curve() -> None:
    t = simulate(build_schedule("1f1b", 2, 2), 1, 2, activation=[2.0, 5.0])
    assert t.peak_inflight == (2, 1)
    assert t.peak_memory == (4.0, 5.0)
    assert t.memory[1] == ((0.0, 0.0), (1.0, 5.0), (4.0, 0.0), (4.0, 5.0), (7.0, 0.0))


@pytest.mark.parametrize("p", P_RANGE)
def test_gpipe_and_1f1b_unit_costs(p: int) -> None:
    for m in M_RANGE:
        for name in ("gpipe", "1f1b"):
            t = simulate(build_schedule(name, p, m), 1, 2)
            assert t.step_time == 3 * (m + p - 1), (name, p, m)
            assert t.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-12)
        assert simulate(build_schedule("gpipe", p, m), 1, 2).peak_inflight[0] == m
        peaks = simulate(build_schedule("1f1b", p, m), 1, 2).peak_inflight
        assert peaks == tuple(min(p - i, m) for i in range(p))  # [p, p-1, ..., 1] when m >= p


@pytest.mark.parametrize("p", P_RANGE)
def test_eager_1f1b_costs(p: int) -> None:
    """Without latency eager 1F1B takes 1F1B's step; it holds one more activation on every rank
    but the last; with latency it is never slower (p=2: 2 floor((m-1)/2) L faster, the L per
    steady-state microbatch that 1F1B pays)."""
    for m in M_RANGE:
        eager, plain = build_schedule("1f1b-eager", p, m), build_schedule("1f1b", p, m)
        t = simulate(eager, 1, 2)
        assert t.step_time == 3 * (m + p - 1), (p, m)
        assert t.peak_inflight == tuple(min(p - i + 1 if i < p - 1 else 1, m) for i in range(p))
        for latency in (0.1, 0.3):
            slow, fast = (simulate(x, 1, 2, comm=latency).step_time for x in (plain, eager))
            assert fast <= slow + 1e-9, (p, m, latency)
            if p == 2 and m >= 2:
                assert slow - fast == pytest.approx(2 * ((m - 1) // 2) * latency), (m, latency)


@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("p", P_RANGE)
def test_interleaved_bubble(p: int, v: int) -> None:
    for m in range(p, 33, p):
        t = simulate(build_schedule("interleaved-1f1b", p, m, v), 1, 2)
        assert t.step_time == 3 * (v * m + p - 1)
        assert t.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-12)


@pytest.mark.parametrize("p", P_RANGE)
def test_zero_bubble_table_2(p: int) -> None:
    """Qi et al. Table 2 at F=1, B=2, W=1; for m < 2p the figures each order reaches."""
    for m in M_RANGE:
        one = simulate(build_schedule("1f1b", p, m), 1, 2, 1)
        h1 = simulate(build_schedule("zb-h1", p, m), 1, 2, 1)
        h2 = simulate(build_schedule("zb-h2", p, m), 1, 2, 1)
        assert one.step_time == 4 * (m + p - 1)
        # Below m = p (zb-h1) or m = 2p-1 (zb-h2) there are too few microbatches to fill the
        # warm-up, and one microbatch's dependency chain sets the step.
        assert h1.step_time == 4 * m + 2 * (p - 1) + max(0, p - m), (p, m)
        assert h2.step_time == 4 * m + (p - 1) + max(0, 2 * p - 1 - m), (p, m)
        if m >= 2 * p:
            assert h2.step_time == (p - 1) * 1 + m * (1 + 2 + 1)  # the one-step lower bound
        assert h1.peak_inflight == (min(p, m),) * p
        assert h2.peak_inflight == (min(2 * p - 1, m),) * p


@pytest.mark.parametrize("p", P_RANGE)
def test_zb_h1_idle_is_a_third_of_1f1b(p: int) -> None:
    for m in range(2 * p, 33):
        one = simulate(build_schedule("1f1b", p, m), 1, 1, 1)
        h1 = simulate(build_schedule("zb-h1", p, m), 1, 1, 1)
        assert 3 * _idle(h1) == _idle(one) == 3 * p * (p - 1)


@pytest.mark.parametrize("p", P_RANGE)
def test_zbv_reaches_its_lower_bound(p: int) -> None:
    for m in range(2 * p - 1, 33):
        t = simulate(build_schedule("zbv", p, m), 0.5, 0.5, 0.5, activation=0.5)
        assert t.step_time == 3 * m + (p - 1) / 2
        assert t.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1), rel=1e-12)
        busiest = max(sum(e.duration for e in t.for_rank(r)) for r in range(p))
        assert busiest == 3 * m
        assert t.peak_inflight == (2 * p,) * p
        assert t.peak_memory == (float(p),) * p


@pytest.mark.parametrize("p", range(2, 7))
def test_dualpipev_ties_zbv_at_uniform_costs(p: int) -> None:
    for m in range(2 * p, 4 * p + 1):
        t = simulate(build_schedule("dualpipev", p, m), 0.5, 0.5, 0.5)
        assert t.step_time == 3 * m + (p - 1) / 2
        assert t.peak_inflight == (2 * p + 1,) * p


def test_deadlock_raises_the_validator_error() -> None:
    bad = Schedule.from_text("0F0 0B0 0F1 0B1\n1F1 1B1 1F0 1B0")
    with pytest.raises(ValueError) as from_validate:
        validate(bad)
    with pytest.raises(ValueError) as from_simulate:
        simulate(bad, 1, 2)
    assert str(from_simulate.value) == str(from_validate.value)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"forward": [1, 2, 3]}, "forward has 3 entries for 2 stages"),
        ({"backward": -1}, "backward costs (-1.0, -1.0) include a negative value"),
        ({"comm": -0.1}, "comm=-0.1 is negative"),
        ({"bandwidth": 10.0}, "give both bandwidth and message_bytes"),
        ({"bandwidth": 0.0, "message_bytes": 1.0}, "bandwidth=0.0 must be > 0"),
        ({"bandwidth": 1.0, "message_bytes": [1, 2, 3]}, "message_bytes has 3 entries"),
        ({"activation": [1.0]}, "activation has 1 entries for 2 stages"),
    ],
)
def test_bad_costs(kwargs: dict, needle: str) -> None:
    args = {"forward": 1.0, "backward": 2.0, **kwargs}
    with pytest.raises(ValueError) as info:
        simulate(build_schedule("1f1b", 2, 2), **args)
    assert needle in str(info.value)


def test_timeline_rejects_an_event_outside_its_ranks() -> None:
    with pytest.raises(ValueError, match="names rank 2, outside 0..1"):
        Timeline((Event(2, 0, Op.F, 0, 0.0, 1.0),), num_ranks=2, splits_backward=False)
