"""Benchmark: how long the auto-planner takes to rank (pp, dp, schedule, microbatches, chunks)
for 1,024 ranks (and 8, 64 for scale), on a profiled 62-layer GPT (64 graph nodes), with a
memory cap that rules out the shallow pipelines. Writes benchmarks/results/autoplan.{md,json}.

Run: .venv/bin/python benchmarks/bench_autoplan.py
"""

from __future__ import annotations

import platform
import time
from typing import Any

import torch
from report import write_results

from partitioner import capture, profile
from pipeline.app.models import GPT, TransformerBlock
from pipeline.planning.autoplan import AutoPlan, search

WORLDS = (8, 64, 1024)
REPEATS = 3
SAMPLES_PER_RANK = 8


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = GPT(vocab=256, dim=64, layers=62, heads=4, max_seq=32)
    x = torch.randint(0, 256, (2, 32))
    graph = capture(model, (x,), leaf_modules=(TransformerBlock,))
    graph = graph.with_costs(profile(graph, model, (x,)))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    limit = 4.0 * param_bytes / 2  # weights + grads + Adam need >= 2 pipeline ranks
    rows: list[dict[str, Any]] = []
    tables = {}
    for world in WORLDS:
        times, cpu = [], []
        result: AutoPlan | None = None
        for _ in range(REPEATS):
            started, cpu_started = time.perf_counter(), time.process_time()
            result = search(
                graph, world_size=world, batch_size=SAMPLES_PER_RANK * world, profiled_batch=2,
                memory_limit=limit, dp_bandwidth=1e10,
            )
            times.append(time.perf_counter() - started)
            cpu.append(time.process_time() - cpu_started)
        assert result is not None
        best = result.best
        rows.append({
            "world_size": world, "seconds_best": min(times), "seconds_worst": max(times),
            "cpu_seconds_best": min(cpu),
            "simulated": result.simulated, "over_memory": result.over_memory,
            "pruned": result.pruned, "best": best.to_dict(),
        })
        tables[world] = result.table(10)
        print(f"world {world}: {min(times):.2f} s (worst {max(times):.2f} s)\n{tables[world]}")
    meta = {
        "python": platform.python_version(), "torch": torch.__version__,
        "machine": platform.machine(), "graph_nodes": len(graph.order),
        "memory_limit": limit, "samples_per_rank": SAMPLES_PER_RANK, "repeats": REPEATS,
    }
    lines = [
        "# Auto-planner search time",
        "",
        f"GPT, 62 layers, dim 64 ({meta['graph_nodes']} graph nodes), profiled on CPU; "
        f"{SAMPLES_PER_RANK} samples per rank per step; memory limit "
        f"{limit / 2**20:.1f} MiB per device (parameters x 4 need >= 2 pipeline ranks; the "
        "time-balanced stages hold uneven memory, so more).",
        "`python benchmarks/bench_autoplan.py`",
        "",
        "Wall seconds on a shared machine; CPU seconds = this process's own (the load-free "
        "figure).",
        "",
        "| world size | wall s (best of 3) | worst wall s | CPU s (best) | simulated | "
        "over memory | pruned | best |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = r["best"]
        lines.append(
            f"| {r['world_size']} | {r['seconds_best']:.2f} | {r['seconds_worst']:.2f} | "
            f"{r['cpu_seconds_best']:.2f} | "
            f"{r['simulated']} | {r['over_memory']} | {r['pruned']} | pp={b['pp']} "
            f"dp={b['dp']} {b['schedule']} m={b['microbatches']} v={b['virtual_stages']}, "
            f"{1e3 * b['step_time']:.1f} ms |"
        )
    lines += ["", "Ranked table at 1,024 ranks:", "", "```", tables[1024], "```", ""]
    write_results("autoplan", {"meta": meta, "rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
