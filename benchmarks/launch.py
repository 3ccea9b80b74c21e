"""Run a benchmark's distributed workers the way users do: torchrun (torch.distributed.run,
--standalone: one machine, its own rendezvous) starts `world` processes of the script with
`--worker` and the given arguments, 1 thread each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
