"""Planning as one phase: `Planner.plan` returns a frozen `Decision` and leaves the planner as
it was; a capture surveyed before the layout was known (stages="auto") is reused only when the
first microbatch has its shapes; a batch is split once into `Microbatches`."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._pytree import tree_flatten

from pipeline.planning.decision import Coordination, Decision, Surveyed, decide_alone
from pipeline.planning.microbatch import Microbatches
from pipeline.planning.planner import Planner
from pipeline.planning.settings import PipelineSettings
from tests.support.models import make_model, token_batch

HERE = Coordination(True, decide_alone, torch.device("cpu"), keeps_whole_model=True)


def _planner(microbatches: int | None = None, surveyed: Surveyed | None = None) -> Planner:
    settings = PipelineSettings(2, schedule="1f1b", microbatches=microbatches,
                                capture_method="fx")
    return Planner(make_model(), settings, surveyed=surveyed)


def _flat(rows: int) -> tuple[tuple[torch.Tensor, ...], object]:
    leaves, spec = tree_flatten(((token_batch(0, rows)[0],), {}))
    return tuple(leaves), spec


def test_plan_returns_a_frozen_decision_and_leaves_the_planner_unchanged() -> None:
    planner = _planner()
    before = dict(vars(planner))
    args, spec = _flat(8)
    decision = planner.plan(args, spec, HERE)
    assert vars(planner) == before
    assert isinstance(decision, Decision) and decision.microbatches == 4  # 2 x stages
    assert decision.costs is not None and len(decision.modules) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.plan = decision.plan  # type: ignore[misc]
    rebalanced = decision.repartitioned(decision.plan)
    assert rebalanced is not decision and rebalanced.costs is None
    assert decision.costs is not None  # the old decision is as it was


def test_surveyed_capture_is_reused_only_for_the_same_shapes() -> None:
    args, spec = _flat(8)
    surveyed = _planner().survey(args, spec, HERE)  # microbatch of min(2 x 2, 8) = 4 rows
    same = _planner(surveyed=surveyed).plan(args, spec, HERE)
    assert same.captured is surveyed.captured
    other = _planner(surveyed=surveyed, microbatches=2).plan(args, spec, HERE)
    assert other.captured is not surveyed.captured  # 4-row microbatches: captured anew
    assert len(other.example[0]) == 4 and len(same.example[0]) == 2


def test_microbatches_split_once_with_sizes_and_loss_weights() -> None:
    split = Microbatches.split((torch.arange(7.0),), 3)
    assert split.sizes == (3, 2, 2) and split.count == 3 and split.rows == 7
    assert split.loss_weights() == pytest.approx([3 / 7, 2 / 7, 2 / 7])
    assert [p[0].tolist() for p in split.parts] == [[0, 1, 2], [3, 4], [5, 6]]
    with pytest.raises(ValueError, match="smaller than the microbatch count 8"):
        Microbatches.split((torch.arange(7.0),), 8)
