"""Tests on several processes: a launcher that starts a test file's workers the way torchrun
does (a store hosted by the launcher, RANK/WORLD_SIZE/MASTER_* in the environment; CPU, gloo, 1
thread each) and checks how they ended, and what the workers share (process-group start, each
replica's slice of the batch, a step-by-step comparison with the single-process model).

A test file that launches workers is also the worker script: ``python FILE WORKER OUT_DIR``."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.support import ROOT
from tests.support.models import SEQ, global_batch, lm_loss, make_model

ATOL = 1e-10
BATCH = 8  # rows per replica


# ---------------------------------------------------------------------------------------------
# Launcher (runs in pytest)
# ---------------------------------------------------------------------------------------------


@dataclass
class Ended:
    rank: int
    returncode: int
    output: str


def launch(worker: str, world: int, out: Path, *, timeout: float = 30.0,
           deadline: float = 150.0, hangs: int | None = None,
           script: str) -> list[Ended]:
    """Run `worker` of `script` (a test file that is also the worker) on `world` processes like
    torchrun does and wait for all of them; a process still alive at `deadline` seconds is
    killed and fails the test (nothing is left behind), except rank `hangs` (a deliberately hung
    rank), which is killed once the others ended."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world, True,
                          timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    procs, logs = [], []
    for rank in range(world):
        env = dict(
            os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
            TORCHELASTIC_USE_AGENT_STORE="True", HYBRIDPIPE_TIMEOUT=str(timeout),
            OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
        )
        log = open(out / f"rank{rank}.log", "w+")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, script, worker, str(out)], env=env, stdout=log,
            stderr=subprocess.STDOUT, cwd=ROOT,
        ))
    end = time.monotonic() + deadline
    hung = []
    for rank, proc in enumerate(procs):
        if rank == hangs:
            continue
        try:
            proc.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung.append(rank)
            proc.kill()
            proc.wait(10)
    if hangs is not None:
        procs[hangs].kill()
        procs[hangs].wait(10)
    ended = []
    for rank, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        log.seek(0)
        ended.append(Ended(rank, proc.returncode, log.read()))
        log.close()
    assert not hung, f"ranks {hung} did not end within {deadline} s:\n" + dump(ended)
    return ended


def dump(ended: list[Ended]) -> str:
    return "\n".join(f"--- rank {e.rank} (exit {e.returncode}) ---\n{e.output[-3000:]}"
                     for e in ended)


def all_ok(ended: list[Ended], worker: str) -> None:
    assert all(e.returncode == 0 for e in ended), dump(ended)
    assert all(f"worker {worker}: every check ran" in e.output for e in ended), dump(ended)


# ---------------------------------------------------------------------------------------------
# Shared by the workers (run in the launched processes)
# ---------------------------------------------------------------------------------------------


def replica_slice(t: torch.Tensor, dp_rank: int, dp: int) -> torch.Tensor:
    n = t.shape[0] // dp
    return t[dp_rank * n : (dp_rank + 1) * n]


class Checker:
    """Compares a distributed Pipeline with the single-process model, step by step."""

    def __init__(self, pp: int, schedule: str, **options: Any) -> None:
        from pipeline import Pipeline

        self.ref = make_model()
        # fx capture (0.1 s, export ~2 s a process): these check the executor, whose stages are
        # the same either way; test_distributed_real.py runs every schedule on export.
        self.pipe = Pipeline(make_model(), stages=pp, schedule=schedule, microbatches=4,
                             loss_fn=lm_loss, balance="parameters", capture_method="fx",
                             **options)
        self.ctx = self.pipe.distributed
        assert self.ctx is not None
        self.dp, self.d = self.ctx.layout.data_parallel, self.ctx.layout.dp_rank
        self.label = f"pp={pp} dp={self.dp} {schedule} {options or ''}"

    def step_and_compare(self, step: int, rows: int | None = None, seq: int = SEQ) -> float:
        from pipeline.checkpoint import gather_named

        x, y = global_batch(step, rows or BATCH * self.dp, seq)
        self.ref.zero_grad()
        ref_loss = lm_loss(self.ref(x), y)
        ref_loss.backward()
        self.pipe.zero_grad()
        loss = self.pipe.step(replica_slice(x, self.d, self.dp), replica_slice(y, self.d, self.dp))
        torch.testing.assert_close(loss.double(), ref_loss.detach(), atol=ATOL, rtol=0,
                                   msg=f"{self.label}: loss of step {step}")
        grads = gather_named({k: p.grad for k, p in self.pipe.named_parameters()}, self.ctx)
        if grads is not None:
            ref = dict(self.ref.named_parameters())
            assert sorted(grads) == sorted(ref), f"{self.label}: gathered {sorted(grads)}"
            for k, g in grads.items():
                assert g is not None, f"{self.label}: {k} has no grad"
                torch.testing.assert_close(g, ref[k].grad, atol=ATOL, rtol=0,
                                           msg=f"{self.label}: grad of {k}")
        return float(loss)

    def train(self, steps: int) -> None:
        """`steps` SGD steps on both; the loss curves must agree."""
        opt = torch.optim.SGD(self.pipe.parameters(), lr=0.5, momentum=0.9)
        ref_opt = torch.optim.SGD(self.ref.parameters(), lr=0.5, momentum=0.9)
        for step in range(steps):
            self.step_and_compare(step)
            opt.step()
            ref_opt.step()


def init_worker() -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
