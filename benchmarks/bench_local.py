"""Benchmark: the local executor (one thread per pipeline rank) against one thread running the
same microbatches in sequence, and against the simulator's prediction from profiled costs, on an
MLP-transformer stack with >= 10 ms of compute per microbatch per stage (p=2, m=8). A second,
near-zero-compute run measures the per-action cost the runtime pays in Python, where the GIL
serialises the threads. Writes benchmarks/results/local.{md,json}.

Run: .venv/bin/python benchmarks/bench_local.py
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from report import write_results
from torch.nn import functional as F

from pipeline import Pipeline
from pipeline.app.models import mlp_stack
from scheduler import Op, Timeline, simulate

RANKS, MICROBATCHES = 2, 8
SCHEDULES = ["1f1b", "gpipe", "zb-h1"]
WARMUP, STEPS = 2, 7


def _best_time(fn: Callable[[], object], steps: int = STEPS) -> tuple[float, list[float]]:
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    # The best step is the one least disturbed by other jobs on the shared machine.
    return min(times), times


def _sequential(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """One thread, same microbatches, same loss weighting: the baseline the pipeline beats."""
    xs, ys = torch.tensor_split(x, MICROBATCHES), torch.tensor_split(y, MICROBATCHES)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        for xm, ym in zip(xs, ys, strict=True):
            (F.mse_loss(model(xm), ym) * (xm.shape[0] / x.shape[0])).backward()

    return step


class _Sleep(torch.autograd.Function):
    """Stands in for compute that releases the GIL: forward sleeps `f` s, backward `b` s."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, f: float, b: float) -> torch.Tensor:
        ctx.b = b
        time.sleep(f)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.b)
        return grad, None, None


class SleepStage(torch.nn.Module):
    def __init__(self, f: float, b: float) -> None:
        super().__init__()
        self.f, self.b = f, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.f, self.b)


def _sleep_case(f: float = 0.010, b: float = 0.020) -> dict[str, Any]:
    """Each stage's forward sleeps f and backward b: the ranks' overlap without CPU contention,
    so the gap to the simulator is the executor's own cost."""
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8), SleepStage(f, b), torch.nn.Linear(8, 8), SleepStage(f, b)
    )
    x, y = torch.randn(2 * MICROBATCHES, 8), torch.randn(2 * MICROBATCHES, 8)
    seq_time, _ = _best_time(_sequential(model, x, y))
    case: dict[str, Any] = {
        "forward_s": f,
        "backward_s": b,
        "sequential_s": seq_time,
        "schedules": {},
    }
    for name in ("1f1b", "gpipe"):
        pipe = Pipeline(
            model,
            RANKS,
            schedule=name,
            microbatches=MICROBATCHES,
            loss_fn=F.mse_loss,
            balance=[2, 2],
            leaf_modules=(SleepStage,),
            example_input=x,
        )

        def step(pipe: Pipeline = pipe) -> None:
            model.zero_grad(set_to_none=True)
            pipe.step(x, y)

        pipe_time, _ = _best_time(step)
        predicted = simulate(pipe.schedule, f, b).step_time
        case["schedules"][name] = {
            "step_s": pipe_time,
            "predicted_s": predicted,
            "speedup_vs_sequential": seq_time / pipe_time,
            "ideal_speedup": RANKS * MICROBATCHES / (MICROBATCHES + RANKS - 1),
            "measured_over_predicted": pipe_time / predicted,
        }
    return case


def _control(dim: int, micro: int, blocks: int) -> float:
    """Speedup of two threads running independent copies of one stage's forward+backward over
    one thread running both: what this machine allows two threads right now."""
    torch.manual_seed(0)
    models = [mlp_stack(blocks=blocks // RANKS, dim=dim) for _ in range(RANKS)]
    x = torch.randn(micro, dim)

    def work(model: torch.nn.Module) -> None:
        torch.set_num_threads(1)
        for _ in range(MICROBATCHES):
            model(x).sum().backward()

    def serial() -> None:
        for model in models:
            work(model)

    def threaded() -> None:
        threads = [threading.Thread(target=work, args=(m,)) for m in models]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)

    return _best_time(serial, 3)[0] / _best_time(threaded, 3)[0]


def _mean_durations(trace: Timeline, stages: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for op in (Op.F, Op.B, Op.W):
        per_stage = []
        for s in range(stages):
            d = [e.duration for e in trace.events if e.stage == s and e.op is op]
            per_stage.append(statistics.mean(d) if d else 0.0)
        out[op.value] = per_stage
    return out


def _run_case(dim: int, micro: int, blocks: int, profile: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = mlp_stack(blocks=blocks, dim=dim)
    x = torch.randn(micro * MICROBATCHES, dim)
    y = torch.randn(micro * MICROBATCHES, dim)
    seq_time, seq_all = _best_time(_sequential(model, x, y))
    case: dict[str, Any] = {
        "model": f"mlp_stack(blocks={blocks}, dim={dim})",
        "microbatch": micro,
        "batch": micro * MICROBATCHES,
        "ranks": RANKS,
        "microbatches": MICROBATCHES,
        "sequential_s": seq_time,
        "sequential_all_s": seq_all,
        "schedules": {},
    }
    for name in SCHEDULES:
        pipe = Pipeline(
            model,
            RANKS,
            schedule=name,
            microbatches=MICROBATCHES,
            loss_fn=F.mse_loss,
            balance="profile" if profile else "uniform",
            devices=["cpu"] * RANKS,
            example_input=x,
        )

        traces: list[Timeline] = []

        def step(pipe: Pipeline = pipe, traces: list[Timeline] = traces) -> None:
            model.zero_grad(set_to_none=True)
            pipe.step(x, y)
            if pipe.trace is not None:
                traces.append(pipe.trace)

        pipe_time, pipe_all = _best_time(step)
        trace = traces[WARMUP + pipe_all.index(pipe_time)]  # the best step's own trace
        measured = _mean_durations(trace, pipe.schedule.num_stages)
        row: dict[str, Any] = {
            "step_s": pipe_time,
            "all_s": pipe_all,
            "speedup_vs_sequential": seq_time / pipe_time,
            "ideal_speedup": RANKS * MICROBATCHES / (MICROBATCHES + RANKS - 1),
            "measured_bubble": trace.bubble_fraction,
            "busy_s": sum(e.duration for e in trace.events),
            "actions": len(trace.events),
            "mean_action_s": measured,
            "plan_sizes": pipe.plan.sizes,
        }
        if profile:
            predicted = pipe.simulate(calibrated=False)  # the profiled costs alone
            row["predicted_step_s"] = predicted.step_time
            row["measured_over_predicted"] = pipe_time / predicted.step_time
            row["predicted_bubble"] = predicted.bubble_fraction
            # The same schedule simulated with the action times measured in this run: the gap
            # to the measured step is waiting and handoff cost, not compute.
            replay = simulate(pipe.schedule, measured["F"], measured["B"], measured["W"])
            row["replayed_step_s"] = replay.step_time
            # The calibrated model (pipe.simulate: the steps the Pipeline keeps, here the last
            # 4) against the median of those steps' traces (held out: bench_calibration.py).
            calibrated_on = pipe.calibration.steps if pipe.calibration is not None else 0
            kept = [t.step_time for t in traces[-calibrated_on:]]
            row["calibrated_step_s"] = pipe.simulate().step_time
            row["calibrated_on_median_s"] = statistics.median(kept)
            row["calibrated_error"] = row["calibrated_step_s"] / statistics.median(kept) - 1.0
        case["schedules"][name] = row
    return case


def main() -> None:
    torch.set_num_threads(1)  # one core per rank thread: the threads give the parallelism
    load_before = os.getloadavg()[0]
    sleep = _sleep_case()
    control = _control(dim=512, micro=64, blocks=8)
    heavy = _run_case(dim=512, micro=64, blocks=8, profile=True)
    heavy["two_thread_control_speedup"] = control
    light = _run_case(dim=16, micro=2, blocks=8, profile=False)
    # Does the GIL's switch interval (5 ms default: how long a waiting thread may wait while
    # the other runs Python) explain the Python-bound cost? Rerun with 0.1 ms to see.
    default_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        light_fast = _run_case(dim=16, micro=2, blocks=8, profile=False)
    finally:
        sys.setswitchinterval(default_interval)
    light["switch_interval_s"] = default_interval
    light["short_switch_interval"] = {
        "switch_interval_s": 1e-4,
        "sequential_s": light_fast["sequential_s"],
        "schedules": {
            name: {"step_s": r["step_s"], "speedup_vs_sequential": r["speedup_vs_sequential"]}
            for name, r in light_fast["schedules"].items()
        },
    }
    meta = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": 1,
        "warmup": WARMUP,
        "steps": STEPS,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
    }
    results = {"meta": meta, "sleep": sleep, "heavy": heavy, "light": light}
    report = _report(meta, sleep, heavy, light)
    write_results("local", results, report)


def _report(
    meta: dict[str, Any], sleep: dict[str, Any], heavy: dict[str, Any], light: dict[str, Any]
) -> str:
    ms = 1e3
    lines = [
        "# Local executor: threads vs one thread vs the simulator",
        "",
        f"Machine: {meta['cpus']} CPUs shared with other jobs (1-min load average "
        f"{meta['load_average_before']:.1f} before, {meta['load_average_after']:.1f} after), "
        f"torch {meta['torch']}, torch threads per rank = 1; best of {meta['steps']} steps "
        f"after {meta['warmup']} warm-up steps ({meta['date']}). "
        "Command: `.venv/bin/python benchmarks/bench_local.py`.",
        "",
        f"## GIL-free stages: forward sleeps {sleep['forward_s'] * ms:.0f} ms, backward "
        f"{sleep['backward_s'] * ms:.0f} ms, p={RANKS}, m={MICROBATCHES}",
        "",
        f"One thread: {sleep['sequential_s'] * ms:.0f} ms per step. Sleep needs no CPU, so this "
        "shows the ranks' overlap and the executor's own cost free of CPU contention.",
        "",
        "| schedule | step ms | predicted ms | measured / predicted | speedup vs 1 thread | "
        "ideal |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in sleep["schedules"].items():
        lines.append(
            f"| {name} | {r['step_s'] * ms:.0f} | {r['predicted_s'] * ms:.0f} | "
            f"{r['measured_over_predicted']:.3f} | {r['speedup_vs_sequential']:.2f}x | "
            f"{r['ideal_speedup']:.2f}x |"
        )
    lines += [
        "",
        f"## Compute-bound: {heavy['model']}, p={RANKS}, m={MICROBATCHES}, "
        f"microbatch {heavy['microbatch']}",
        "",
        f"One thread running the same {MICROBATCHES} microbatches in sequence: "
        f"{heavy['sequential_s'] * ms:.0f} ms per step. Control: two threads running "
        "independent copies of one stage's work are "
        f"{heavy['two_thread_control_speedup']:.2f}x one thread running both (the most this "
        "machine gave two threads during the run).",
        "",
        "| schedule | step ms | speedup vs 1 thread | ideal p*m/(m+p-1) | predicted ms "
        "(profiled costs) | measured / predicted | replay of measured actions ms | "
        "measured bubble | mean F ms (stage 0, 1) | mean B ms | calibrated ms (error) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in heavy["schedules"].items():
        f, b = r["mean_action_s"]["F"], r["mean_action_s"]["B"]
        lines.append(
            f"| {name} | {r['step_s'] * ms:.0f} | {r['speedup_vs_sequential']:.2f}x | "
            f"{r['ideal_speedup']:.2f}x | {r['predicted_step_s'] * ms:.0f} | "
            f"{r['measured_over_predicted']:.2f} | {r['replayed_step_s'] * ms:.0f} | "
            f"{r['measured_bubble']:.2f} | {f[0] * ms:.1f}, {f[1] * ms:.1f} | "
            f"{b[0] * ms:.1f}, {b[1] * ms:.1f} | {r['calibrated_step_s'] * ms:.0f} "
            f"({r['calibrated_error']:+.1%}) |"
        )
    lines += [
        "",
        "Calibrated: `pipe.simulate()` on the costs calibrated from the steps the Pipeline "
        "keeps (its last 4), against the median of those 4 steps' traces (in-sample; "
        "benchmarks/bench_calibration.py checks every schedule on held-out steps).",
        "",
        f"## Near-zero compute: {light['model']}, microbatch {light['microbatch']}",
        "",
        f"One thread: {light['sequential_s'] * ms:.2f} ms per step (with a 0.1 ms GIL switch "
        f"interval: {light['short_switch_interval']['sequential_s'] * ms:.2f} ms).",
        "",
        "| schedule | step ms | speedup vs 1 thread | actions | mean action ms (F, B) | "
        "step ms, GIL switch interval 0.1 ms (default "
        f"{light['switch_interval_s'] * ms:.0f} ms) | speedup then |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in light["schedules"].items():
        f, b = r["mean_action_s"]["F"], r["mean_action_s"]["B"]
        fast = light["short_switch_interval"]["schedules"][name]
        lines.append(
            f"| {name} | {r['step_s'] * ms:.2f} | {r['speedup_vs_sequential']:.2f}x | "
            f"{r['actions']} | {statistics.mean(f) * ms:.2f}, {statistics.mean(b) * ms:.2f} | "
            f"{fast['step_s'] * ms:.2f} | {fast['speedup_vs_sequential']:.2f}x |"
        )
    lines += ["", "## Reading", "", _reading(sleep, heavy, light), ""]
    return "\n".join(lines)


def _reading(sleep: dict[str, Any], heavy: dict[str, Any], light: dict[str, Any]) -> str:
    sr = sleep["schedules"]["1f1b"]
    r = heavy["schedules"]["1f1b"]
    lr = light["schedules"]["1f1b"]
    per_action_ms = lr["step_s"] / max(1, lr["actions"] / RANKS) * 1e3
    replay = r["replayed_step_s"] / r["step_s"]
    if 0.9 <= replay <= 1.1:
        replay_text = (
            "so the executor adds little beyond the actions themselves; the gap to the profiled "
            "prediction is the actions running slower than the profiler's node-by-node timings "
            "(two threads sharing caches and memory bandwidth, plus Python overhead per op). "
        )
    else:
        replay_text = "a poor match: the actions' durations varied with the machine's load. "
    control = heavy["two_thread_control_speedup"]
    control_text = (
        ""
        if control >= 1.5
        else f"During this run the machine had no spare core for a second thread (control "
        f"{control:.2f}x), so the compute-bound figures show contention, not the executor. "
    )
    return (
        f"With GIL-free stage work 1F1B is {sr['speedup_vs_sequential']:.2f}x one thread (ideal "
        f"{sr['ideal_speedup']:.2f}x) and {sr['measured_over_predicted']:.3f}x the simulator's "
        "prediction: the ranks overlap as scheduled. "
        f"On the compute-bound stack 1F1B runs {r['speedup_vs_sequential']:.2f}x one thread "
        f"(ideal {r['ideal_speedup']:.2f}x; the two-thread control got "
        f"{heavy['two_thread_control_speedup']:.2f}x) and takes "
        f"{r['measured_over_predicted']:.2f}x "
        "the simulator's prediction from profiled single-thread costs. Replaying the action "
        "times measured in the run through the simulator gives "
        f"{replay:.2f}x the measured step, " + replay_text + control_text + "Where the GIL costs: "
        "torch releases it inside each kernel, so the two rank threads overlap during matmuls, "
        "but everything in Python (module __call__s, autograd's Python hooks, the runtime's "
        "bookkeeping, queue handoffs) holds it and runs one thread at a time. The near-zero-"
        f"compute run isolates that part: about {per_action_ms:.2f} ms per action on a rank, "
        f"and there the pipeline is {lr['speedup_vs_sequential']:.2f}x the one-thread speed, "
        "i.e. Python-bound work does not overlap: each action takes about twice as long as "
        "alone because every torch op releases the GIL and must win it back from the other "
        "thread (a convoy of thread switches), which a shorter GIL switch interval does not "
        "fix (the 0.1 ms column). The results move with the shared machine's load: compare "
        "the two-thread control, which bounds what any threaded executor could get here."
    )


if __name__ == "__main__":
    main()
