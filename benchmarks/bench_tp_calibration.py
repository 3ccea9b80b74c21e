"""Benchmark: the simulator's step under tensor parallelism against measured steps, at pp=2 x
tp=2 (4 gloo processes under torchrun, 1 thread each), for the demo GPT.

Per schedule: one warm-up step, then calibration steps and held-out steps taking turns
(`pipeline.planning.calibration.held_out_check`): the step predicted from the calibration
steps' traces (each tp group's actions measured with its collectives inside them) against the
median held-out step, and the step the cost model predicts before any step ran: the units
profiled whole on rank 0 (balance="profile"), priced at tp=2 (pipeline.planning.tp_costs:
shard shapes, the collectives fitted on this job's own tp groups, DTensor's measured cost per
op).

Writes benchmarks/results/tp_calibration.{md,json}. Run:
.venv/bin/python benchmarks/bench_tp_calibration.py (BENCH_STEPS sets the calibration and the
held-out steps, 8 each by default)."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

import torch
from launch import gather, hand_back
from report import write_results
from torch.nn import functional as F

STEPS = int(os.environ.get("BENCH_STEPS", "8"))
VOCAB, DIM, LAYERS, HEADS, SEQ, ROWS, MICRO = 1024, 256, 4, 8, 64, 8, 4
SCHEDULES = ("1f1b", "zb-h1")


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def _case(schedule: str, collectives: Any) -> dict[str, Any] | None:
    from pipeline import Pipeline
    from pipeline.app.models import GPT
    from pipeline.planning.calibration import held_out_check
    from pipeline.planning.costs import stage_costs
    from pipeline.planning.tp_costs import width

    torch.manual_seed(0)
    model = GPT(vocab=VOCAB, dim=DIM, layers=LAYERS, heads=HEADS, max_seq=SEQ)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    pipe = Pipeline(model, stages=2, schedule=schedule, microbatches=MICRO, loss_fn=lm_loss,
                    balance="profile", tensor_parallel=2, example_input=x)
    decision = pipe._setup.require_plan()
    profiled = None
    if decision.captured.profiled:  # rank 0: it profiled the whole graph before the split
        priced = width(decision.captured, 2, collectives)
        profiled = stage_costs(priced.captured, decision.plan)
    check = held_out_check(pipe, x, y, calibration_steps=STEPS, measured_steps=STEPS,
                           profiled=profiled)
    if check is None:
        return None
    return {"schedule": schedule, "measured": check.measured, "calibrated": check.calibrated,
            "profiled_tp": check.profiled, "remeasured": check.remeasured,
            "step_noise": check.step_noise, "load": os.getloadavg()[0]}


def worker() -> None:
    import torch.distributed as dist

    from pipeline.planning.hardware.group_collectives import measure_world

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    collectives = measure_world([2])
    rows = [_case(s, collectives) for s in SCHEDULES]
    if dist.get_rank() == 0:
        hand_back({"cases": rows, "collectives": collectives.to_dict()})
    dist.destroy_process_group()


def report(data: dict[str, Any]) -> str:
    fits = data["collectives"]["fits"]
    lines = [
        "# The simulator at pp=2 x tp=2 against measured steps",
        "",
        f"{platform.machine()}, torch {torch.__version__}, 4 gloo processes (1 thread each) "
        f"on {os.cpu_count()} cores. Demo GPT: width {DIM}, {LAYERS} blocks, {HEADS} heads, "
        f"vocab {VOCAB}, {ROWS} x {SEQ} tokens, {MICRO} microbatches; {STEPS} calibration "
        f"and {STEPS} held-out steps taking turns after a warm-up step.",
        "",
        "| schedule | measured (ms) | calibrated (ms) | error | cost model at tp=2 (ms) "
        "| error | re-measured | step noise | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in data["cases"]:
        m = c["measured"]
        lines.append(
            f"| {c['schedule']} | {m * 1e3:.1f} | {c['calibrated'] * 1e3:.1f} | "
            f"{c['calibrated'] / m - 1:+.1%} | {c['profiled_tp'] * 1e3:.1f} | "
            f"{c['profiled_tp'] / m - 1:+.1%} | {c['remeasured'] / m - 1:+.1%} | "
            f"{c['step_noise']:.1%} | {c['load']:.1f} |")
    lines += [
        "",
        "Collectives fitted on the job's tp groups of 2 (latency, bus bandwidth): " + ", ".join(
            f"{k} {v['2'][0] * 1e6:.0f} us, {v['2'][1] / 1e6:.0f} MB/s" for k, v in fits.items())
        + f"; DTensor's own cost per op {data['collectives']['dispatch'] * 1e6:.0f} us.",
    ]
    return "\n".join(lines)


def main() -> None:
    if "--worker" in sys.argv:
        worker()
        return
    data = gather(__file__, 4, timeout=3000)
    write_results("tp_calibration", data, report(data))


if __name__ == "__main__":
    main()
