"""Validator: each kind of bad schedule is rejected with the grid and the offending step marked."""

from __future__ import annotations

import pytest

from scheduler import Action, Op, Schedule, build_schedule, validate
from scheduler.validate import dependencies, format_grid


def _error(text: str) -> str:
    with pytest.raises(ValueError) as info:
        validate(Schedule.from_text(text))
    return str(info.value)


def test_cross_rank_deadlock_message_is_exact() -> None:
    message = _error("0F0 0B0 0F1 0B1\n1F1 1B1 1F0 1B0")
    assert message == (
        "schedule 'custom' (2 ranks, 2 stages, 2 microbatches) is invalid: deadlock, the ranks'"
        " orders can never all finish:\n"
        "  rank 0 step 1: 0B0 waits for 1B0 from rank 1 step 3, but rank 1 is itself blocked"
        " at step 0\n"
        "  rank 1 step 0: 1F1 waits for 0F1 from rank 0 step 2, but rank 0 is itself blocked"
        " at step 1\n"
        "reorder so every action comes after what it needs\n"
        "step     0    1    2    3\n"
        "rank 0  0F0 >0B0< 0F1  0B1\n"
        "rank 1 >1F1< 1B1  1F0  1B0"
    )


def test_backward_before_its_forward_on_one_rank() -> None:
    message = _error("0B0 0F0\n1F0 1B0")
    assert "rank 0 step 0: 0B0 needs 0F0, which rank 0 only runs later, at step 1" in message
    assert "rank 0 >0B0< 0F0" in message


def test_weight_before_its_backward() -> None:
    message = _error("0F0 0W0 0B0\n1F0 1B0 1W0")
    assert "0W0 needs 0B0, which rank 0 only runs later, at step 2" in message


def test_forward_before_previous_stage_forward() -> None:
    # Stage 1 waits for microbatch 1 that rank 0 only sends after a backward needing rank 1.
    message = _error("0F0 0B0 0F1 0B1\n1F1 1F0 1B0 1B1")
    assert "rank 1 step 0: 1F1 waits for 0F1 from rank 0 step 2" in message


def test_missing_and_repeated_actions() -> None:
    assert "1 actions missing: 1B1; add each on its stage's rank" in _error(
        "0F0 0F1 0B0 0B1\n1F0 1B0 1F1"
    )
    message = _error("0F0 0F0 0B0\n1F0 1B0")
    assert "rank 0 step 1: 0F0 is repeated (first at rank 0 step 0)" in message
    assert "rank 0 >0F0<>0F0< 0B0" in message


def test_action_on_the_wrong_rank() -> None:
    good = build_schedule("1f1b", 2, 2)
    moved = Schedule(
        num_ranks=2,
        num_stages=2,
        num_microbatches=2,
        placement=good.placement,
        actions=(good.actions[0] + (Action(1, Op.F, 1),), good.actions[1][:-1]),
        splits_backward=False,
    )
    with pytest.raises(ValueError, match="1F1 belongs to stage 1, which is placed on rank 1"):
        validate(moved)


def test_weight_in_unsplit_schedule_and_out_of_range() -> None:
    base = build_schedule("gpipe", 2, 1)
    with_w = Schedule(
        2,
        2,
        1,
        (0, 1),
        (base.actions[0] + (Action(0, Op.W, 0),), base.actions[1]),
        splits_backward=False,
    )
    with pytest.raises(ValueError, match="0W0 is a W but this schedule does not split backward"):
        validate(with_w)
    far = Schedule(
        2,
        2,
        1,
        (0, 1),
        (base.actions[0] + (Action(0, Op.F, 5),), base.actions[1]),
        splits_backward=False,
    )
    with pytest.raises(ValueError, match=r"0F5 is out of range \(stages 0..1, microbatches 0..0\)"):
        validate(far)


def test_dependencies() -> None:
    assert dependencies(Action(0, Op.F, 3), 4) == []
    assert dependencies(Action(2, Op.F, 3), 4) == [Action(1, Op.F, 3)]
    assert dependencies(Action(3, Op.B, 1), 4) == [Action(3, Op.F, 1)]
    assert dependencies(Action(1, Op.B, 1), 4) == [Action(1, Op.F, 1), Action(2, Op.B, 1)]
    assert dependencies(Action(1, Op.W, 1), 4) == [Action(1, Op.B, 1)]


def test_wide_grid_is_windowed_around_the_mark() -> None:
    s = build_schedule("gpipe", 2, 40)
    grid = format_grid(s, {(1, 60): "x"})
    assert grid.splitlines()[-1] == "(steps 52..68 of 80 shown)"
    assert ">1B20<" in grid and "0F0" not in grid


def test_valid_custom_schedule_passes() -> None:
    validate(Schedule.from_text("# hand-written 1F1B\n0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1"))
