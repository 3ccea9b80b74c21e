"""Which tensors a re-balance moves (pipeline.execution.distributed.moves.plan_moves): a
tensor a pipeline rank newly holds comes from the lowest rank that held it; a rank drops what
it no longer holds; tied tensors held on both ends stay. One process, no communication."""

from __future__ import annotations

import pytest

from pipeline.execution.distributed.moves import plan_moves


def test_moves_from_the_lowest_holder_and_drops() -> None:
    before = {"a": {0}, "b": {0}, "c": {1}, "tied": {0, 1}, "shared": {0, 1}}
    after = {"a": {0}, "b": {1}, "c": {2}, "tied": {0, 1}, "shared": {0, 1, 2}}
    zero, one, two = (plan_moves(before, after, me) for me in range(3))
    assert zero.sends == {1: ["b"], 2: ["shared"]} and zero.receives == {}
    assert zero.drops == ["b"]
    assert one.sends == {2: ["c"]} and one.receives == {0: ["b"]} and one.drops == ["c"]
    assert two.receives == {0: ["shared"], 1: ["c"]} and two.sends == {} and two.drops == []
    assert zero.moved == one.moved == two.moved == 3


def test_a_tensor_no_rank_held_is_an_error() -> None:
    with pytest.raises(ValueError, match="held by no pipeline rank"):
        plan_moves({}, {"a": {1}}, 0)
