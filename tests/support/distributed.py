"""Tests on several processes: a launcher that starts a test file's workers the way torchrun
does (a store hosted by the launcher, RANK/WORLD_SIZE/MASTER_* in the environment; CPU, gloo, 1
thread each; forked from a server that imported torch once) and checks how they ended, and
what the workers share (process-group start, each replica's slice of the batch, a step-by-step
comparison with the single-process model).

A test file that launches workers is also the worker script: ``python FILE WORKER OUT_DIR``."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import select
import signal
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
# For `launch(preload=...)` where the workers build Hugging Face models: the first modeling
# module a process imports costs seconds (transformers' shared machinery), the others little.
HF_MODULES = ("transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
              "transformers.models.t5.modeling_t5", "transformers.models.albert.modeling_albert")


# ---------------------------------------------------------------------------------------------
# Launcher (runs in pytest)
# ---------------------------------------------------------------------------------------------


@dataclass
class Ended:
    rank: int
    returncode: int
    output: str


_SERVER: list[subprocess.Popen[str]] = []  # this session's tests.support.forked server


def start_server() -> None:
    """Start the session's fork server now (it imports in the background) rather than at the
    first launch."""
    _server()


def _server() -> subprocess.Popen[str]:
    """The session's fork server, started on first use; it ends with the session (its stdin
    closes)."""
    if not _SERVER or _SERVER[0].poll() is not None:
        _SERVER[:] = [subprocess.Popen(
            [sys.executable, "-m", "tests.support.forked"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, cwd=ROOT,
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
        )]
        atexit.register(_SERVER[0].communicate)
    return _SERVER[0]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def launch(worker: str, world: int, out: Path, *, timeout: float = 30.0,
           deadline: float = 150.0, hangs: int | None = None, preload: tuple[str, ...] = (),
           script: str) -> list[Ended]:
    """Run `worker` of `script` (a test file that is also the worker) on `world` processes like
    torchrun does and wait for all of them; a process still alive at `deadline` seconds is
    killed and fails the test (nothing is left behind), except rank `hangs` (a deliberately hung
    rank), which is killed once the others ended. The processes are forked from a parent that
    the session's `tests.support.forked` server forks with torch and hybridpipe imported, and
    which imports the test file and the modules `preload` names, as starting each process
    with torch costs seconds of CPU."""
    import torch.distributed as dist

    from tests.support.forked import PRELOAD

    store = dist.TCPStore("127.0.0.1", 0, world, True,
                          timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    env = dict(
        os.environ, WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True",
        HYBRIDPIPE_TIMEOUT=str(timeout), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
        **{PRELOAD: ",".join(preload)},
    )
    for name in ("ended.json", "pids.json"):
        (out / name).unlink(missing_ok=True)
    server = _server()
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write(json.dumps({"env": env, "argv": [
        script, worker, str(out), str(world), str(deadline), str(-1 if hangs is None else hangs),
    ]}) + "\n")
    server.stdin.flush()
    # Bounded: the first answer waits for the server's imports, later ones for one fork.
    if not select.select([server.stdout], [], [], 300)[0]:
        server.kill()
        raise TimeoutError("the fork server did not answer within 300 s")
    answer = server.stdout.readline()
    assert answer.strip().isdigit(), f"the fork server failed: {answer!r}"
    parent = int(answer)
    end = time.monotonic() + deadline + 60  # the parent kills its ranks at the deadline
    while _alive(parent) and time.monotonic() < end:
        time.sleep(0.05)
    if _alive(parent):  # stuck itself: it and its ranks go
        pids = json.loads((out / "pids.json").read_text()) if (out / "pids.json").exists() else []
        for pid in [parent, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    result = out / "ended.json"
    parent_log = out / "parent.log"
    assert result.exists(), "the launch's parent failed:\n" + (
        parent_log.read_text()[-3000:] if parent_log.exists() else "(no output)")
    found = json.loads(result.read_text())
    ended = [Ended(rank, found["codes"][str(rank)], (out / f"rank{rank}.log").read_text())
             for rank in range(world)]
    hung = found["killed"]
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
