"""Run a benchmark's distributed workers the way users do: torchrun (torch.distributed.run,
--standalone: one machine, its own rendezvous) starts `world` processes of the script with
`--worker` and the given arguments, 1 thread each. `gather` runs them and returns what one of
them handed back with `hand_back`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from report import RESULTS

ROOT = Path(__file__).resolve().parents[1]


def torchrun(script: str, world: int, *args: str, timeout: float = 3600, **env: str) -> None:
    """Run `script --worker *args` on `world` local processes (extra environment `env`); raise
    SystemExit naming the script if a worker fails (its traceback is printed above) or the run
    takes more than `timeout` seconds."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={world}", script, "--worker", *args]
    environ = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **env)
    try:
        done = subprocess.run(command, env=environ, cwd=ROOT, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{Path(script).name}: the workers ran past {timeout:.0f} s") from None
    if done.returncode != 0:
        raise SystemExit(f"{Path(script).name}: a worker failed (torchrun exit "
                         f"{done.returncode}; its traceback is above)")


def gather(script: str, world: int, *args: str, timeout: float = 3600) -> Any:
    """`torchrun` the script's workers; return the JSON value one of them passed to
    `hand_back` (through a file under benchmarks/results/, removed afterwards)."""
    out = RESULTS / f".{Path(script).stem}-raw.json"
    RESULTS.mkdir(exist_ok=True)
    torchrun(script, world, *args, timeout=timeout, BENCH_OUT=str(out))
    try:
        return json.loads(out.read_text())
    finally:
        out.unlink()


def hand_back(value: Any) -> None:
    """In a worker started by `gather`: hand `value` (JSON-serialisable) back to it."""
    Path(os.environ["BENCH_OUT"]).write_text(json.dumps(value))
