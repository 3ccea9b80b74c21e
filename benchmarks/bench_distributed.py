"""Benchmark: hybridpipe's distributed executor against torch.distributed.pipelining (Schedule1F1B
and ScheduleGPipe, PipelineStage built by hand from the same stage modules; our 1f1b-eager is
set against torch's 1F1B) on 2 gloo ranks with 1 thread each, the runs interleaved step by step
in one launch, for m=8 and m=32 microbatches of 8 and of 16 rows of an 8-block MLP-transformer
stack; plus one process running the same microbatches in sequence, and the analytic ideal T_seq
(m + p - 1) / (m p) (efficiency = ideal / step time); T_seq is also timed with that run on every
rank at once (each on its own copy), as the speed of the work when every core is busy, as in a
pipeline. A second pass with near-zero compute gives the runtime's per-action overhead. Next to
the ratio of medians it reports the per-round ratio torch / hybridpipe (median and quartiles
over rounds: the two runs of a round are steps apart, so drift and other load hit both), since
two ranks on two shared cores make single medians move by about +-10% between runs. Every run's
grads are set to None before each step (outside the timed part), as a training loop's
zero_grad() does: otherwise grads would pile up over steps, and Pipeline.step, which sets
existing grads aside and adds them back so a failed step leaves them untouched, would pay one
extra pass over them that training never pays. Per hybridpipe run it also checks the cost
model: the calibrated prediction against held-out steps (pipeline.planning.calibration).
Writes benchmarks/results/distributed.{md,json}.

Run: .venv/bin/python benchmarks/bench_distributed.py   (it launches its own 2 processes;
BENCH_CASES=compute or BENCH_CASES=near-zero runs one pass only, BENCH_REPEATS sets the rounds)
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from launch import gather, hand_back
from report import write_results
from torch.nn import functional as F

if TYPE_CHECKING:
    from pipeline.planning.costs import StageCosts

P = 2
REPEATS, WARMUP = int(os.environ.get("BENCH_REPEATS", "30")), 3
# Steps of the cost-model check per run, each way (calibration, held out).
CHECK_STEPS = int(os.environ.get("BENCH_CHECK_STEPS", "10"))
# (label, model width, hidden width, rows per microbatch)
CASES = (
    ("compute", 256, 1024, 16),
    ("compute", 256, 1024, 8),
    ("near-zero compute", 8, 8, 16),
)
_LOAD = "load average (1 min) at the end"
# The one-process run on every rank at once: the speed of the work with every core busy, as in
# a pipeline (on this machine two busy cores slow each other by 15-35%: shared L3, memory).
SIDE_BY_SIDE = "one process per core, side by side"
EAGER = "1f1b-eager"
BUSY_IDEAL = "ideal, cores busy"
_LOAD_START = "load average (1 min) at the start"


def _loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    if isinstance(out, tuple):  # a stage module's 1-tuple output
        out = out[0]
    return F.mse_loss(out, target)


def _timed(fn: Callable[[], object]) -> float:
    """One step of `fn` on both ranks, between barriers (so every run pays the same)."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


Run = tuple[Callable[[], object], Callable[[], None]]  # (one step, its zero_grad)
# This case's (Pipeline, x, y, profiled stage costs on rank 0).
PIPES: dict[str, tuple[Any, torch.Tensor, torch.Tensor, StageCosts | None]] = {}


def _fitted(
    pipe: Any, x: torch.Tensor, y: torch.Tensor, costs: StageCosts | None, steps: int = CHECK_STEPS
) -> dict[str, float]:
    """The runtime's own time per action and the transfer latency, fitted by calibration to
    the idle gaps of hybridpipe's measured traces (rank 0 holds the pipeline's trace), and the
    cost model's check: the step predicted from costs calibrated on `steps` steps against the
    median of `steps` held-out steps taking turns with them (empty on other ranks)."""
    from pipeline.planning.calibration import held_out_check

    check = held_out_check(pipe, x, y, steps, steps, costs)
    if check is None:
        return {}
    return {"overhead_s": check.calibration.overhead, "latency_s": check.calibration.latency,
            "measured_s": check.measured, "calibrated_s": check.calibrated,
            "calibrated_error": check.calibrated_error, "step_noise": check.step_noise,
            "remeasured_error": check.remeasured_error}


def _pipeline(schedule: str, dim: int, hidden: int, m: int, x: torch.Tensor) -> Any:
    """A Pipeline on the uniform split (the stages torch's runs get: a profile-balanced split
    of 8 equal blocks moves with timing noise)."""
    from pipeline import Pipeline
    from pipeline.app.models import mlp_stack

    return Pipeline(mlp_stack(blocks=8, dim=dim, hidden=hidden), stages=P, schedule=schedule,
                    microbatches=m, loss_fn=F.mse_loss, balance="uniform", example_input=x)


def _runs(rank: int, dim: int, hidden: int, m: int, rows: int) -> dict[str, Run]:
    """The step functions to compare, over identical models (seed 0) and batch."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from partitioner import capture, partition, profile, split_model
    from pipeline.app.models import mlp_stack
    from pipeline.planning.costs import stage_costs

    torch.manual_seed(0)
    x, y = torch.randn(rows * m, dim), torch.randn(rows * m, dim)
    single = mlp_stack(blocks=8, dim=dim, hidden=hidden)
    xs, ys = torch.tensor_split(x, m), torch.tensor_split(y, m)

    def sequential() -> None:
        if rank == 0:
            for xm, ym in zip(xs, ys, strict=True):
                (F.mse_loss(single(xm), ym) / m).backward()

    torch.manual_seed(0)
    mine = mlp_stack(blocks=8, dim=dim, hidden=hidden)  # each rank's own copy of the model

    def side_by_side() -> None:
        for xm, ym in zip(xs, ys, strict=True):
            (F.mse_loss(mine(xm), ym) / m).backward()

    runs: dict[str, Run] = {"one process": (sequential, single.zero_grad),
                            SIDE_BY_SIDE: (side_by_side, mine.zero_grad)}
    costs: StageCosts | None = None
    for name, cls in (("1f1b", Schedule1F1B), ("gpipe", ScheduleGPipe)):
        pipe = _pipeline(name, dim, hidden, m, x)
        model = mlp_stack(blocks=8, dim=dim, hidden=hidden)
        graph = capture(model, (x[:rows],))
        plan = partition(graph, P, "uniform")
        if costs is None and rank == 0:  # for the cost-model check (a uniform split is not
            # (a uniform split is not profiled by Pipeline; rank 0 checks)
            costs = stage_costs(graph.with_costs(profile(graph, model, (x[:rows],))), plan)
        stages = split_model(graph, plan)
        peer = cls(PipelineStage(stages[rank], rank, P, torch.device("cpu")), m, loss_fn=_loss)
        runs[f"hybridpipe {name}"] = (partial(pipe.step, x, y), pipe.zero_grad)
        PIPES[f"hybridpipe {name}"] = (pipe, x, y, costs)
        peer_step = partial(peer.step, x) if rank == 0 else partial(peer.step, target=y)
        runs[f"torch {name}"] = (peer_step, stages[rank].zero_grad)
    # 1F1B with one more warm-up forward on rank 0 (hides a transfer's latency; torch has no
    # such schedule, so it is compared with torch's 1F1B).
    eager = _pipeline(EAGER, dim, hidden, m, x)
    runs[f"hybridpipe {EAGER}"] = (partial(eager.step, x, y), eager.zero_grad)
    PIPES[f"hybridpipe {EAGER}"] = (eager, x, y, costs)
    return runs


def _peer(run: str) -> str:
    """The torch run a hybridpipe run is compared with (same schedule; 1F1B for the eager one)."""
    return "torch " + run.split()[1].removesuffix("-eager")


def _worker() -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    wanted = os.environ.get("BENCH_CASES", "")
    for label, dim, hidden, rows in CASES:
        if not label.startswith(wanted):
            continue
        for m in (8, 32):
            runs = _runs(rank, dim, hidden, m, rows)
            samples: dict[str, list[float]] = {k: [] for k in runs}
            keys = list(runs)
            for i in range(WARMUP + REPEATS):
                # Interleaved, and rotated each round, so drift and order hit every run alike.
                for key in keys[i % len(keys):] + keys[: i % len(keys)]:
                    step, zero_grad = runs[key]
                    zero_grad()
                    t = _timed(step)
                    if i >= WARMUP:
                        samples[key].append(t)
            barrier = statistics.median(_timed(lambda: None) for _ in range(20))
            med = {k: statistics.median(v) for k, v in samples.items()}
            med["ideal"] = med["one process"] * (m + P - 1) / (m * P)
            med[BUSY_IDEAL] = med[SIDE_BY_SIDE] * (m + P - 1) / (m * P)
            results[f"{label} m={m} rows={rows}"] = {
                "median_s": med, "barrier_s": barrier, "samples_s": samples,
                "actions_per_rank": 2 * m, "dim": dim, "hidden": hidden, "rows": rows,
                "fitted": {k: _fitted(*run) for k, run in PIPES.items()},
                "check_steps": CHECK_STEPS,
            }
            PIPES.clear()
    if rank == 0:
        results[_LOAD] = os.getloadavg()[0]
        hand_back(results)
    dist.destroy_process_group()


def _launch() -> dict[str, Any]:
    data: dict[str, Any] = {_LOAD_START: os.getloadavg()[0]}
    data.update(gather(__file__, P, timeout=1800))
    return data


def _load_note(data: dict[str, Any]) -> str:
    return (f"Machine load average (1 min) at the start of the run: {data[_LOAD_START]:.2f}, at "
            f"the end: {data[_LOAD]:.2f} on {os.cpu_count()} cores (the end reading counts the "
            "benchmark's own two ranks, about 2 of it). Other work on the machine slows both "
            "ranks and the one-process baseline alike only when it leaves each rank a core; "
            "above ~1 at the start, treat the ratios to one process as lower bounds and compare "
            "hybridpipe with torch (interleaved) instead.")


def _paired(res: dict[str, Any], run: str) -> str:
    """Quartiles over rounds of torch's step time / hybridpipe's in the same round."""
    ours, peer = res["samples_s"][run], res["samples_s"][_peer(run)]
    q1, q2, q3 = statistics.quantiles([p / o for o, p in zip(ours, peer, strict=True)], n=4)
    return f"{q2:.2f}x [{q1:.2f}-{q3:.2f}]"


def _report(data: dict[str, Any]) -> str:
    note = _load_note(data)
    lines = [
        "# Distributed executor vs torch.distributed.pipelining",
        "",
        f"2 gloo ranks on one machine, 1 thread each ({platform.processor() or platform.machine()},"
        f" {os.cpu_count()} cores, torch {torch.__version__}); 8-block MLP-transformer stack "
        "(nn.Sequential of residual MLP blocks), same stage modules for both. "
        f"Median of {REPEATS} steps per run, runs interleaved step by step (order "
        "rotated each round); each timed step is bracketed by two barriers (their cost is "
        "listed in the JSON and included in every figure). Grads are set to None before every "
        "step (untimed), as zero_grad() in a training loop. "
        "'ideal' = one process x (m + p - 1) / (m p); 'efficiency' = ideal / step time. "
        f"'{SIDE_BY_SIDE}': every rank runs the one-process step at once on its own copy "
        f"(the work's speed with every core busy, as in a pipeline); '{BUSY_IDEAL}' = that x "
        "(m + p - 1) / (m p), and 'efficiency, cores busy' = it / step time. "
        f"'hybridpipe {EAGER}' (1F1B with one more warm-up forward on rank 0) is compared with "
        "torch's 1F1B (torch has no such schedule). 'per round' = torch's step time / "
        "hybridpipe's in the same round: median [quartiles] over rounds (> 1: hybridpipe "
        "faster).",
        "",
        note,
        "",
        "| case | run | step ms | vs one process | efficiency | efficiency, cores busy "
        "| vs torch (same schedule) | per round |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    cases = {k: v for k, v in data.items() if isinstance(v, dict)}
    for case, res in cases.items():
        med = res["median_s"]
        for run, t in med.items():
            peer = paired = ""
            if run.startswith("hybridpipe"):
                peer = f"{med[_peer(run)] / t:.2f}x faster"
                paired = _paired(res, run)
            lines.append(f"| {case} | {run} | {1e3 * t:.2f} | {med['one process'] / t:.2f}x | "
                         f"{med['ideal'] / t:.2f} | {med[BUSY_IDEAL] / t:.2f} | {peer} | "
                         f"{paired} |")
    lines += ["", "Per-action runtime overhead with near-zero compute: (step time - barrier) / "
              "actions per rank, minus the compute of one action (one process's time / (2 m p)):",
              ""]
    for case, res in cases.items():
        if not case.startswith("near-zero"):
            continue
        med, n = res["median_s"], res["actions_per_rank"]
        compute = med["one process"] / (n * P)
        busy = med[SIDE_BY_SIDE] / (n * P)
        for run in ("hybridpipe 1f1b", f"hybridpipe {EAGER}", "torch 1f1b", "hybridpipe gpipe",
                    "torch gpipe"):
            per = (med[run] - res["barrier_s"]) / n
            lines.append(f"- {case}, {run}: {1e6 * (per - compute):.0f} us per action ("
                         f"{1e6 * (per - busy):.0f} us with the compute timed with cores busy; "
                         f"{n} actions per rank; compute {1e6 * compute:.0f} / {1e6 * busy:.0f} "
                         "us per action)")
    k = next(res["check_steps"] for res in cases.values())
    lines += ["", "The cost model per hybridpipe run "
              "(pipeline.planning.calibration.held_out_check, "
              f"{2 * k} more steps per run: {k} to calibrate on, {k} held out, taking turns): "
              "the runtime's own "
              "time per action (the gap between two actions of a rank that waits for nothing) "
              "and the transfer latency fitted to the idle gaps of the traces, and the step "
              "predicted from the calibrated costs against the held-out steps' median trace "
              "(step noise: half their interquartile range over the median; re-measured: the "
              "calibration steps' own median measured step against it, the error of predicting "
              "by measuring again, i.e. the floor this machine's noise sets):", "",
              "| case | run | overhead us/action | latency us | measured ms | predicted ms "
              "| error | step noise | re-measured |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for case, res in cases.items():
        for run, fit in res["fitted"].items():
            lines.append(f"| {case} | {run} | {1e6 * fit['overhead_s']:.0f} | "
                         f"{1e6 * fit['latency_s']:.0f} | {1e3 * fit['measured_s']:.1f} | "
                         f"{1e3 * fit['calibrated_s']:.1f} | {fit['calibrated_error']:+.1%} | "
                         f"+-{fit['step_noise']:.1%} | {fit['remeasured_error']:+.1%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if "--worker" in sys.argv:
        _worker()
        return
    data = _launch()
    report = _report(data)
    write_results("distributed", data, report, indent=1)


if __name__ == "__main__":
    main()
