"""Costs under tensor parallelism (no process group): what the plan splits per unit and the
collectives the tensor-parallel pass adds (Megatron's: 2 all-reduces per block forward and 2
backward; reduce-scatters and all-gathers under sequence parallelism; the head's logits
gathered), each unit priced at its shard shapes plus its collectives, the collective fit read
back through the collective model, and the auto-planner ranking tp=1 and tp=2 layouts."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from partitioner import UnitCosts
from partitioner.tp_work import unit_work
from pipeline.planning.autoplan import search
from pipeline.planning.hardware.group_collectives import GroupCollectives, factor, fit
from pipeline.planning.tp_costs import whole, width
from tests.partitioner.test_tp_plan import Tiny, _plan


@dataclass
class Priced:
    """Collectives at a known price: `each` seconds plus 1 ns per byte; `dispatch` per op."""

    each: float = 1e-3
    dispatch: float = 2e-5

    def seconds(self, kind: str, nbytes: float, ranks: int) -> float:
        return self.each + 1e-9 * nbytes


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    plan, captured = _plan(Tiny(4, 2), 2)
    costs = {u: UnitCosts(forward=1e-3, input_grad=1e-3, weight_grad=1e-3,
                          activation_bytes=1000.0) for u in captured.order}
    return plan, captured.with_costs(costs)


@pytest.mark.slow  # one torch.export of a tiny model: 2-7 s here
def test_blocks_split_and_their_collectives(tiny) -> None:  # type: ignore[no-untyped-def]
    plan, captured = tiny
    work = unit_work(captured, plan)
    for block in ("blocks_0", "blocks_1"):
        kinds = sorted((c.phase, c.kind) for c in work[block].collectives)
        assert kinds == [("backward", "all_reduce")] * 2 + [("forward", "all_reduce")] * 2
        assert 0.5 < work[block].share < 1.0 and work[block].ops > 10
    assert [(c.phase, c.kind) for c in work["tok"].collectives] == [("forward", "all_reduce")]
    assert sorted((c.phase, c.kind) for c in work["head"].collectives) == [
        ("backward", "all_reduce"), ("forward", "all_gather")]
    assert work["norm"].collectives == () and work["norm"].share == 0.0
    sp = unit_work(captured, plan, sequence_parallel=True)["blocks_0"].collectives
    assert sorted((c.phase, c.kind) for c in sp) == [
        ("backward", "all_gather")] * 2 + [("backward", "reduce_scatter")] * 2 + [
        ("forward", "all_gather")] * 2 + [("forward", "reduce_scatter")] * 2


@pytest.mark.slow  # one torch.export of a tiny model: 2-7 s here
def test_units_at_shard_shapes_plus_collectives(tiny) -> None:  # type: ignore[no-untyped-def]
    plan, captured = tiny
    priced = Priced()
    w = width(captured, 2, priced)
    work = unit_work(captured, plan)["blocks_0"]
    k = 1 - work.share / 2
    fwd = sum(priced.seconds(c.kind, c.bytes, 2) for c in work.collectives
              if c.phase == "forward")
    got = w.captured.costs["blocks_0"]
    assert got.forward == pytest.approx(1e-3 * k + fwd + priced.dispatch * work.ops)
    assert got.input_grad + got.weight_grad == pytest.approx(
        2e-3 * k + fwd + priced.dispatch * work.ops)  # two backward all-reduces, same bytes
    assert got.activation_bytes < 1000.0
    assert w.captured.costs["norm"].forward == pytest.approx(1e-3 + priced.dispatch)
    one, two = whole(captured).stage_costs(2), w.stage_costs(2)
    assert sum(two.param_bytes) < 0.7 * sum(one.param_bytes)  # norms, positions stay whole
    assert "4 all_reduce (forward)" in w.describe() or "all_reduce (forward)" in w.describe()


def test_collective_fit_reads_back_through_the_model() -> None:
    for kind, n in (("all_reduce", 2), ("all_gather", 4), ("reduce_scatter", 4)):
        latency, busbw = 3e-4, 2e9
        points = [(b, latency + b * factor(kind, n) / busbw) for b in (4096.0, 65536.0, 2**20)]
        found = fit(points, kind, n)
        assert found.latency == pytest.approx(latency) and found.busbw == pytest.approx(busbw)
        model = GroupCollectives({kind: {n: found}})
        assert model.seconds(kind, 1e6, n) == pytest.approx(latency + 1e6 * factor(kind, n)
                                                             / busbw)
        assert GroupCollectives.from_dict(model.to_dict()) == model
    with pytest.raises(ValueError, match="no all_gather measured on 8 ranks"):
        GroupCollectives({"all_gather": {}}).seconds("all_gather", 10, 8)


@pytest.mark.slow  # one torch.export of a tiny model: 2-7 s here
def test_auto_planner_ranks_tp1_and_tp2(tiny) -> None:  # type: ignore[no-untyped-def]
    _, captured = tiny
    free = Priced(each=0.0, dispatch=0.0)
    ranking = search(captured, world_size=4, batch_size=8, profiled_batch=2, keep=3,
                     schedules=["1f1b"], widths=[whole(captured), width(captured, 2, free)])
    assert {c.tp for c in ranking.candidates} == {1, 2}  # the best of each degree kept
    assert all(c.tp * c.pp * c.dp == 4 for c in ranking.candidates)
    steps = [c.step_time for c in ranking.candidates]
    assert steps == sorted(steps)
    assert "best at tp=" in ranking.why() and "chosen tp=" in ranking.table()
    dear = Priced(each=1.0)  # a second per collective: every tp=2 layout is slower
    costly = search(captured, world_size=4, batch_size=8, profiled_batch=2, keep=3,
                    schedules=["1f1b"], widths=[whole(captured), width(captured, 2, dear)])
    assert costly.best.tp == 1 and {c.tp for c in costly.candidates} == {1, 2}
    at = {c.tp: c for c in costly.candidates}
    assert at[2].step_time > 1.0 and f"best at tp=2: {at[2].label()}" in costly.why()
    with pytest.raises(ValueError, match="must divide world_size=4"):
        search(captured, world_size=4, batch_size=8, profiled_batch=2,
               widths=[width(captured, 3, free)])
