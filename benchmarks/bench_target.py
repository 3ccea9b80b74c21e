"""Benchmark: planning at scale (pipeline.planning.scale), three checks.

1. The local CPU as a target, from its microbenchmarked constants alone (GEMM FLOP/s, copy
   bandwidth, the tiny-op floor, fused attention's rate, gloo send latency and bandwidth,
   and the pipeline runtime's own CPU cost per action and per step from a near-zero-compute
   pipeline: pipeline.facade.runtime_cost; no step of this model was fitted), predicts the
   measured step of a llama: family model (4 blocks, hidden 256, 8 heads, 4 kv heads, seq
   128, vocab 2048, fp32, batch 16, m=8, 1 thread per rank), run
   - in one process (the local executor: both pipeline ranks as threads of it, pp=2);
   - under torchrun on gloo: pp=2 (2 processes) for each schedule, and pp=2 x dp=2
     (4 processes, 1F1B).
   Measured: the median over BENCH_STEPS steps after 2 warm-up ones (a barrier before each
   under torchrun) of `pipe.step`'s wall time and of CPU time: each rank's main thread's
   under torchrun (it runs the stage; a blocked gloo receive sleeps), the whole process's
   in one process (against the ranks' predicted busy time summed). Predicted: the layout's
   step without the optimizer (only `pipe.step` is timed), and each rank's busy time. The
   machine is shared: the load average is written beside each figure; wall time counts
   waiting for a core, CPU time does not.
2. Memory: in one more step of each torchrun pp=2 run (`.grad` cleared before it, as a
   training loop's zero_grad does), each process's heap in use (glibc mallinfo2, sampled
   every 0.2 ms): what the step adds at its peak over the heap before it, against that
   rank's predicted peak moment (pipeline.planning.scale.memory: the gradients made by
   then, the activations held, the action's working set, the p2p buffers), and the heap
   before the step over the heap before the model was built, against the predicted weights.
3. Planning a 1T-parameter GPT (128 layers, hidden 25600, 160 heads, seq 2048) for 3072
   A100s and a batch of 3072: the search's wall time and this process's peak memory.

Writes benchmarks/results/target.{md,json}.
Run: .venv/bin/python benchmarks/bench_target.py   (it launches its own processes)
"""

from __future__ import annotations

import gc
import os
import platform
import resource
import statistics
import sys
import time
from typing import Any

import torch
from bench_first_step import Peak, heap_in_use
from launch import gather, hand_back
from report import write_results

SPEC = "llama:layers=4,hidden=256,heads=8,kv_heads=4,vocab=2048,seq=128"
BATCH, P, M = 16, 2, 8
STEPS = int(os.environ.get("BENCH_STEPS", "8"))
SCHEDULES = {"gpipe": 1, "1f1b": 1, "zb-h1": 1, "interleaved-1f1b": 2}
DP_SCHEDULE = "1f1b"
ONE_T = "gpt:layers=128,hidden=25600,heads=160,vocab=51200,seq=2048"


def _load() -> float:
    return os.getloadavg()[0]


def _run(name: str, dp: int | None, distributed: bool) -> dict[str, Any]:
    """Time `STEPS` steps of one schedule (and, under torchrun, the heap of one more)."""
    import torch.distributed as dist
    from torch.nn import functional as F

    from pipeline import Pipeline
    from pipeline.planning.scale.transformer import TransformerLM, parse_spec

    spec = parse_spec(SPEC)
    torch.manual_seed(0)
    rows = BATCH // (dp or 1)
    ids = torch.randint(0, spec.vocab, (rows, spec.seq))
    target = torch.randint(0, spec.vocab, (rows, spec.seq))

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    gc.collect()  # the previous schedule's Pipeline (held in cycles) freed first
    before_model = heap_in_use()
    pipe = Pipeline(TransformerLM(spec), P, schedule=name, microbatches=M, loss_fn=loss,
                    virtual_stages=SCHEDULES[name], data_parallel=dp)
    clock = time.thread_time if distributed else time.process_time
    times, cpu, load = [], [], [_load()]
    for step in range(STEPS + 2):
        if distributed:
            dist.barrier()
        start, start_cpu = time.perf_counter(), clock()
        pipe.step(ids, target)
        if step >= 2:
            times.append(time.perf_counter() - start)
            cpu.append(clock() - start_cpu)
    load.append(_load())
    out: dict[str, Any] = {"step_s": statistics.median(times), "cpu_s": statistics.median(cpu),
                           "load": load}
    if distributed:
        pipe.zero_grad()  # as a training loop does before its step: the step makes the grads
        dist.barrier()
        with Peak() as heap:
            pipe.step(ids, target)
        out["heap_step_added"] = heap.added
        out["heap_state"] = heap.base - before_model
    del pipe
    return out


def _measure(dp: int | None) -> dict[str, Any]:
    import torch.distributed as dist

    names = [DP_SCHEDULE] if dp else list(SCHEDULES)
    out = {}
    for name in names:
        mine = _run(name, dp, True)
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        out[name] = every
    return out


def _worker() -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dp = 2 if "--dp" in sys.argv else None
    measured = _measure(dp)
    if dist.get_rank() == 0:
        hand_back(measured)
    dist.destroy_process_group()


def _predicted(runtime: dict[str, Any], world: int, names: list[str]
               ) -> dict[str, dict[str, Any]]:
    from pipeline.planning.hardware import target_named
    from pipeline.planning.scale.layout import Job, Layout
    from pipeline.planning.scale.predict import finish, simulate_layout
    from pipeline.planning.scale.transformer import parse_spec

    target = target_named("cpu", gpus_per_node=world, runtime=runtime)
    job = Job(parse_spec(SPEC), target, world, BATCH, "fp32")
    out = {}
    for name in names:
        sim = simulate_layout(job, Layout(pp=P, microbatches=M,
                                          virtual_stages=SCHEDULES[name], schedule=name))
        p = finish(job, sim)
        parts = _memory(job, sim)
        out[name] = {"step_s": p.step_time - p.optimizer_time, "bubble": p.bubble,
                     "busy_s": [sum(e - s for s, e in rank) + target.step_overhead
                                for rank in sim.times],
                     "state_bytes": [m.weights for m in parts],
                     "step_bytes": [m.gradients + m.activations + m.buffers + m.recompute
                                    for m in parts],
                     "step_parts": [m.to_dict() for m in parts]}
    return out


def _memory(job: Any, sim: Any) -> list[Any]:
    from pipeline.planning.scale.memory import memory_per_rank

    return memory_per_rank(job, sim.layout, sim.costs, sim.schedule, sim.dp)


def _plan_one_t() -> dict[str, Any]:
    from pipeline.planning.hardware import TARGETS
    from pipeline.planning.scale.layout import Job
    from pipeline.planning.scale.search import search
    from pipeline.planning.scale.transformer import parse_spec

    started, cpu, load = time.perf_counter(), time.process_time(), _load()
    plan = search(Job(parse_spec(ONE_T), TARGETS["a100-sxm4-80gb"], 3072, 3072))
    best = plan.candidates[0]
    return {"seconds": time.perf_counter() - started, "cpu_s": time.process_time() - cpu,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "simulated": plan.simulated, "rejected": sum(plan.rejected.values()),
            "best": best.layout.describe(), "best_step_s": best.step_time,
            "load": [load, _load()]}


def _one_process() -> dict[str, Any]:
    return {name: _run(name, None, False) for name in SCHEDULES}


def _err(want: float, got: float) -> str:
    return f"{want / got - 1:+.1%}"


def _loads(values: list[float]) -> str:
    return "-".join(f"{v:.1f}" for v in values)


def _local_rows(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    rows = ["| schedule | wall s | predicted step s | error | process CPU s | predicted "
            "busy s (ranks summed) | error | load |", "|---|---|---|---|---|---|---|---|"]
    for name, g in got.items():
        w = want[name]
        busy = sum(w["busy_s"])
        rows.append(f"| {name} | {g['step_s']:.4f} | {w['step_s']:.4f} | "
                    f"{_err(w['step_s'], g['step_s'])} | {g['cpu_s']:.4f} | {busy:.4f} | "
                    f"{_err(busy, g['cpu_s'])} | {_loads(g['load'])} |")
    return rows


def _dist_rows(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    rows = ["| schedule | wall s (rank 0) | predicted step s | error | CPU s per rank "
            "| predicted busy s | errors | load |", "|---|---|---|---|---|---|---|---|"]
    for name, ranks in got.items():
        w, stage = want[name], [r % P for r in range(len(ranks))]
        cpu = ", ".join(f"{r['cpu_s']:.4f}" for r in ranks)
        busy = ", ".join(f"{w['busy_s'][s]:.4f}" for s in stage)
        errors = ", ".join(_err(w["busy_s"][s], r["cpu_s"])
                           for s, r in zip(stage, ranks, strict=True))
        rows.append(
            f"| {name} | {ranks[0]['step_s']:.4f} | {w['step_s']:.4f} | "
            f"{_err(w['step_s'], ranks[0]['step_s'])} | "
            f"{cpu} | {busy} | {errors} | "
            f"{_loads(ranks[0]['load'])} |")
    return rows


def _memory_rows(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    rows = ["| schedule | rank | step peak adds (heap) MiB | predicted step peak MiB (grads, "
            "held, working, p2p) | error | state (heap) MiB | predicted weights MiB | error |",
            "|---|---|---|---|---|---|---|---|"]
    mib = 2**20
    for name, ranks in got.items():
        w = want[name]
        for r, g in enumerate(ranks):
            part = w["step_parts"][r]
            split = ", ".join(f"{part[k] / mib:.1f}" for k in ("gradients", "activations",
                                                               "recompute", "buffers"))
            rows.append(
                f"| {name} | {r} | {g['heap_step_added'] / mib:.2f} | "
                f"{w['step_bytes'][r] / mib:.2f} ({split}) | "
                f"{_err(w['step_bytes'][r], g['heap_step_added'])}"
                f" | {g['heap_state'] / mib:.2f} | {w['state_bytes'][r] / mib:.2f} | "
                f"{_err(w['state_bytes'][r], g['heap_state'])} |")
    return rows


def main() -> None:
    torch.set_num_threads(1)
    from pipeline.facade.runtime_cost import runtime_cost
    from pipeline.planning.hardware.local import measured as microbenchmark

    figures, runtime = microbenchmark(), runtime_cost()
    one_t = _plan_one_t()
    local = _one_process()
    pp = gather(__file__, P)
    dp = gather(__file__, 2 * P, "--dp")
    want_pp = _predicted(runtime, P, list(SCHEDULES))
    want_dp = _predicted(runtime, 2 * P, [DP_SCHEDULE])
    report = "\n".join([
        "# Planning at scale: the CPU target and a 1T-parameter plan", "",
        f"Host {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}. Model "
        f"{SPEC}, fp32, batch {BATCH}, pp={P}, m={M}, 1 thread per rank. Load averages "
        "(1 min) at the start and end of each measurement are in the tables.", "",
        "CPU target constants, microbenchmarked (no step fitted): GEMM "
        f"{figures['fp32']['gemm'] / 1e9:.1f} GFLOP/s fp32, copy "
        f"{figures['fp32']['bandwidth'] / 1e9:.1f} GB/s, floor "
        f"{figures['fp32']['floor'] * 1e6:.1f} us, attention "
        f"{figures['fp32']['attention'] / 1e9:.1f} GFLOP/s, gloo send "
        f"{figures['gloo']['p2p_latency'] * 1e6:.0f} us + "
        f"{figures['gloo']['p2p_bandwidth'] / 1e9:.2f} GB/s; the runtime "
        f"{runtime['action'] * 1e6:.0f} us of CPU per action and "
        f"{runtime['step'] * 1e3:.2f} ms per step (near-zero-compute pipeline on gloo).", "",
        "One process (local executor, pp=2):", "", *_local_rows(local, want_pp), "",
        "torchrun, gloo, pp=2 (2 processes):", "", *_dist_rows(pp, want_pp), "",
        "torchrun, gloo, pp=2 x dp=2 (4 processes; ranks 0-3, pipeline rank = rank % 2):", "",
        *_dist_rows(dp, want_dp), "",
        "Memory per process under torchrun pp=2 (heap in use, glibc mallinfo2):", "",
        *_memory_rows(pp, want_pp), "",
        f"1T GPT ({ONE_T}) on 3072 x a100-sxm4-80gb, batch 3072: searched in "
        f"{one_t['seconds']:.1f} s wall ({one_t['cpu_s']:.1f} s of CPU; load "
        f"{_loads(one_t['load'])}), peak RSS {one_t['peak_rss_gib']:.2f} GiB; "
        f"{one_t['simulated']} simulated, {one_t['rejected']} rejected; best "
        f"{one_t['best']} at {one_t['best_step_s']:.1f} s per step.",
    ])
    write_results("target", {"local": local, "pp": pp, "dp": dp, "predicted_pp": want_pp,
                             "predicted_dp": want_dp, "microbenchmark": figures,
                             "runtime": runtime, "one_t": one_t}, report)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker()
    else:
        main()
