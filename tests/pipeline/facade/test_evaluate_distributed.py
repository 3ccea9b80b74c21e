"""Train and evaluate under torchrun (pp=2 x dp=2, gloo, 4 processes): train steps interleaved
with evaluations in eval mode (pipe.eval() / pipe.train(), the eval graph captured by every
process on a fake stand-in after the other stages' weights were freed) give exactly the losses
and weights of the unsplit model doing the same (float64, BatchNorm, export capture; 1f1b,
interleaved-1f1b and zbv); with dropout, an evaluation after training equals the unsplit
model's eval() loss on the gathered weights (also with shard="full": the stages' code switches
under FSDP2); the metrics count every replica's samples; each replica's sampler deals the data
as DistributedSampler over the replicas.

This file is also the worker: ``python FILE parts OUT_DIR``."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DistributedSampler, TensorDataset

from tests.support.distributed import Ended, all_ok, dump, init_worker, launch, replica_slice
from tests.support.models import bn_batch, bn_model, microbatched_loss

M = 4  # microbatches per replica


def _reference_step(ref: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, dp: int) -> float:
    """The unsplit model doing what dp replicas do: each replica's microbatched loss and grads
    on its slice, the grads and losses averaged, replica 0's BatchNorm statistics kept."""
    losses, grads, replica0 = [], [], None
    for d in range(dp):
        copy_d = copy.deepcopy(ref)
        losses.append(microbatched_loss(copy_d, replica_slice(x, d, dp),
                                        replica_slice(y, d, dp), M, backward=True))
        grads.append([p.grad for p in copy_d.parameters()])
        if d == 0:
            replica0 = copy_d
    assert replica0 is not None
    for p, *gs in zip(ref.parameters(), *grads, strict=True):
        p.grad = torch.stack(gs).mean(0)
    for b, b0 in zip(ref.buffers(), replica0.buffers(), strict=True):
        b.copy_(b0)
    return float(torch.stack(losses).mean())


def _reference_eval(ref: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, dp: int) -> float:
    """The mean over replicas of the unsplit model's eval() loss on each replica's slice."""
    ref.eval()
    with torch.no_grad():
        loss = torch.stack([F.cross_entropy(ref(replica_slice(x, d, dp)), replica_slice(y, d, dp))
                            for d in range(dp)]).mean()
    ref.train()
    return float(loss)


def _part_train_eval() -> None:
    for schedule in ("1f1b", "interleaved-1f1b", "zbv"):
        _train_eval(schedule)


def _train_eval(schedule: str) -> None:
    from pipeline import Pipeline

    model, ref = bn_model(), bn_model()
    pipe = Pipeline(model, stages=2, schedule=schedule, microbatches=M,
                    loss_fn=F.cross_entropy)
    ctx = pipe.distributed
    assert ctx is not None
    dp, d = ctx.layout.data_parallel, ctx.layout.dp_rank
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):
        x, y = bn_batch(step, rows=8 * dp)
        loss = pipe.step(replica_slice(x, d, dp), replica_slice(y, d, dp))
        expected = _reference_step(ref, x, y, dp)
        assert abs(float(loss) - expected) < 1e-12, (schedule, step, float(loss), expected)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        if step % 2 == 1:
            vx, vy = bn_batch(100 + step, rows=4 * dp)
            pipe.eval()
            got = float(pipe.evaluate(replica_slice(vx, d, dp), replica_slice(vy, d, dp)))
            pipe.train()
            expected = _reference_eval(ref, vx, vy, dp)
            assert abs(got - expected) < 1e-12, (schedule, step, got, expected)
    state = pipe.state_dict()
    if state is not None:  # global rank 0 gathers the whole model
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(state[name], value, atol=1e-12, rtol=0, msg=name)
    figures = pipe.metrics
    assert figures is not None and figures.samples == 8 * dp and figures.devices == 4
    data = TensorDataset(torch.arange(21))
    assert list(pipe.replica_sampler(data, seed=3)) == list(
        DistributedSampler(data, num_replicas=dp, rank=d, seed=3))


def _part_dropout(shard: str | None = None) -> None:
    from pipeline import Pipeline

    model, ref = bn_model(dropout=0.3), bn_model(dropout=0.3)
    pipe = Pipeline(model, stages=2, microbatches=M, loss_fn=F.cross_entropy, shard=shard,
                    example_input=bn_batch(0)[0])
    ctx = pipe.distributed
    assert ctx is not None
    dp, d = ctx.layout.data_parallel, ctx.layout.dp_rank
    opt = pipe.optimizer(torch.optim.SGD, lr=0.1)
    for step in range(2):
        x, y = bn_batch(step, rows=8 * dp)
        pipe.step(replica_slice(x, d, dp), replica_slice(y, d, dp))
        opt.step()
        opt.zero_grad()
    vx, vy = bn_batch(50, rows=4 * dp)
    model.eval()  # the wrapped model's own switch
    got = float(pipe.evaluate(replica_slice(vx, d, dp), replica_slice(vy, d, dp)))
    model.train()
    state = pipe.state_dict()
    if state is not None:
        ref.load_state_dict(state)
        expected = _reference_eval(ref, vx, vy, dp)
        assert abs(got - expected) < 1e-12, (got, expected)


PARTS: dict[str, Callable[[], None]] = {
    "dropout": _part_dropout,
    "dropout_full": lambda: _part_dropout(shard="full"),
    "train_eval": _part_train_eval,
}


def worker_parts(out: Path) -> None:
    """Every part in turn in one launch (a process start with torch costs seconds here), each
    printing its marker when its checks passed."""
    init_worker()
    for name, part in PARTS.items():
        part()
        print(f"worker {name}: every check ran", flush=True)


WORKERS = {"parts": worker_parts}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> list[Ended]:
    return launch("parts", 4, tmp_path_factory.mktemp("parts"), timeout=60.0, deadline=290.0,
                  script=__file__)


@pytest.mark.slow
@pytest.mark.parametrize("worker", list(PARTS))
def test_train_and_evaluate_pp2_dp2(worker: str, run: list[Ended]) -> None:
    assert all(f"worker {worker}: every check ran" in e.output for e in run), dump(run)
    if worker == list(PARTS)[-1]:
        all_ok(run, worker)  # and every process exited cleanly


if __name__ == "__main__":
    WORKERS[sys.argv[1]](Path(sys.argv[2]))
