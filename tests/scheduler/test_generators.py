"""Generators: exact output at small sizes (hand-checked grids for interleaved-1f1b and zbv),
the published closed forms at many sizes, placements, size errors, text round trips."""

from __future__ import annotations

import re

import pytest

from scheduler import SCHEDULES, Action, Op, Schedule, build_schedule, validate

EXPECTED = {
    ("gpipe", 3, 4, 1): """
0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3
1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3
2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3
""",
    ("1f1b", 3, 4, 1): """
0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3
2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3
""",
    ("1f1b-eager", 3, 4, 1): """
0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3
1F0 1F1 1F2 1B0 1F3 1B1 1B2 1B3
2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3
""",
    ("zb-h1", 3, 4, 1): """
0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1 0B2 0W2 0B3 0W3
1F0 1F1 1B0 1F2 1B1 1W0 1F3 1B2 1W1 1B3 1W2 1W3
2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2W2 2W3
""",
    ("zb-h2", 3, 4, 1): """
0F0 0F1 0F2 0F3 0B0 0W0 0B1 0W1 0B2 0W2 0B3 0W3
1F0 1F1 1F2 1B0 1F3 1B1 1B2 1W0 1B3 1W1 1W2 1W3
2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2W0 2W1 2W2 2W3
""",
}

# Hand-checked grids for the multi-chunk schedules, derived from the published rules rather
# than copied from the generator's output.
#
# Interleaved 1F1B, Megatron-LM (Narayanan et al. SC21; `forward_backward_pipelining_with_
# interleaving`): rank r runs v*m chunk-forwards; the k-th is chunk (k // p) % v on microbatch
# (k // (p*v)) * p + k % p, i.e. p microbatches per chunk, chunk 0 to v-1, then the next group
# of p. Backwards walk the chunks in reverse (chunk v-1-(k // p) % v). Rank r first runs
# w = min(2(p-r-1) + (v-1)p, v*m) forwards, then alternates F(w+k), B(k), then drains.
#   p=2, m=4, v=2 (stage = chunk*2 + r): rank 0: w=4, forwards 0F0 0F1 2F0 2F1 | 0F2 0F3 2F2
#   2F3, backwards 2B0 2B1 0B0 0B1 | 2B2 2B3 0B2 0B3; rank 1: w=2, forwards 1F0 1F1 3F0 3F1 |
#   1F2 1F3 3F2 3F3, backwards 3B0 3B1 1B0 1B1 | 3B2 3B3 1B2 1B3.
#   p=3, m=3, v=2: w = 6 (capped at v*m), 5, 3 on ranks 0, 1, 2.
# ZB-V (Qi et al. ICLR 2024, section 6): rank r holds chunk 0 = stage r and chunk 1 = stage
# 2p-1-r. Per rank: 2(p-r)-1 chunk-0 F; r pairs (F1, F0); p-r triples (F1 B1 W1); then
# (F0 B0 W0 F1 B1 W1) while chunk 0 has forwards left, (B0 W0 F1 B1 W1) until chunk 1 has run
# all; r pairs (B0, B1); p-r pairs (B0, W0) taking the oldest W0; the deferred W1s, then W0s.
# Each stage's F, B and W take microbatches in increasing order.
#   p=2, m=4 rank 1 (stages 1, 2): 1F0 | 2F0 1F1 | 2F1 2B0 2W0 | 1F2 1B0 1W0 2F2 2B1 2W1 1F3
#   1B1 1W1 2F3 2B2 2W2 | 1B2 2B3 | 1B3 1W2 | 2W3 | 1W3.
# All four grids were also compared with torch 2.14's ScheduleInterleaved1F1B and
# ScheduleZBVZeroBubble `_calculate_single_rank_operations`: identical, torch's I being our B.
# DualPipeV, traced by hand from torch's ScheduleDualPipeV rank by rank (its FULL_BACKWARD and
# the backward of an OVERLAP_F_B written as B then W, its F first): chunk 0 = stage r, chunk
# 1 = stage 2p-1-r; 2(p-r-1) F0; r+1 (F0 F1); p-r-1 (B1, oldest queued W, F1);
# m-2p+r+1 (F0 B1W1 F1 B0W0); p-r-1 (B1W1 F1 B0W0); r+1 (B1, B0), input-only (W queued) from
# the middle one on, odd ranks switching one B earlier; p-r-1 (oldest W, B0 input-only); the
# queued Ws. p=3, m=6 rank 2: 2F0 3F0 2F1 3F1 2F2 3F2 | 2F3 3B0 3W0 3F3 2B0 2W0 (x3) | 3B3 3W3
# 2B3 2W3 3B4 3W4 2B4 3B5 2B5 | 2W4 3W5 2W5.
HAND_CHECKED = {
    ("interleaved-1f1b", 2, 4, 2): """
0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3
""",
    ("interleaved-1f1b", 3, 3, 2): """
0F0 0F1 0F2 3F0 3F1 3F2 3B0 3B1 3B2 0B0 0B1 0B2
1F0 1F1 1F2 4F0 4F1 4F2 4B0 4B1 4B2 1B0 1B1 1B2
2F0 2F1 2F2 5F0 5B0 5F1 5B1 5F2 5B2 2B0 2B1 2B2
""",
    ("zbv", 2, 4, 2): """
0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0F3 0B0 0W0 3F2 3B2 3W2 0B1 0W1 3F3 3B3 3W3 0B2 0W2 0B3 0W3
1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1F3 1B1 1W1 2F3 2B2 2W2 1B2 2B3 1B3 1W2 2W3 1W3
""",
    ("zbv", 3, 5, 2): "\n".join(
        [
            "0F0 0F1 0F2 0F3 0F4 5F0 5B0 5W0 5F1 5B1 5W1 5F2 5B2 5W2 0B0 "
            "0W0 5F3 5B3 5W3 0B1 0W1 5F4 5B4 5W4 0B2 0W2 0B3 0W3 0B4 0W4",
            "1F0 1F1 1F2 4F0 1F3 4F1 4B0 4W0 4F2 4B1 4W1 1F4 1B0 1W0 4F3 "
            "4B2 4W2 1B1 1W1 4F4 4B3 4W3 1B2 4B4 1B3 1W2 1B4 1W3 4W4 1W4",
            "2F0 3F0 2F1 3F1 2F2 3F2 3B0 3W0 2F3 2B0 2W0 3F3 3B1 3W1 2F4 "
            "2B1 2W1 3F4 3B2 3W2 2B2 3B3 2B3 3B4 2B4 2W2 3W3 3W4 2W3 2W4",
        ]
    ),
    ("dualpipev", 3, 6, 2): "\n".join(
        [
            "0F0 0F1 0F2 0F3 0F4 5F0 5B0 5W0 5F1 5B1 5W1 5F2 0F5 5B2 5W2 5F3 0B0 0W0 "
            "5B3 5W3 5F4 0B1 0W1 5B4 5W4 5F5 0B2 0W2 5B5 5W5 0B3 0W3 0B4 0W4 0B5 0W5",
            "1F0 1F1 1F2 4F0 1F3 4F1 4B0 4W0 4F2 1F4 4B1 4W1 4F3 1B0 1W0 1F5 4B2 4W2 "
            "4F4 1B1 1W1 4B3 4W3 4F5 1B2 1W2 4B4 4W4 1B3 1W3 4B5 1B4 4W5 1B5 1W4 1W5",
            "2F0 3F0 2F1 3F1 2F2 3F2 2F3 3B0 3W0 3F3 2B0 2W0 2F4 3B1 3W1 3F4 2B1 2W1 "
            "2F5 3B2 3W2 3F5 2B2 2W2 3B3 3W3 2B3 2W3 3B4 3W4 2B4 3B5 2B5 2W4 3W5 2W5",
        ]
    ),
}


GRIDS = {**EXPECTED, **HAND_CHECKED}


@pytest.mark.parametrize("key", list(GRIDS), ids=lambda k: "-".join(map(str, k)))
def test_exact_output(key: tuple[str, int, int, int]) -> None:
    name, p, m, v = key
    s = build_schedule(name, p, m, v)
    assert s.to_text() == GRIDS[key].strip()
    assert s.name == name
    validate(s)


def _peak_held(acts: tuple[Action, ...], release: Op) -> int:
    """Most activations a rank holds along its list: +1 at each F, -1 at each `release`."""
    held = peak = 0
    for a in acts:
        held += (a.op is Op.F) - (a.op is release)
        peak = max(peak, held)
    return peak


def _chunk_ops(s: Schedule, rank: int) -> str:
    """Rank `rank`'s list with each action written as op + chunk index on that rank."""
    chunks = {stage: c for c, stage in enumerate(s.stages_of(rank))}
    return " ".join(f"{a.op.value}{chunks[a.stage]}" for a in s.actions[rank])


def _runs(*parts: tuple[str, int]) -> str:
    return " ".join(" ".join([text] * count) for text, count in parts if count > 0)


INTERLEAVED_SIZES = [(p, v, g * p) for p in (1, 2, 3, 4) for v in (2, 3, 4) for g in (1, 2, 3)]


@pytest.mark.parametrize(("p", "v", "m"), INTERLEAVED_SIZES)
def test_interleaved_closed_forms(p: int, v: int, m: int) -> None:
    """Megatron's interleaved 1F1B at many sizes: per-rank warm-up, F/B pattern, chunk order,
    peak held chunk activations and per-rank action counts, from the paper's formulas."""
    s = build_schedule("interleaved-1f1b", p, m, v)
    assert (s.num_stages, s.virtual_stages, s.splits_backward) == (v * p, v, False)
    assert s.placement == tuple(stage % p for stage in range(v * p))
    groups = [(c, g * p + i) for g in range(m // p) for c in range(v) for i in range(p)]
    back = [(c, g * p + i) for g in range(m // p) for c in reversed(range(v)) for i in range(p)]
    for r in range(p):
        acts = s.actions[r]
        assert len(acts) == 2 * v * m
        warm = min(2 * (p - r - 1) + (v - 1) * p, v * m)
        ops = "".join(a.op.value for a in acts)
        assert ops == "F" * warm + "FB" * (v * m - warm) + "B" * warm, r
        assert [(a.stage // p, a.microbatch) for a in acts if a.op is Op.F] == groups
        assert [(a.stage // p, a.microbatch) for a in acts if a.op is Op.B] == back
        assert _peak_held(acts, Op.B) == min(warm + 1, v * m)
    # Rank 0 holds the most: (v-1)p + 2(p-1) + 1 chunk activations once m is large enough.
    if v * m > (v - 1) * p + 2 * (p - 1):
        assert _peak_held(s.actions[0], Op.B) == (v - 1) * p + 2 * p - 1


@pytest.mark.parametrize(("p", "m"), [(p, m) for p in (1, 2, 3, 5) for m in (1, 2, p, 2 * p + 3)])
def test_eager_1f1b_closed_forms(p: int, m: int) -> None:
    """Eager 1F1B: rank r < p-1 runs p-r warm-up forwards (1F1B: p-r-1), the last rank none,
    then F/B pairs and the drain; peak held activations min(p-r+1, m), the last rank 1."""
    s = build_schedule("1f1b-eager", p, m)
    for r in range(p):
        warm = min(p - r if r < p - 1 else 0, m)
        ops = "".join(a.op.value for a in s.actions[r])
        assert ops == "F" * warm + "FB" * (m - warm) + "B" * warm, r
        assert [a.microbatch for a in s.actions[r] if a.op is Op.F] == list(range(m))
        assert [a.microbatch for a in s.actions[r] if a.op is Op.B] == list(range(m))
        assert _peak_held(s.actions[r], Op.B) == min(warm + 1, m)


ZBV_SIZES = [(p, m) for p in (1, 2, 3, 4, 5) for m in (2 * p - 1, 2 * p, 2 * p + 3, 4 * p + 1)]


@pytest.mark.parametrize(("p", "m"), ZBV_SIZES)
def test_zbv_closed_forms(p: int, m: int) -> None:
    """ZB-V at many sizes: V placement, the paper's phase structure per rank, microbatch order
    per stage and op, first backward, and 2p held chunk activations on every rank."""
    s = build_schedule("zbv", p, m)
    assert s.splits_backward and s.num_stages == 2 * p
    assert s.placement == tuple(list(range(p)) + list(reversed(range(p))))
    for r in range(p):
        assert s.stages_of(r) == [r, 2 * p - 1 - r]
        acts = s.actions[r]
        assert len(acts) == 6 * m
        expected = _runs(
            ("F0", 2 * (p - r) - 1),
            ("F1 F0", r),
            ("F1 B1 W1", p - r),
            ("F0 B0 W0 F1 B1 W1", m - 2 * p + r + 1),
            ("B0 W0 F1 B1 W1", p - r - 1),
            ("B0 B1", r),
            ("B0 W0", p - r),
            ("W1", r),
            ("W0", r),
        )
        assert _chunk_ops(s, r) == expected, r
        for stage in s.stages_of(r):
            for op in (Op.F, Op.B, Op.W):
                mbs = [a.microbatch for a in acts if a.stage == stage and a.op is op]
                assert mbs == list(range(m)), (r, stage, op)
        # Warm-up: 2p-r-1 chunk-0 and r+1 chunk-1 forwards, then chunk 1's backward of mb 0.
        first_b = next(i for i, a in enumerate(acts) if a.op is Op.B)
        assert first_b == 2 * p and acts[first_b] == Action(2 * p - 1 - r, Op.B, 0)
        assert _peak_held(acts, Op.W) == 2 * p


def test_registry_names() -> None:
    assert sorted(SCHEDULES) == sorted(
        ["gpipe", "1f1b", "1f1b-eager", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev"]
    )


def test_placements_and_sizes() -> None:
    inter = build_schedule("interleaved-1f1b", 4, 8, 3)
    assert inter.placement == tuple(s % 4 for s in range(12))
    assert (inter.num_stages, inter.virtual_stages, inter.splits_backward) == (12, 3, False)
    v = build_schedule("zbv", 4, 8)
    assert v.placement == (0, 1, 2, 3, 3, 2, 1, 0)
    assert v.stages_of(1) == [1, 6] and v.splits_backward
    for name in ("gpipe", "1f1b", "1f1b-eager", "zb-h1", "zb-h2"):
        s = build_schedule(name, 3, 5)
        assert s.placement == (0, 1, 2) and s.num_microbatches == 5
        assert s.splits_backward == name.startswith("zb")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("pipedream", 2, 4), "choose one of ['1f1b', '1f1b-eager', 'dualpipev', 'gpipe'"),
        (("1f1b", 0, 4), "ranks must be >= 1, got 0"),
        (("gpipe", 2, 0), "microbatches must be >= 1, got 0"),
        (("1f1b", 2, 4, 2), "got virtual_stages=2"),
        (("interleaved-1f1b", 2, 4, 1), "needs virtual_stages >= 2, got 1"),
        (("interleaved-1f1b", 4, 6, 2), "use microbatches=4 or 8"),
        (("zbv", 2, 4, 3), "got virtual_stages=3"),
        (("zbv", 4, 6), "microbatches >= 2*ranks-1 = 7 (got 6)"),
        (("dualpipev", 3, 5), "microbatches >= 2*ranks = 6 (got 5)"),
        (("dualpipev", 2, 4, 1), "got virtual_stages=1"),
    ],
)
def test_bad_sizes_say_what_is_allowed(args: tuple, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        build_schedule(*args)
    assert needle in str(info.value)


def test_non_int_sizes_are_type_errors() -> None:
    with pytest.raises(TypeError, match="microbatches must be an int, got 4.0"):
        build_schedule("1f1b", 2, 4.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_text_round_trip(name: str) -> None:
    for p, m in [(1, 2), (2, 4), (3, 9), (4, 8)]:
        v = 2 if name in ("interleaved-1f1b", "zbv", "dualpipev") else 1
        s = build_schedule(name, p, m, v)
        back = Schedule.from_text(s.to_text())
        assert back == s
        assert back.to_text() == s.to_text()


def test_each_action_exactly_once() -> None:
    s = build_schedule("zb-h2", 4, 9)
    every = [a for acts in s.actions for a in acts]
    assert len(every) == len(set(every)) == 4 * 9 * 3


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_docstring_drawing_matches_output(name: str) -> None:
    doc = SCHEDULES[name].__doc__ or ""
    match = re.search(r"p=(\d+), m=(\d+)(?:, v=(\d+))?[^\n]*::\n\n((?:        \S[^\n]*\n)+)", doc)
    assert match is not None, f"{name} has no drawing"
    p, m = int(match.group(1)), int(match.group(2))
    v = int(match.group(3)) if match.group(3) else None
    drawn = "\n".join(line.strip() for line in match.group(4).splitlines())
    assert build_schedule(name, p, m, v).to_text() == drawn
