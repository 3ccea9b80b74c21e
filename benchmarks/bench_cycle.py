"""Benchmark: where a 1F1B step's time goes at p=2. Two gloo ranks with 1 thread each, one
Pipeline per process (as in training), the 8-block MLP stack on a uniform split, m=32, 16 and
8 rows per microbatch. From the measured traces (perf_counter is one clock for both processes)
and the transport's own calls (timed by wrapping them), per rank and microbatch:

- F + B as run in the pipeline, against the same stage modules' F + B run outside it on both
  ranks at once (every core busy, no transport);
- idle time between actions, and the part of it spent inside the transport's send and recv;
- transfer latency: from the end of the action producing a message to the start of the one
  using it, for the uses that waited for nothing else (the receiver was idle);
- minor page faults per step.

And where the step goes by the cost model (pipeline.planning.calibration, calibrated on these steps'
traces): the calibrated prediction, then the same without the transfer latency, without the
runtime's own time per action as well, and with every action at its step's mean as well
(no spread: a rank's slow action holds the other rank up, so variation lengthens a step). Two
bounds: (m + p - 1) x the slower rank's F + B outside the pipeline (the schedule with every
core busy and free transfers; efficiency = it / step) and the same with the F + B measured
inside it. Writes benchmarks/results/cycle.{md,json}.

Run: .venv/bin/python benchmarks/bench_cycle.py   (it launches its own 2 processes;
BENCH_REPEATS sets the measured steps, 12 by default)
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from launch import gather, hand_back
from report import write_results
from torch.nn import functional as F

P, M = 2, 32
REPEATS, WARMUP = int(os.environ.get("BENCH_REPEATS", "12")), 3
CASES = [("compute, 16 rows", 256, 1024, 16), ("compute, 8 rows", 256, 1024, 8)]


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _timed_calls(obj: Any, name: str, into: list[float]) -> None:
    """Replace obj.name by a wrapper that appends each call's duration to `into`."""
    call = getattr(obj, name)

    def wrapper(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return call(*args)
        finally:
            into.append(time.perf_counter() - start)

    setattr(obj, name, wrapper)


def _outside(rank: int, dim: int, hidden: int, x: torch.Tensor,
             y: torch.Tensor) -> Callable[[], tuple[float, float]]:
    """This rank's stage module (same split) run over the step's microbatches outside the
    pipeline; returns a function timing one pass: (median F, median B) in seconds."""
    from partitioner import capture, partition, split_model
    from pipeline.app.models import mlp_stack

    torch.manual_seed(0)
    model = mlp_stack(blocks=8, dim=dim, hidden=hidden)
    xs, ys = torch.tensor_split(x, M), torch.tensor_split(y, M)
    graph = capture(model, (xs[0],))
    stages = split_model(graph, partition(graph, P, "uniform"))
    inputs: list[tuple[torch.Tensor, ...]] = [(xm,) for xm in xs]
    if rank == 1:
        with torch.no_grad():
            inputs = [tuple(stages[0](*xm)) for xm in inputs]
    stage = stages[rank]

    def one_pass() -> tuple[float, float]:
        fs, bs = [], []
        for xm, ym in zip(inputs, ys, strict=True):
            leaves = [t.detach().requires_grad_(True) for t in xm]
            start = time.perf_counter()
            out = stage(*(t.clone() for t in leaves))
            if rank == 1:
                roots, grads = [F.mse_loss(out[0], ym) / M], None
            else:
                roots, grads = list(out), [torch.ones_like(t) for t in out]
            mid = time.perf_counter()
            torch.autograd.backward(roots, grads)
            fs.append(mid - start)
            bs.append(time.perf_counter() - mid)
        stage.zero_grad()
        return statistics.median(fs), statistics.median(bs)

    return one_pass


def _case(rank: int, dim: int, hidden: int, rows: int) -> dict[str, Any]:
    import torch.distributed as dist

    from pipeline import Pipeline
    from pipeline.app.models import mlp_stack

    torch.manual_seed(1)
    x, y = torch.randn(rows * M, dim), torch.randn(rows * M, dim)
    torch.manual_seed(0)
    pipe = Pipeline(mlp_stack(blocks=8, dim=dim, hidden=hidden), stages=P, schedule="1f1b",
                    microbatches=M, loss_fn=F.mse_loss, balance="uniform", example_input=x)
    sends: list[float] = []
    recvs: list[float] = []
    transport = pipe._executor.transport  # noqa: SLF001 - timing its calls
    _timed_calls(transport, "send", sends)
    _timed_calls(transport, "recv", recvs)
    outside = _outside(rank, dim, hidden, x, y)
    steps, faults, traces, alone = [], [], [], []
    for i in range(WARMUP + REPEATS):
        pipe.zero_grad()
        dist.barrier()
        sends.clear()
        recvs.clear()
        before, start = _faults(), time.perf_counter()
        pipe.step(x, y)
        dist.barrier()
        took, faulted = time.perf_counter() - start, _faults() - before
        dist.barrier()
        outside_fb = outside()  # both ranks at once
        if i >= WARMUP:
            steps.append(took)
            faults.append(faulted)
            alone.append(outside_fb)
            traces.append((sum(sends), len(sends), sum(recvs)))
            if pipe.trace is not None:
                traces[-1] += (pipe.trace,)
    mine = {"faults": statistics.median(faults),
            "outside_f": statistics.median(f for f, _ in alone),
            "outside_b": statistics.median(b for _, b in alone),
            "send_s": statistics.median(t[0] for t in traces) / M,
            "sends": traces[0][1],
            "recv_s": statistics.median(t[2] for t in traces) / M,
            "step_s": statistics.median(steps)}
    everyone: list[Any] = [None] * P
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return {}
    timelines = [t[3] for t in traces]
    return {"ranks": everyone, "step_s": statistics.median(steps),
            "traced_s": statistics.median(t.step_time for t in timelines),
            **_from_traces(timelines), "model_s": _model(pipe.schedule, timelines, x[:rows], dim,
                                                         hidden)}


def _model(schedule: Any, timelines: list[Any], sample: torch.Tensor, dim: int,
           hidden: int) -> dict[str, float]:
    """The calibrated prediction of these steps, then with latency, overhead and spread
    taken out one after another (seconds)."""
    from partitioner import capture, partition, profile
    from pipeline.app.models import mlp_stack
    from pipeline.planning.calibration import calibrate, calibrated_costs, predict_calibrated
    from pipeline.planning.costs import stage_costs

    model = mlp_stack(blocks=8, dim=dim, hidden=hidden)
    graph = capture(model, (sample,))
    graph = graph.with_costs(profile(graph, model, (sample,)))
    profiled = stage_costs(graph, partition(graph, P, "uniform"))
    calibration = calibrate(schedule, timelines)

    def predicted(**without: Any) -> float:
        steps = tuple(replace(step, **without) for step in calibration.step_calibrations)
        return predict_calibrated(schedule, replace(calibration, per_step=steps),
                                  lambda step: calibrated_costs(step, profiled)).step_time

    return {"calibrated": predicted(),
            "without latency": predicted(latency=0.0),
            "without overhead": predicted(latency=0.0, overhead=0.0),
            "without spread": predicted(latency=0.0, overhead=0.0, spread=())}


def _from_traces(timelines: list[Any]) -> dict[str, Any]:
    """Per rank: median F and B inside the pipeline, idle per microbatch; the transfer latency
    of messages whose receiver waited for nothing else."""
    inside: list[dict[str, float]] = []
    for rank in range(P):
        fs, bs, idle = [], [], []
        for tl in timelines:
            mine = sorted((e for e in tl.events if e.rank == rank), key=lambda e: e.start)
            fs += [e.duration for e in mine if e.op.name == "F"]
            bs += [e.duration for e in mine if e.op.name == "B"]
            idle.append((tl.step_time - sum(e.duration for e in mine)) / M)
        inside.append({"f": statistics.median(fs), "b": statistics.median(bs),
                       "idle": statistics.median(idle)})
    latency: dict[str, list[float]] = {"activation": [], "gradient": []}
    for tl in timelines:
        at = {(e.rank, e.op.name, e.microbatch): e for e in tl.events}
        ends = {r: sorted(e.end for e in tl.events if e.rank == r) for r in range(P)}
        for mb in range(M):
            for kind, src, dst, op in (("activation", 0, 1, "F"), ("gradient", 1, 0, "B")):
                made, used = at[(src, op, mb)], at[(dst, op, mb)]
                before = [end for end in ends[dst] if end <= used.start]
                if not before or before[-1] <= made.end:  # the receiver was idle for it
                    latency[kind].append(used.start - made.end)
    return {"inside": inside,
            "latency_s": {k: statistics.median(v) if v else None for k, v in latency.items()},
            "latency_uses": {k: len(v) for k, v in latency.items()}}


def _worker() -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {label: _case(rank, dim, hidden, rows) for label, dim, hidden, rows in CASES}
    if rank == 0:
        hand_back(results)
    dist.destroy_process_group()


def _report(meta: dict[str, Any], results: dict[str, Any]) -> str:
    lines = [
        "# Where a 1F1B step goes (p=2, m=32)",
        "",
        f"2 gloo ranks, 1 thread each, one Pipeline per process, mlp_stack(blocks=8) on a uniform "
        f"split; medians over {meta['repeats']} steps after {WARMUP} warm-up ones (1-min load "
        f"average {meta['load_average_start']:.1f} at the start, "
        f"{meta['load_average_end']:.1f} at the end; {meta['date']}). Per rank and microbatch: "
        "F + B inside the pipeline and outside it (the same stage module, both ranks at once, no "
        "transport), idle time between actions and the part of it inside the transport's send "
        "and recv calls. Latency: end of the producing action to start of the using one, where "
        "the receiver waited for nothing else. Step: between two barriers; traced: the first "
        "action's start to the last one's end (the rest is the step's set-up and end: agreeing "
        "on the batch, the loss to every rank, the trace to rank 0). The model predicts the "
        "traced step. Bounds: (m + p - 1) x the slower rank's F + B. "
        "Command: `.venv/bin/python benchmarks/bench_cycle.py`.",
        "",
        "| case | rank | F + B inside ms | F + B outside ms | inside / outside | idle ms | "
        "in send ms | in recv ms | page faults / step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in results.items():
        for rank, (mine, inside) in enumerate(zip(r["ranks"], r["inside"], strict=True)):
            fb_in, fb_out = inside["f"] + inside["b"], mine["outside_f"] + mine["outside_b"]
            lines.append(
                f"| {label} | {rank} | {1e3 * fb_in:.2f} | {1e3 * fb_out:.2f} | "
                f"{fb_in / fb_out:.2f}x | {1e3 * inside['idle']:.2f} | "
                f"{1e3 * mine['send_s']:.3f} | {1e3 * mine['recv_s']:.3f} | "
                f"{mine['faults']:.0f} |")
    lines += ["", "| case | step ms | traced ms | model: calibrated | without latency | without "
              "overhead | without spread | bound, inside compute | bound, outside compute "
              "(efficiency) | latency activation / gradient us |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, r in results.items():
        cycles = M + P - 1
        out = cycles * max(m["outside_f"] + m["outside_b"] for m in r["ranks"])
        inn = cycles * max(i["f"] + i["b"] for i in r["inside"])
        lat = "/".join("-" if v is None else f"{1e6 * v:.0f}" for v in r["latency_s"].values())
        model = " | ".join(f"{1e3 * v:.1f}" for v in r["model_s"].values())
        lines.append(f"| {label} | {1e3 * r['step_s']:.1f} | {1e3 * r['traced_s']:.1f} | "
                     f"{model} | {1e3 * inn:.1f} | "
                     f"{1e3 * out:.1f} ({out / r['step_s']:.2f}) | {lat} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    load = os.getloadavg()[0]
    results = gather(__file__, P, timeout=900)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average_start": load,
            "load_average_end": os.getloadavg()[0], "repeats": REPEATS, "torch": torch.__version__}
    write_results("cycle", {"meta": meta, "cases": results}, _report(meta, results))


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker()
    else:
        main()
