"""Generators: exact output at small sizes, placements, size errors, text round trips."""

from __future__ import annotations

import re

import pytest

from scheduler import SCHEDULES, Schedule, build_schedule, validate

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
    ("interleaved-1f1b", 2, 4, 2): """
0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3
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
    ("zbv", 2, 4, 2): """
0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0F3 0B0 0W0 3F2 3B2 3W2 0B1 0W1 3F3 3B3 3W3 0B2 0W2 0B3 0W3
1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1F3 1B1 1W1 2F3 2B2 2W2 1B2 2B3 1B3 1W2 2W3 1W3
""",
}


@pytest.mark.parametrize("key", list(EXPECTED), ids=lambda k: k[0])
def test_exact_output(key: tuple[str, int, int, int]) -> None:
    name, p, m, v = key
    s = build_schedule(name, p, m, v)
    assert s.to_text() == EXPECTED[key].strip()
    assert s.name == name
    validate(s)


def test_registry_names() -> None:
    assert sorted(SCHEDULES) == sorted(
        ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv"]
    )


def test_placements_and_sizes() -> None:
    inter = build_schedule("interleaved-1f1b", 4, 8, 3)
    assert inter.placement == tuple(s % 4 for s in range(12))
    assert (inter.num_stages, inter.virtual_stages, inter.splits_backward) == (12, 3, False)
    v = build_schedule("zbv", 4, 8)
    assert v.placement == (0, 1, 2, 3, 3, 2, 1, 0)
    assert v.stages_of(1) == [1, 6] and v.splits_backward
    for name in ("gpipe", "1f1b", "zb-h1", "zb-h2"):
        s = build_schedule(name, 3, 5)
        assert s.placement == (0, 1, 2) and s.num_microbatches == 5
        assert s.splits_backward == name.startswith("zb")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("pipedream", 2, 4), "choose one of ['1f1b', 'gpipe', 'interleaved-1f1b'"),
        (("1f1b", 0, 4), "ranks must be >= 1, got 0"),
        (("gpipe", 2, 0), "microbatches must be >= 1, got 0"),
        (("1f1b", 2, 4, 2), "got virtual_stages=2"),
        (("interleaved-1f1b", 2, 4, 1), "needs virtual_stages >= 2, got 1"),
        (("interleaved-1f1b", 4, 6, 2), "use microbatches=4 or 8"),
        (("zbv", 2, 4, 3), "got virtual_stages=3"),
        (("zbv", 4, 6), "microbatches >= 2*ranks-1 = 7 (got 6)"),
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
    for p, m in [(1, 1), (2, 4), (3, 9), (4, 8)]:
        v = 2 if name in ("interleaved-1f1b", "zbv") else 1
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
