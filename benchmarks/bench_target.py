"""Benchmark: planning at scale (pipeline.planning.scale), two checks.

1. The local CPU as a target, from its microbenchmarked constants alone (GEMM FLOP/s, copy
   bandwidth, the tiny-op floor, fused attention's rate, gloo send latency and bandwidth:
   no step was fitted), predicts the measured step of a llama: family model (4 blocks,
   hidden 256, 8 heads, 4 kv heads, seq 128, vocab 2048, fp32) run by the distributed
   executor on 2 gloo processes (pp=2, m=8, 1 thread each), for each schedule. Measured:
   rank 0's median `pipe.step` wall time over
   BENCH_STEPS steps after 2 warm-up ones, a barrier before each; predicted: the layout's
   step without the optimizer (the benchmark times `pipe.step` only). On a shared machine
   the wall time also counts waiting for a core, so each rank's CPU time per step (the
   main thread's, which runs the stage: its busy time, as a blocked gloo receive sleeps) is
   compared with the rank's predicted busy time too.
2. Planning a 1T-parameter GPT (128 layers, hidden 25600, 160 heads, seq 2048) for 3072
   A100s and a batch of 3072: the search's wall time and this process's peak memory.

Writes benchmarks/results/target.{md,json}.
Run: .venv/bin/python benchmarks/bench_target.py   (it launches its own 2 processes)
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
import sys
import time
from typing import Any

import torch
from launch import gather, hand_back
from report import write_results

SPEC = "llama:layers=4,hidden=256,heads=8,kv_heads=4,vocab=2048,seq=128"
BATCH, P, M = 16, 2, 8
STEPS = int(os.environ.get("BENCH_STEPS", "8"))
SCHEDULES = {"gpipe": 1, "1f1b": 1, "zb-h1": 1, "interleaved-1f1b": 2}
ONE_T = "gpt:layers=128,hidden=25600,heads=160,vocab=51200,seq=2048"


def _measure() -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn import functional as F

    from pipeline import Pipeline
    from pipeline.planning.scale.transformer import TransformerLM, parse_spec

    spec = parse_spec(SPEC)
    out = {}
    for name in SCHEDULES:
        torch.manual_seed(0)
        ids = torch.randint(0, spec.vocab, (BATCH, spec.seq))
        target = torch.randint(0, spec.vocab, (BATCH, spec.seq))

        def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.flatten(0, 1), y.flatten())

        pipe = Pipeline(TransformerLM(spec), P, schedule=name, microbatches=M, loss_fn=loss)
        times, cpu = [], []
        for step in range(STEPS + 2):
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.thread_time()
            pipe.step(ids, target)
            if step >= 2:
                times.append(time.perf_counter() - start)
                cpu.append(time.thread_time() - start_cpu)
        busy: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(busy, statistics.median(cpu))
        out[name] = {"step_s": statistics.median(times), "busy_s": busy}
    return out


def _worker() -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    measured = _measure()
    if dist.get_rank() == 0:
        hand_back(measured)
    dist.destroy_process_group()


def _predicted() -> dict[str, dict[str, Any]]:
    from pipeline.planning.hardware import target_named
    from pipeline.planning.scale.layout import Job, Layout
    from pipeline.planning.scale.predict import finish, simulate_layout
    from pipeline.planning.scale.transformer import parse_spec

    job = Job(parse_spec(SPEC), target_named("cpu", gpus_per_node=P), P, BATCH, "fp32")
    out = {}
    for name, v in SCHEDULES.items():
        sim = simulate_layout(job, Layout(pp=P, microbatches=M, virtual_stages=v,
                                          schedule=name))
        p = finish(job, sim)
        out[name] = {"step_s": p.step_time - p.optimizer_time, "bubble": p.bubble,
                     "busy_s": [sum(e - s for s, e in rank) for rank in sim.times]}
    return out
    return out


def _plan_one_t() -> dict[str, float]:
    from pipeline.planning.hardware import TARGETS
    from pipeline.planning.scale.layout import Job
    from pipeline.planning.scale.search import search
    from pipeline.planning.scale.transformer import parse_spec

    started, cpu = time.perf_counter(), time.process_time()
    plan = search(Job(parse_spec(ONE_T), TARGETS["a100-sxm4-80gb"], 3072, 3072))
    best = plan.candidates[0]
    return {"seconds": time.perf_counter() - started, "cpu_s": time.process_time() - cpu,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "simulated": plan.simulated, "rejected": sum(plan.rejected.values()),
            "best": best.layout.describe(), "best_step_s": best.step_time}


def main() -> None:
    torch.set_num_threads(1)
    one_t = _plan_one_t()
    from pipeline.planning.hardware.local import measured as microbenchmark

    figures = microbenchmark()
    predicted = _predicted()
    measured = gather(__file__, P)
    rows = ["| schedule | step measured s | predicted s | error | busy per rank measured s "
            "| predicted s | errors |", "|---|---|---|---|---|---|---|"]
    errors, busy_errors = {}, {}
    for name in SCHEDULES:
        got, want = measured[name], predicted[name]
        errors[name] = want["step_s"] / got["step_s"] - 1
        busy_errors[name] = [w / g - 1 for w, g in zip(want["busy_s"], got["busy_s"],
                                                       strict=True)]
        rows.append(
            f"| {name} | {got['step_s']:.4f} | {want['step_s']:.4f} | {errors[name]:+.1%} | "
            f"{', '.join(f'{x:.4f}' for x in got['busy_s'])} | "
            f"{', '.join(f'{x:.4f}' for x in want['busy_s'])} | "
            f"{', '.join(f'{e:+.1%}' for e in busy_errors[name])} |")
    load = os.getloadavg()[0]
    report = "\n".join([
        "# Planning at scale: the CPU target and a 1T-parameter plan", "",
        f"Host {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, load "
        f"average {load:.1f} at the end. Model {SPEC}, fp32, batch {BATCH}, pp={P}, m={M}, "
        "2 gloo processes of 1 thread (distributed executor).", "",
        "CPU target constants, microbenchmarked (no step fitted): GEMM "
        f"{figures['fp32']['gemm'] / 1e9:.1f} GFLOP/s fp32, copy "
        f"{figures['fp32']['bandwidth'] / 1e9:.1f} GB/s, floor "
        f"{figures['fp32']['floor'] * 1e6:.1f} us, attention "
        f"{figures['fp32']['attention'] / 1e9:.1f} GFLOP/s, gloo send "
        f"{figures['gloo']['p2p_latency'] * 1e6:.0f} us + "
        f"{figures['gloo']['p2p_bandwidth'] / 1e9:.2f} GB/s.", "",
        *rows, "",
        f"Largest error: step {max(abs(e) for e in errors.values()):.1%}, busy time per rank "
        f"{max(abs(e) for v in busy_errors.values() for e in v):.1%} (target: within 25%).",
        "",
        f"1T GPT ({ONE_T}) on 3072 x a100-sxm4-80gb, batch 3072: searched in "
        f"{one_t['seconds']:.1f} s wall ({one_t['cpu_s']:.1f} s of CPU), peak RSS "
        f"{one_t['peak_rss_gib']:.2f} GiB; "
        f"{one_t['simulated']} simulated, {one_t['rejected']} rejected; best "
        f"{one_t['best']} at {one_t['best_step_s']:.1f} s per step.",
    ])
    write_results("target", {"measured": measured, "predicted": predicted, "errors": errors,
                             "busy_errors": busy_errors,
                             "microbenchmark": figures, "one_t": one_t, "load": load}, report)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker()
    else:
        main()
