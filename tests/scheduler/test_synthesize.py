"""`scheduler.synthesize`: on random cost profiles the result is a valid split-backward schedule
within the memory limit (as `Timeline.peak_inflight` counts it), never slower than any
generator that fits the limit, never faster than `lower_bound`, and the same for the same
inputs; literal small cases worked out by hand; bad input refused with the fix named."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import (
    Op,
    build_schedule,
    lower_bound,
    simulate,
    synthesize,
    validate,
)

FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# The generators written for each chunk count (their own placements: line, V, round robin).
WRITTEN = {1: ("gpipe", "1f1b", "1f1b-eager", "zb-h1", "zb-h2"),
           2: ("zbv", "dualpipev", "interleaved-1f1b")}


@st.composite
def profiles(draw: st.DrawFn) -> tuple[int, int, int, list[float], list[float], list[float],
                                        float, list[int]]:
    """(p, m, v, F, B, W per stage, comm, per-rank memory limit): uneven positive costs (a
    heavy first and last stage likely), any limit from the least possible (v) upwards."""
    v = draw(st.sampled_from([1, 1, 2]))
    p = draw(st.integers(1, 4))
    m = draw(st.integers(1, 8))
    n = p * v
    cost = st.floats(0.1, 3.0, allow_nan=False)
    f = draw(st.lists(cost, min_size=n, max_size=n))
    b = draw(st.lists(cost, min_size=n, max_size=n))
    w = draw(st.lists(st.floats(0.05, 2.0), min_size=n, max_size=n))
    comm = draw(st.sampled_from([0.0, 0.05, 0.5]))
    limits = draw(st.lists(st.integers(v, 2 * n + 1), min_size=p, max_size=p))
    return p, m, v, f, b, w, comm, limits


def _fitting_generators(p: int, m: int, v: int, f: list[float], b: list[float],
                        w: list[float], comm: float, limits: list[int]) -> dict[str, float]:
    """Simulated step of every generator (as written, split or not) that fits the limits."""
    out = {}
    for name in WRITTEN[v]:
        try:
            schedule = build_schedule(name, p, m, v)
        except ValueError:
            continue
        timeline = simulate(schedule, f, b, w, comm)
        if all(x <= lim for x, lim in zip(timeline.peak_inflight, limits, strict=True)):
            out[name] = timeline.step_time
    return out


@FUZZ
@given(profiles())
def test_valid_within_memory_and_never_worse_than_the_generators(
    case: tuple[int, int, int, list[float], list[float], list[float], float, list[int]],
) -> None:
    p, m, v, f, b, w, comm, limits = case
    schedule = synthesize(p, m, f, b, w, comm, memory_limit=limits, virtual_stages=v)
    validate(schedule)
    assert schedule.splits_backward
    assert (schedule.num_ranks, schedule.num_stages, schedule.num_microbatches) == (p, p * v, m)
    assert sum(a.op is Op.W for acts in schedule.actions for a in acts) == p * v * m
    timeline = simulate(schedule, f, b, w, comm)
    assert all(x <= lim for x, lim in zip(timeline.peak_inflight, limits, strict=True)), (
        timeline.peak_inflight, limits)
    for name, step in _fitting_generators(p, m, v, f, b, w, comm, limits).items():
        assert timeline.step_time <= step + 1e-9, (name, step, timeline.step_time)
    bound = lower_bound(p, m, f, b, w, comm, placement=schedule.placement)
    assert timeline.step_time >= bound - 1e-9


@pytest.mark.slow
def test_deterministic_and_fast_at_p8_m32() -> None:
    """The same inputs give the same schedule (the evaluation budget, not the clock, ends the
    search at this size), and it beats 1F1B by the zero-bubble margin at least."""
    f = [2.0, 1.0, 1.1, 0.9, 1.2, 1.0, 0.8, 2.5]
    b = [1.5, 2.0, 2.1, 1.8, 2.2, 2.0, 1.7, 4.0]
    w = [0.6, 0.8, 0.7, 0.9, 0.8, 0.7, 0.6, 1.0]
    runs = [synthesize(8, 32, f, b, w, 0.05, memory_limit=8, time_limit=60.0) for _ in range(2)]
    assert runs[0].to_text() == runs[1].to_text()
    step = simulate(runs[0], f, b, w, 0.05).step_time
    assert step <= simulate(build_schedule("zb-h1", 8, 32), f, b, w, 0.05).step_time
    assert step < simulate(build_schedule("1f1b", 8, 32), f, b, w, 0.05).step_time


def test_memory_limit_one_forces_one_microbatch_at_a_time() -> None:
    """p=2, m=3, F=B=W=1, one activation per rank: each rank must finish a microbatch's W
    before its next F, so the only valid order is F B W per microbatch on both ranks, and the
    step is 3 x 5: rank 0 F [0,1], rank 1 F [1,2] B [2,3], then rank 0's B [3,4] (while rank
    1 runs its W) and W [4,5]; the next F starts at 5."""
    schedule = synthesize(2, 3, 1.0, 1.0, 1.0, memory_limit=1)
    assert schedule.to_text() == (
        "0F0 0B0 0W0 0F1 0B1 0W1 0F2 0B2 0W2\n"
        "1F0 1B0 1W0 1F1 1B1 1W1 1F2 1B2 1W2"
    )
    timeline = simulate(schedule, 1.0, 1.0, 1.0)
    assert timeline.step_time == 15.0
    assert timeline.peak_inflight == (1, 1)


def test_two_ranks_two_microbatches_reach_the_bound() -> None:
    """p=2, m=2, F=B=W=1, limit 2: rank 1 starts at 1 and then works without a gap,
    F0 [1,2] B0 [2,3] F1 [3,4] B1 [4,5] W0 [5,6] W1 [6,7]; rank 0 runs F0 F1 [0,2], waits for
    B0 (ready at 3): B0 [3,4] W0 [4,5], then B1 (ready at 5) [5,6] W1 [6,7]. Step 7 =
    F + m(F+B+W), the lower bound."""
    schedule = synthesize(2, 2, 1.0, 1.0, 1.0, memory_limit=2)
    assert schedule.to_text() == (
        "0F0 0F1 0B0 0W0 0B1 0W1\n"
        "1F0 1B0 1F1 1B1 1W0 1W1"
    )
    assert simulate(schedule, 1.0, 1.0, 1.0).step_time == 7.0 == lower_bound(2, 2, 1, 1, 1)


def test_uneven_costs_beat_every_generator() -> None:
    """p=3, m=4, F=(2,2,1), B=(3,2,1), W=1, limit 4. Rank 0 has the most work, 4 x 6 = 24,
    and the synthesised order keeps it busy from 0 to 24: F0-F3 [0,8], B0 [8,11] (rank 1's
    B0 ends at 8), W0 [11,12], B1 [12,15], B2 [15,18], W1 W2 [18,20], B3 [20,23] (rank 1's
    B3 ends at 20), W3 [23,24]. Rank 1: F0 [2,4] F1 [4,6] B0 [6,8] F2 [8,10] B1 [10,12]
    B2 [12,14] F3 [14,16] W0 W1 [16,18] B3 [18,20] W2 W3 [20,22], at most 4 held (F0-F3
    before W0). Rank 2 runs each microbatch's F B W as its input arrives: [4,7], [7,10],
    [10,13], [16,19], holding one. Step 24 = the lower bound; of the orders reaching it this
    one holds the least (rank 2: 1). The generators fitting the limit take 26 (ZB-H1,
    ZB-H2) to 32 (GPipe)."""
    f, b, w = [2.0, 2.0, 1.0], [3.0, 2.0, 1.0], 1.0
    schedule = synthesize(3, 4, f, b, w, memory_limit=4)
    assert schedule.to_text() == (
        "0F0 0F1 0F2 0F3 0B0 0W0 0B1 0B2 0W1 0W2 0B3 0W3\n"
        "1F0 1F1 1B0 1F2 1B1 1B2 1F3 1W0 1W1 1B3 1W2 1W3\n"
        "2F0 2B0 2W0 2F1 2B1 2W1 2F2 2B2 2W2 2F3 2B3 2W3"
    )
    timeline = simulate(schedule, f, b, w)
    assert timeline.step_time == 24.0 == lower_bound(3, 4, f, b, w)
    assert timeline.peak_inflight == (4, 4, 1)
    best = _fitting_generators(3, 4, 1, f, b, [w] * 3, 0.0, [4, 4, 4])
    assert best == {"1f1b": 29.0, "1f1b-eager": 28.0, "zb-h1": 26.0, "zb-h2": 26.0,
                    "gpipe": 32.0}


def test_uniform_costs_match_zb_h2_at_the_bound() -> None:
    """F=B=W=1 with room for ZB-H2 (2p-1): the lower bound (p-1) + 3m is reached."""
    schedule = synthesize(4, 8, 1.0, 1.0, 1.0, memory_limit=7)
    assert simulate(schedule, 1.0, 1.0, 1.0).step_time == 3 + 3 * 8 == lower_bound(4, 8, 1, 1, 1)


def test_lower_bound_terms() -> None:
    """(a) per rank: arrival of the first forward + all its work; (b) one microbatch's chain."""
    # (a): rank 1 starts at F0 + comm = 1.5 and has 2 x (1 + 2 + 1) = 8 of work.
    assert lower_bound(2, 2, [1.0, 1.0], [1.0, 2.0], 1.0, 0.5) == 9.5
    # (b): m=1, the chain F0 F1 (+comm) B1 B0 (+comm) W0 = 1 + 0.5 + 1 + 2 + 0.5 + 1 + 1.
    assert lower_bound(2, 1, [1.0, 1.0], [1.0, 2.0], 1.0, 0.5) == 7.0


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"memory_limit": 1, "virtual_stages": 2}, ValueError,
         "memory_limit=1 is below virtual_stages=2"),
        ({"memory_limit": [2, 2, 2]}, TypeError, "one int per rank (2)"),
        ({"memory_limit": 2.5}, TypeError, "memory_limit must be an int"),
        ({"memory_limit": 2, "virtual_stages": 0}, ValueError, "virtual_stages must be an int"),
    ],
)
def test_bad_input_names_the_fix(kwargs: dict[str, object], error: type[Exception],
                                 message: str) -> None:
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        synthesize(2, 4, 1.0, 2.0, 1.0, **kwargs)  # type: ignore[arg-type]


def test_bad_costs_are_refused() -> None:
    with pytest.raises(ValueError, match="costs must be >= 0"):
        synthesize(2, 4, [1.0, -1.0], 2.0, 1.0, memory_limit=2)
    with pytest.raises(ValueError, match="forward has 3 entries for 2 stages"):
        synthesize(2, 4, [1.0, 1.0, 1.0], 2.0, 1.0, memory_limit=2)
    with pytest.raises(ValueError, match="comm=-1"):
        synthesize(2, 4, 1.0, 2.0, 1.0, -1.0, memory_limit=2)
