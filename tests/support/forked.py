"""The parent of a launch's ranks (`tests.support.distributed.launch`): imports torch, the test
file (with hybridpipe) and the modules named in $HYBRIDPIPE_TEST_PRELOAD once, then forks one
process per rank, each with the environment torchrun gives (RANK, LOCAL_RANK; the rest set by
the launcher), its output in OUT_DIR/rank<r>.log, running the test file as ``python FILE
WORKER OUT_DIR`` would. Starting a process with torch costs seconds of CPU; forked, the ranks
share the imports. It waits for the ranks, kills one still alive at the deadline (and the rank
that `hangs` names once the others ended), and writes each rank's exit status (negative: the
signal) and the ranks it killed at the deadline to OUT_DIR/ended.json.

``python -m tests.support.forked FILE WORKER OUT_DIR WORLD DEADLINE HANGS`` (HANGS -1: none)."""

from __future__ import annotations

import importlib
import json
import os
import runpy
import signal
import sys
import time
from pathlib import Path

PRELOAD = "HYBRIDPIPE_TEST_PRELOAD"  # comma-separated module names the parent imports


def _rank(rank: int, script: str, worker: str, out: Path) -> None:
    """In the forked process: become rank `rank` and run the test file as its __main__. An
    exception leaves as it would from ``python FILE``: a traceback and exit status 1."""
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


def main() -> None:
    script, worker, out_dir, world, deadline, hangs = sys.argv[1:7]
    out = Path(out_dir)
    import torch

    torch.set_num_threads(1)
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
    codes, killed = _wait(pids, float(deadline), int(hangs))
    (out / "ended.json").write_text(json.dumps({"codes": codes, "killed": killed}))


if __name__ == "__main__":
    main()
