"""Re-balancing a running distributed job (Planner.replan, Executor.adopt): one pipeline rank
is made slower on purpose (it sleeps in every nn.Linear call, in the worker only), the job
re-plans from what the ranks measured, moves the units whose rank changed with their gradients
and Adam state, and keeps training exactly as the unsplit model does (float64: every loss and,
at the end, every weight). On demand after balance="parameters" (nothing profiled up front)
each rank measures its own units. A rank that fails during the move ends every process with an
error naming it, each still on the old plan.

This file is also the worker: ``python <this file> parts OUT_DIR`` (run by `launch`)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.support.distributed import (
    ATOL,
    Checker,
    Ended,
    all_ok,
    dump,
    init_worker,
    launch,
    replica_slice,
)
from tests.support.models import global_batch, lm_loss, make_model

# ---------------------------------------------------------------------------------------------
# Workers (run in the launched processes)
# ---------------------------------------------------------------------------------------------

SLEEP = 0.002  # seconds per nn.Linear call on the slow rank: it runs at a fraction of the speed


def _tied_model() -> nn.Module:
    model = make_model()
    model.head.weight = model.tok.weight  # type: ignore[union-attr]  # tied across the ends
    return model


def _slow_down(model: nn.Module, slow: bool) -> None:
    """Sleep in every nn.Linear call of this process when it is the slow one."""
    if not slow:
        return
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda *_: time.sleep(SLEEP))


def _run(pp: int, schedule: str, *, auto: bool, steps: int = 6, dp: int = 1,
         shard: str | None = None, resynthesize_at: int | None = None,
         optimizer: type[torch.optim.Optimizer] = torch.optim.Adam) -> tuple[Any, list[int]]:
    """Adam on the pipeline and the unsplit model; losses compared at every step, weights at
    the end; the last pipeline rank is the slow one. `auto`: rebalance=True from a plan
    balanced by parameters, else pipe.rebalance() after the third step of a profiled plan
    (which the slow rank makes wrong). With `dp` replicas, each steps on its slice of the
    batch and pipeline rank pp - 1 of every replica is slow; `shard`: the Pipeline's (its
    optimizer made by pipe.optimizer after the first step). `resynthesize_at`: after that
    step, switch to a schedule synthesised from the measured costs (threshold -1: whatever
    it predicts). `optimizer`: the class both sides train with (lr 0.01).
    Returns the Pipeline and its first plan's sizes."""
    import torch.distributed as dist

    from pipeline import Pipeline
    from pipeline.checkpoint import gather_named

    ref = _tied_model()
    model = _tied_model()
    _slow_down(model, dist.get_rank() % pp == pp - 1)
    pipe = Pipeline(model, stages=pp, data_parallel=dp, schedule=schedule, microbatches=4,
                    loss_fn=lm_loss, shard=shard,
                    balance="parameters" if auto else "profile", capture_method="fx",
                    rebalance=auto)
    opt = None if shard else optimizer(pipe.parameters(), lr=0.01)
    ref_opt = optimizer(ref.parameters(), lr=0.01)
    first: list[int] = []
    for step in range(steps):
        x, y = global_batch(step, 8 * dp)
        ref_opt.zero_grad()
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        pipe.zero_grad()
        d = dist.get_rank() // pp
        loss = pipe.step(replica_slice(x, d, dp), replica_slice(y, d, dp))
        first = first or pipe.plan.sizes
        if step == 2 and not auto:
            pipe.rebalance()
        if step == resynthesize_at:
            assert pipe.resynthesize(threshold=-1.0).applied
            assert pipe.schedule.name == "synth", pipe.schedule
        opt = opt or pipe.optimizer(optimizer, lr=0.01)
        opt.step()
        torch.testing.assert_close(loss.double(), ref_loss.detach(), atol=ATOL, rtol=0,
                                   msg=f"{schedule} pp={pp}: loss of step {step}")
    weights = gather_named({k: p.detach() for k, p in pipe.named_parameters()}, pipe.distributed)
    if weights is not None:
        for k, p in ref.named_parameters():
            torch.testing.assert_close(weights[k], p.detach(), atol=ATOL, rtol=0,
                                       msg=f"{schedule} pp={pp}: weight {k}")
    report = pipe.rebalanced
    print(f"rank {dist.get_rank()}: {report}", flush=True)
    assert report is not None and report.applied, report
    assert report.before == first and report.after == pipe.plan.sizes, (report, pipe.plan)
    assert (pipe.resynthesized is not None) == (resynthesize_at is not None)
    assert report.after[-1] < report.before[-1], f"the slow rank kept its work: {report}"
    return pipe, first


def part_adam_1f1b() -> None:
    """pp=2, 1F1B, rebalance=True: re-balanced after the third step's backward (its grads
    and the Adam state move), then trained on; after the fifth step the schedule is
    re-synthesised from the measured costs (a split-backward schedule of the same ranks)."""
    _run(2, "1f1b", auto=True, steps=8, resynthesize_at=4)


def part_dp2() -> None:
    """pp=2 x dp=2, 1F1B, shard="optimizer" (ZeRO-1), rebalance=True: every replica moves its
    own units (the slowest replica's times count); the Adam state, kept by each parameter's
    owning replica, is gathered, moved and partitioned anew over the new parameters."""
    _run(2, "1f1b", auto=True, dp=2, shard="optimizer")


def part_fsdp() -> None:
    """pp=2 x dp=2, 1F1B, shard="full" (FSDP2), AdamW, pipe.rebalance() after the third
    step's backward: the moved units' parameters, gradients and AdamW moments (dim-0 shards
    over the replicas) are gathered whole, moved, and sharded anew with the new stages."""
    _run(2, "1f1b", auto=False, dp=2, shard="full", optimizer=torch.optim.AdamW)


def part_zb_pp4() -> None:
    """pp=4, zb-h1 (split backward), pipe.rebalance() between two steps."""
    _run(4, "zb-h1", auto=False)


def part_on_demand() -> None:
    """pp=2, balance="parameters" (nothing profiled up front), pipeline rank 1 slow: after
    three steps, pipe.rebalance() on demand has each rank measure its own units and the
    leader re-partition with everyone's figures; the step after gives the unsplit model's
    loss and every gradient."""
    import torch.distributed as dist

    checker = Checker(2, "1f1b")
    pipe = checker.pipe
    _slow_down(pipe.module, dist.get_rank() == 1)
    for step in range(3):
        checker.step_and_compare(step)
    before = pipe.plan.sizes
    report = pipe.rebalance()
    print(f"rank {dist.get_rank()}: {report}", flush=True)
    assert report is pipe.rebalanced and report.before == before, (report, before)
    assert report.predicted_before > 0 and report.predicted_after > 0, report
    assert len(report.measured) == 2 and min(report.measured) > 0, report  # every stage's
    assert report.measured[1] > report.measured[0], report  # the slow rank's stage
    assert "applied" in str(report) and "measured" in str(report) and report.applied, report
    assert report.after == pipe.plan.sizes and report.after[-1] < before[-1], (report, before)
    checker.step_and_compare(3)


def part_fsdp_unmeasured() -> None:
    """pp=2 x dp=2, shard="full", balance="parameters": pipe.rebalance() on demand cannot time
    sharded units; every process raises the same ValueError naming the fix, on the old plan."""
    from pipeline import Pipeline

    pipe = Pipeline(_tied_model(), stages=2, data_parallel=2, schedule="1f1b", microbatches=4,
                    loss_fn=lm_loss, shard="full", balance="parameters", capture_method="fx")
    for step in range(3):
        x, y = global_batch(step, 8)
        pipe.step(x, y)
    sizes = pipe.plan.sizes
    with pytest.raises(ValueError, match="balance='profile' or\\s+rebalance=True"):
        pipe.rebalance()
    assert pipe.plan.sizes == sizes and pipe.rebalanced is None


def part_fail_move() -> None:
    """Pipeline rank 1 raises while the units move: every process raises (rank 0 a
    RankFailure naming rank 1) and keeps the old plan."""
    import torch.distributed as dist

    from pipeline import Pipeline
    from pipeline.execution.distributed import RankFailure, moves

    rank = dist.get_rank()
    model = _tied_model()
    _slow_down(model, rank == 1)
    pipe = Pipeline(model, stages=2, schedule="1f1b", microbatches=4, loss_fn=lm_loss,
                    balance="parameters", capture_method="fx", rebalance=True)
    if rank == 1:
        def broken(self: Any) -> Any:
            raise RuntimeError("injected failure in the move")
        moves.UnitMove.receive = broken  # type: ignore[method-assign]
    sizes: list[int] = []
    try:
        for step in range(4):
            x, y = global_batch(step, 8)
            pipe.step(x, y)
            sizes = sizes or pipe.plan.sizes
    except RankFailure as err:
        assert rank == 0 and "rank 1" in str(err), err
    except RuntimeError as err:
        assert rank == 1 and "injected" in str(err), err
    else:
        raise AssertionError("the move's failure was not raised")
    assert pipe.plan.sizes == sizes and pipe.rebalanced is None, (pipe.plan.sizes, sizes)


# One launch per world size runs its parts in turn (a process start with torch costs seconds
# here); each part prints its marker when its checks passed. The failing move comes last.
PARTS: dict[int, dict[str, Callable[[], None]]] = {
    2: {"adam_1f1b": part_adam_1f1b, "on_demand": part_on_demand, "fail_move": part_fail_move},
    4: {"zb_pp4": part_zb_pp4, "dp2": part_dp2, "fsdp": part_fsdp,
        "fsdp_unmeasured": part_fsdp_unmeasured},
}


def worker_parts(out: Path) -> None:
    import torch.distributed as dist

    init_worker()
    for name, part in PARTS[dist.get_world_size()].items():
        part()
        print(f"worker {name}: every check ran", flush=True)


WORKERS: dict[str, Callable[[Path], None]] = {"parts": worker_parts}

# ---------------------------------------------------------------------------------------------
# Tests (run in pytest)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[Ended]]:
    """The launches, made on first use: world size -> how its processes ended."""
    return {}


def _part_ran(runs: dict[int, list[Ended]], world: int, name: str,
              tmp_path_factory: pytest.TempPathFactory) -> None:
    if world not in runs:
        runs[world] = launch("parts", world, tmp_path_factory.mktemp(f"world{world}"),
                             script=__file__, timeout=20, deadline=280)
    ended = runs[world]
    assert all(f"worker {name}: every check ran" in e.output for e in ended), dump(ended)
    if name == list(PARTS[world])[-1]:
        all_ok(ended, name)  # and every process exited cleanly


@pytest.mark.slow
@pytest.mark.parametrize(("worker", "world"), [("adam_1f1b", 2), ("zb_pp4", 4),
                                                        ("dp2", 4), ("fsdp", 4)])
def test_rebalance_moves_units_and_trains_exactly(
    runs: dict[int, list[Ended]], tmp_path_factory: pytest.TempPathFactory, worker: str,
    world: int,
) -> None:
    _part_ran(runs, world, worker, tmp_path_factory)


@pytest.mark.slow
def test_rebalance_on_demand_after_balance_by_parameters(
    runs: dict[int, list[Ended]], tmp_path_factory: pytest.TempPathFactory,
) -> None:
    _part_ran(runs, 2, "on_demand", tmp_path_factory)


@pytest.mark.slow
def test_rebalance_on_demand_cannot_time_sharded_units(
    runs: dict[int, list[Ended]], tmp_path_factory: pytest.TempPathFactory,
) -> None:
    _part_ran(runs, 4, "fsdp_unmeasured", tmp_path_factory)


@pytest.mark.slow
def test_failure_during_the_move_keeps_the_old_plan(
    runs: dict[int, list[Ended]], tmp_path_factory: pytest.TempPathFactory,
) -> None:
    _part_ran(runs, 2, "fail_move", tmp_path_factory)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    WORKERS[sys.argv[1]](Path(sys.argv[2]))
