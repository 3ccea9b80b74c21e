"""Benchmark: how long building, validating, simulating and lowering large schedules takes, plus
the simulated bubble table at F=B=W=1. Writes benchmarks/results/simulator.{md,json}.

Run: .venv/bin/python benchmarks/bench_simulator.py
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from typing import Any

from report import write_results

from scheduler import build_schedule, lower, simulate, validate

CASES = [  # (schedule, ranks, microbatches, virtual stages)
    ("1f1b", 64, 1024, 1),
    ("gpipe", 64, 1024, 1),
    ("zb-h2", 32, 512, 1),
    ("interleaved-1f1b", 16, 256, 4),
    ("zbv", 32, 512, 2),
]
REPEATS = 3


def _best(fn: Callable[..., object], *args: Any) -> float:
    """Best of REPEATS wall-clock runs of fn(*args) (the least disturbed by the shared machine)."""
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    rows: list[dict[str, Any]] = []
    for name, p, m, v in CASES:
        schedule = build_schedule(name, p, m, v)
        n_actions = sum(len(acts) for acts in schedule.actions)
        rows.append(
            {
                "schedule": name,
                "ranks": p,
                "microbatches": m,
                "virtual_stages": v,
                "actions": n_actions,
                "build_s": _best(build_schedule, name, p, m, v),
                "validate_s": _best(validate, schedule),
                "simulate_s": _best(simulate, schedule, 1.0, 2.0, 1.0, 0.1),
                "lower_s": _best(lower, schedule),
            }
        )
    bubbles: list[dict[str, Any]] = []
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev"):
        v = 2 if name in ("interleaved-1f1b", "zbv", "dualpipev") else 1
        for p, m in ((4, 8), (8, 32)):
            t = simulate(build_schedule(name, p, m, v), 1.0, 1.0, 1.0)
            bubbles.append(
                {
                    "schedule": name,
                    "ranks": p,
                    "microbatches": m,
                    "virtual_stages": v,
                    "step_time": t.step_time,
                    "bubble_fraction": t.bubble_fraction,
                    "peak_inflight": list(t.peak_inflight),
                }
            )
    meta = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "repeats": REPEATS,
        "statistic": "best of repeats, seconds",
    }
    lines = [
        "# Schedule engine timings",
        "",
        f"Best of {REPEATS} runs, seconds, Python {meta['python']} on {meta['machine']} "
        "(shared 2-core machine). Simulation costs F=1, B=2, W=1, comm=0.1.",
        "",
        "| schedule | p | m | v | actions | build | validate | simulate | lower |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['schedule']} | {r['ranks']} | {r['microbatches']} | {r['virtual_stages']} | "
        f"{r['actions']} | {r['build_s']:.3f} | {r['validate_s']:.3f} | "
        f"{r['simulate_s']:.3f} | {r['lower_s']:.3f} |"
        for r in rows
    ]
    lines += [
        "",
        "# Simulated bubble fraction at F=B=W=1 (per stage; per chunk for interleaved and zbv)",
        "",
        "| schedule | p | m | v | step time | bubble | peak in-flight (per rank) |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {b['schedule']} | {b['ranks']} | {b['microbatches']} | {b['virtual_stages']} | "
        f"{b['step_time']:g} | {b['bubble_fraction']:.4f} | "
        f"{', '.join(str(x) for x in b['peak_inflight'])} |"
        for b in bubbles
    ]
    write_results("simulator", {"meta": meta, "timings": rows, "bubbles": bubbles},
                  "\n".join(lines))


if __name__ == "__main__":
    main()
