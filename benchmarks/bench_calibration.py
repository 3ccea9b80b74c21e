"""Benchmark: how close the simulator's predicted step is to the measured one, for every
schedule, in the local executor (threads) and the distributed executor (2 gloo processes),
with profiled costs and with costs calibrated from measured traces (pipeline.calibration).

Per schedule (8-block MLP-transformer stack, dim 256, p=2, m=8; 1 thread per rank): one
warm-up step, then CAL_STEPS steps whose traces calibrate the cost model and MEASURED_STEPS
held-out steps whose median trace step time is "measured", taking turns (so both see the
machine as it is). Errors are predicted / measured - 1.
Writes benchmarks/results/calibration.{md,json}.

Run: .venv/bin/python benchmarks/bench_calibration.py   (it launches its own 2 processes)
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from launch import torchrun
from torch.nn import functional as F

RESULTS = Path(__file__).resolve().parent / "results"
P, M, BATCH, DIM, BLOCKS = 2, 8, 64, 256, 8
CAL_STEPS = MEASURED_STEPS = int(os.environ.get("BENCH_STEPS", "15"))


def measure_all(pipe_kwargs: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Profiled and calibrated predictions against held-out measured steps, per schedule
    (on a distributed run, every process calls this; rank 0's figures are complete)."""
    from pipeline import Pipeline
    from pipeline.calibration import held_out_check
    from pipeline.models import mlp_stack
    from scheduler import SCHEDULES

    rows = {}
    for name in SCHEDULES:
        # A fresh model each time: under torch.distributed a Pipeline empties the stages
        # other processes hold.
        torch.manual_seed(0)
        model = mlp_stack(blocks=BLOCKS, dim=DIM)
        x, y = torch.randn(BATCH, DIM), torch.randn(BATCH, DIM)
        pipe = Pipeline(model, P, schedule=name, microbatches=M, loss_fn=F.mse_loss,
                        example_input=x, **pipe_kwargs)
        check = held_out_check(pipe, x, y, CAL_STEPS, MEASURED_STEPS)
        if check is None:
            continue
        rows[name] = {
            "measured_s": check.measured,
            "profiled_s": check.profiled,
            "calibrated_s": check.calibrated,
            "profiled_error": check.profiled_error,
            "calibrated_error": check.calibrated_error,
            "overhead_s": check.calibration.overhead,
            "latency_s": check.calibration.latency,
            "step_noise": check.step_noise,
        }
    return rows


def _worker() -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = measure_all({})
    if dist.get_rank() == 0:
        Path(os.environ["BENCH_OUT"]).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _distributed() -> dict[str, Any]:
    out = RESULTS / ".calibration-raw.json"
    torchrun(__file__, P, timeout=1800, BENCH_OUT=str(out))
    rows: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    return rows


def table(rows: dict[str, dict[str, float]]) -> list[str]:
    """Markdown rows: measured, profiled and calibrated predictions with their errors."""
    ms = 1e3
    lines = [
        "| schedule | measured ms | predicted, profiled ms (error) | predicted, calibrated ms "
        "(error) | step noise | overhead ms/action | latency ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['measured_s'] * ms:.1f} | {r['profiled_s'] * ms:.1f} "
            f"({r['profiled_error']:+.1%}) | {r['calibrated_s'] * ms:.1f} "
            f"({r['calibrated_error']:+.1%}) | +-{r['step_noise']:.1%} | "
            f"{r['overhead_s'] * ms:.2f} | "
            f"{r['latency_s'] * ms:.2f} |"
        )
    return lines


def main() -> None:
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    local = measure_all({})
    distributed = _distributed()
    meta = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cpus": os.cpu_count(), "load_average_start": load,
        "load_average_end": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "model": f"mlp_stack(blocks={BLOCKS}, dim={DIM})", "ranks": P, "microbatches": M,
        "batch": BATCH, "calibration_steps": CAL_STEPS, "measured_steps": MEASURED_STEPS,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "calibration.json").write_text(
        json.dumps({"meta": meta, "local": local, "distributed": distributed}, indent=2) + "\n"
    )
    worst = {
        kind: max(abs(r["calibrated_error"]) for r in rows.values())
        for kind, rows in (("local", local), ("distributed", distributed))
    }
    lines = [
        "# Predicted vs measured step time, every schedule",
        "",
        f"{meta['model']}, p={P}, m={M}, batch {BATCH}, 1 thread per rank, on {meta['cpus']} "
        f"shared CPUs (1-min load average {load:.1f} at the start, "
        f"{meta['load_average_end']:.1f} at the end; {meta['date']}). Per schedule: 1 warm-up "
        f"step, then {CAL_STEPS} calibration steps and {MEASURED_STEPS} held-out steps taking "
        "turns; the median of the held-out steps' traces is \"measured\"; step noise = half "
        "their interquartile range over that median. Command: "
        "`.venv/bin/python benchmarks/bench_calibration.py`.",
        "",
        "## Local executor (one thread per rank)",
        "",
        *table(local),
        "",
        "## Distributed executor (2 processes, gloo)",
        "",
        *table(distributed),
        "",
        f"Largest calibrated error: local {worst['local']:.1%}, distributed "
        f"{worst['distributed']:.1%}.",
        "",
    ]
    (RESULTS / "calibration.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker()
    else:
        main()
