"""Benchmark: the distributed executor's transport as it is against the transport without the
sender's handoff and with two receives posted ahead (how it posted before), side by side in
one run: 2 gloo ranks, 1 thread each, the 8-block MLP stack on a uniform split, every schedule
that runs at p=2, near-zero compute (width 8) and compute (width 256, 16 rows), m=32. Rounds
alternate the two Pipelines' order; per round the ratio before / now. Writes
benchmarks/results/transport.{md,json}.

Run: .venv/bin/python benchmarks/bench_transport.py   (it launches its own 2 processes;
BENCH_REPEATS sets the rounds, 16 by default)
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time

import torch
from launch import gather, hand_back
from report import write_results

REPEATS = int(os.environ.get("BENCH_REPEATS", "16"))
M = 32
# (label, model width, hidden width, rows per microbatch)
CASES = [("near-zero compute", 8, 8, 16), ("compute", 256, 1024, 16)]
SCHEDULES = ["gpipe", "1f1b", "1f1b-eager", "interleaved-1f1b", "zb-h1", "zbv"]


def _pipeline(schedule: str, dim: int, hidden: int, before: bool) -> object:
    from torch.nn import functional as F

    from pipeline import Pipeline
    from pipeline.app.models import mlp_stack
    from pipeline.execution.distributed import executor, p2p

    plain = p2p.P2PTransport
    if before:  # the transport as it posted before: no handoff, two receives ahead
        executor.P2PTransport = functools.partial(  # type: ignore[misc]
            plain, ahead_bytes=0, handoff=False
        )
    try:
        torch.manual_seed(0)
        return Pipeline(mlp_stack(blocks=8, dim=dim, hidden=hidden), 2, schedule=schedule,
                        microbatches=M, loss_fn=F.mse_loss, balance="uniform")
    finally:
        executor.P2PTransport = plain  # type: ignore[misc]


def _worker() -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results: dict[str, dict[str, dict[str, float]]] = {}
    for label, dim, hidden, rows in CASES:
        x, y = torch.randn(rows * M, dim), torch.randn(rows * M, dim)
        results[label] = {}
        for schedule in SCHEDULES:
            pipes = {"before": _pipeline(schedule, dim, hidden, True),
                     "now": _pipeline(schedule, dim, hidden, False)}
            times: dict[str, list[float]] = {"before": [], "now": []}
            for r in range(REPEATS + 2):
                order = ["before", "now"] if r % 2 else ["now", "before"]
                for name in order:
                    pipe = pipes[name]
                    pipe.zero_grad()  # type: ignore[attr-defined]
                    dist.barrier()
                    start = time.perf_counter()
                    pipe.step(x, y)  # type: ignore[attr-defined]
                    dist.barrier()
                    if r >= 2:  # two warm-up rounds
                        times[name].append(time.perf_counter() - start)
            results[label][schedule] = {
                "before_s": statistics.median(times["before"]),
                "now_s": statistics.median(times["now"]),
                "per_round": statistics.median(
                    b / n for b, n in zip(times["before"], times["now"], strict=True)),
            }
    if dist.get_rank() == 0:
        hand_back(results)
    dist.destroy_process_group()


def main() -> None:
    load = os.getloadavg()[0]
    results = gather(__file__, 2, timeout=1800)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average_start": load,
            "load_average_end": os.getloadavg()[0], "rounds": REPEATS, "microbatches": M}
    lines = [
        "# The transport now vs before (handoff, receives posted ahead)",
        "",
        f"2 gloo ranks, 1 thread each, mlp_stack(blocks=8) on a uniform split, m={M}, "
        f"{REPEATS} rounds after 2 warm-up ones, the two Pipelines' order alternating (1-min "
        f"load average {load:.1f} at the start, {meta['load_average_end']:.1f} at the end; "
        f"{meta['date']}). Before = no sender handoff and two receives posted ahead per peer. "
        "Command: `.venv/bin/python benchmarks/bench_transport.py`.",
        "",
        "| case | schedule | before ms | now ms | before / now (medians) | per round |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for label, rows in results.items():
        for schedule, r in rows.items():
            lines.append(f"| {label} | {schedule} | {1e3 * r['before_s']:.1f} | "
                         f"{1e3 * r['now_s']:.1f} | {r['before_s'] / r['now_s']:.2f}x | "
                         f"{r['per_round']:.2f}x |")
    write_results("transport", {"meta": meta, "cases": results}, "\n".join(lines))


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker()
    else:
        main()
