"""Where a launch's ranks come from (`tests.support.distributed.launch`): one server per test
session imports torch, hybridpipe and the test helpers (Hugging Face modeling modules too) once;
for each launch it forks a parent, which imports the test file and the modules named in
$HYBRIDPIPE_TEST_PRELOAD and forks one process per rank, each with the environment torchrun
gives (RANK, LOCAL_RANK; the rest set by the launcher), its output in OUT_DIR/rank<r>.log,
running the test file as ``python FILE WORKER OUT_DIR`` would. Starting a process with torch
costs seconds of CPU; forked, every launch and rank shares the imports. The parent waits for the
ranks, kills one still alive at the deadline (and the rank that `hangs` names once the others
ended), and writes each rank's exit status (negative: the signal) and the ranks it killed at
the deadline to OUT_DIR/ended.json.

``python -m tests.support.forked`` serves: each line on stdin is a JSON request {"env": the
launch's environment, "argv": [FILE, WORKER, OUT_DIR, WORLD, DEADLINE, HANGS (-1: none)]}; it
answers with the parent's pid on a line. It ends at the end of stdin."""

from __future__ import annotations

import importlib
import json
import os
import runpy
import signal
import sys
import time
from pathlib import Path
from typing import Any

PRELOAD = "HYBRIDPIPE_TEST_PRELOAD"  # comma-separated module names the parent imports


def _rank(rank: int, script: str, worker: str, out: Path) -> None:
    """In the forked process: become rank `rank` and run the test file as its __main__. It
    leaves as ``python FILE`` would: SystemExit(0), or an exception (a traceback, status 1)."""
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    log = os.open(out / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.argv = [script, worker, str(out)]
    sys.path.insert(0, str(Path(script).parent))
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def _wait(pids: dict[int, int], deadline: float, hangs: int) -> tuple[dict[int, int], list[int]]:
    """Each rank's exit status (`pids`: pid -> rank), and the ranks killed at the deadline."""
    codes: dict[int, int] = {}
    killed: list[int] = []
    end = time.monotonic() + deadline
    while pids:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pids.pop(pid)] = os.waitstatus_to_exitcode(status)
            continue
        left = sorted(pids.values())
        if left == [hangs] or time.monotonic() > end:
            killed = [r for r in left if r != hangs]
            for pid in list(pids):
                os.kill(pid, signal.SIGKILL)
                codes[pids.pop(pid)] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            continue
        time.sleep(0.02)
    return codes, killed


def _parent(request: dict[str, Any]) -> None:
    """The forked parent of one launch. Only it returns from here: its ranks leave by
    SystemExit or an exception (as from ``python FILE``), never by returning."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # it waits for its ranks
    os.environ.clear()
    os.environ.update(request["env"])
    script, worker, out_dir, world, deadline, hangs = request["argv"]
    out = Path(out_dir)
    log = os.open(out / "parent.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    for name in filter(None, os.environ.get(PRELOAD, "").split(",")):
        importlib.import_module(name)
    runpy.run_path(script, run_name="__forked__")  # the test file's own imports
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank in range(int(world)):
        pid = os.fork()
        if pid == 0:
            _rank(rank, script, worker, out)
        pids[pid] = rank
    (out / "pids.json").write_text(json.dumps(list(pids)))
    codes, killed = _wait(pids, float(deadline), int(hangs))
    (out / "ended.json").write_text(json.dumps({"codes": codes, "killed": killed}))


def _warm_up() -> None:
    """torch.export's first-call setup, done once here on a tiny model rather than in every
    rank that exports (a rank's first export of the test GPT took 1.55 s of CPU cold, 1.09 s
    after this 0.24 s warm-up). No thread is left running, as the server forks (an fx capture
    would start tqdm's monitor thread)."""
    import threading

    import torch
    from torch import nn

    from partitioner import capture

    capture(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), (torch.randn(2, 2),), method="export")
    assert threading.active_count() == 1, threading.enumerate()


def serve() -> None:
    import torch

    torch.set_num_threads(1)
    importlib.import_module("tests.support.distributed")  # hybridpipe with it
    from tests.support.distributed import HF_MODULES

    for name in HF_MODULES:
        importlib.import_module(name)
    _warm_up()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the parents are reaped as they end
    for line in sys.stdin:
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _parent(json.loads(line))
            sys.stdout.flush()
            os._exit(0)
        print(pid, flush=True)


if __name__ == "__main__":
    serve()
