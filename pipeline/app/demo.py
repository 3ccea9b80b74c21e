"""The demo (the README's main job): profile and auto-balance a small GPT-style model, compare
the schedules in simulation, train it through `Pipeline` on the Python standard library's own
source text, and write pictures, a Chrome trace and a short report to an output folder."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.api import Pipeline
from pipeline.app.demo_config import DemoConfig
from pipeline.app.models import GPT, TransformerBlock
from pipeline.app.textdata import TokenBatches, stdlib_corpus
from pipeline.planning.autoplan import AutoPlan, search
from pipeline.planning.calibration import Check, held_out_check
from scheduler import SCHEDULES, Timeline, build_schedule
from viz import (
    plot_comparison,
    plot_loss,
    plot_memory,
    plot_partition,
    plot_timeline,
    to_chrome_trace,
)

# Steps per schedule for the cost-model check, calibration and held-out each (taking turns): a
# step moves +-10-15% on a shared CPU: the two medians of 2-3 steps landed up to 17% apart, of 6
# steps up to 10.6%, of 10 steps up to 12.6% (one schedule of eight, in two of four demo runs).
CHECK_STEPS = 20


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over every position (mean-reduced)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _say(message: str) -> None:
    print(message, flush=True)


def compare_schedules(pipe: Pipeline, microbatches: int) -> list[Timeline]:
    """Predict every schedule on this model's profile through `Pipeline.simulate` (the one cost
    adapter; a schedule with more stages than the plan is predicted on the plan the Pipeline
    would make for it)."""
    timelines = []
    for name in SCHEDULES:
        try:
            schedule = build_schedule(name, pipe.stages, microbatches)
        except ValueError as exc:
            _say(f"  {name:<18} skipped: {exc}")
            continue
        timelines.append(pipe.simulate(schedule))
    return timelines


def check_schedules(
    model: torch.nn.Module, example: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
    config: DemoConfig,
) -> list[Check]:
    """`held_out_check` of every schedule on a copy of `model` (the trained one is untouched)."""
    checks = []
    for name in SCHEDULES:
        try:
            build_schedule(name, config.stages, config.microbatches)
        except ValueError:
            continue
        pipe = Pipeline(
            copy.deepcopy(model), config.stages, schedule=name,
            microbatches=config.microbatches, loss_fn=lm_loss, example_input=example,
            leaf_modules=(TransformerBlock,),
        )
        check = held_out_check(pipe, x, y, CHECK_STEPS, CHECK_STEPS)
        if check is not None:
            checks.append(check)
    return checks


def _check_table(checks: list[Check]) -> str:
    rows = [f"  {'schedule':<18}{'measured ms':>12}{'profiled ms':>12}{'error':>8}"
            f"{'calibrated ms':>15}{'error':>8}{'step noise':>12}{'re-measured':>13}"]
    for c in checks:
        rows.append(
            f"  {c.schedule:<18}{1e3 * c.measured:>12.1f}{1e3 * c.profiled:>12.1f}"
            f"{c.profiled_error:>+8.1%}{1e3 * c.calibrated:>15.1f}{c.calibrated_error:>+8.1%}"
            f"{'+-':>6}{c.step_noise:>6.1%}{c.remeasured_error:>+13.1%}"
        )
    return "\n".join(rows)


def _table(timelines: list[Timeline]) -> str:
    rows = [f"  {'schedule':<18}{'step ms':>9}{'bubble':>9}  peak in-flight per rank"]
    for t in timelines:
        rows.append(
            f"  {t.name:<18}{1e3 * t.step_time:>9.2f}{t.bubble_fraction:>9.1%}  "
            f"{' '.join(map(str, t.peak_inflight))}"
        )
    return "\n".join(rows)


def run_demo(out: Path, config: DemoConfig = DemoConfig()) -> dict[str, float]:
    """Run the whole demo, writing its files under `out`; returns the summary figures."""
    threads = torch.get_num_threads()
    # One intra-op thread per stage worker: the stages, not torch's thread pool, use the cores.
    torch.set_num_threads(1)
    try:
        return _run(out, config)
    finally:
        torch.set_num_threads(threads)


def _run(out: Path, config: DemoConfig) -> dict[str, float]:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    batches, held_out = _data(config)
    model = _model(config)
    x0, _ = batches.next()
    pipe = _plan(model, x0, config, out)
    simulated = _simulate_schedules(pipe, config, out)
    training = _train(pipe, model, batches, held_out, config)
    x, y = batches.next()
    checks = _check_cost_model(model, x0, x, y, config)
    planned = _plan_for_8_devices(pipe, model, config)
    _say("8. write pictures, trace and report")
    summary = _write_results(out, pipe, training, checks)
    (out / "report.md").write_text(_report(config, pipe, simulated, summary, checks, planned))
    return summary


def _data(config: DemoConfig) -> tuple[TokenBatches, TokenBatches]:
    """Training and held-out batches of the standard library's source text."""
    _say("1. data: byte-level tokens from the Python standard library's source files")
    corpus = stdlib_corpus()
    batches = TokenBatches(corpus, config.batch_size, config.seq_len, seed=config.seed)
    held_out = TokenBatches(corpus, config.batch_size, config.seq_len, seed=config.seed + 1)
    _say(f"   {corpus.numel():,} tokens; batches of {config.batch_size} x {config.seq_len}")
    return batches, held_out


def _model(config: DemoConfig) -> GPT:
    model = GPT(
        vocab=256, dim=config.dim, layers=config.layers, heads=config.heads, max_seq=config.seq_len
    )
    n_params = sum(p.numel() for p in model.parameters())
    _say(f"2. model: GPT, {config.layers} layers, dim {config.dim}, {n_params:,} parameters")
    return model


def _plan(model: GPT, x0: torch.Tensor, config: DemoConfig, out: Path) -> Pipeline:
    """The Pipeline, profiled and balanced on the first batch; its partition drawn."""
    _say(f"3. profile and auto-balance into {config.stages} stages")
    pipe = Pipeline(
        model, stages=config.stages, schedule=config.schedule,
        microbatches=config.microbatches, loss_fn=lm_loss, balance="profile", example_input=x0,
        leaf_modules=(TransformerBlock,),
    )
    _say(str(pipe.plan))
    plot_partition(pipe.plan, out / "partition.png", graph=pipe.graph)
    return pipe


def _simulate_schedules(pipe: Pipeline, config: DemoConfig, out: Path) -> list[Timeline]:
    _say(f"4. simulate the schedules on the profiled costs ({config.microbatches} microbatches)")
    simulated = compare_schedules(pipe, config.microbatches)
    _say(_table(simulated))
    plot_comparison(simulated, [t.name for t in simulated], out / "schedules.png", unit="s")
    return simulated


@dataclass(frozen=True)
class Training:
    """What the training run measured: per step its loss, its time with the optimizer's and
    the pipeline step's alone (from its trace); the held-out loss before and after."""

    losses: list[float]
    step_times: list[float]
    trace_times: list[float]
    held_out_before: float
    held_out_after: float


def _train(
    pipe: Pipeline, model: GPT, batches: TokenBatches, held_out: TokenBatches,
    config: DemoConfig,
) -> Training:
    _say(f"5. train {config.steps} steps with schedule {pipe.schedule.name!r}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    # Linear warm-up over 5% of the steps, then cosine decay: smoother than a constant rate.
    warmup = max(1, config.steps // 20)
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda k: min(1.0, (k + 1) / warmup) * 0.5 * (1.0 + math.cos(math.pi * k / config.steps)),
    )
    losses: list[float] = []
    step_times: list[float] = []
    trace_times: list[float] = []
    before = _evaluate(pipe, held_out)
    for step in range(config.steps):
        x, y = batches.next()
        started = time.perf_counter()
        loss = pipe.step(x, y)
        optimizer.step()
        lr_schedule.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - started)
        trace_times.append(pipe.trace.step_time if pipe.trace is not None else 0.0)
        losses.append(float(loss))
        if step % 25 == 0 or step == config.steps - 1:
            _say(f"   step {step:>4}  loss {losses[-1]:.3f}  {1e3 * step_times[-1]:.0f} ms")
    return Training(losses, step_times, trace_times, before, _evaluate(pipe, held_out))


def _check_cost_model(
    model: GPT, x0: torch.Tensor, x: torch.Tensor, y: torch.Tensor, config: DemoConfig
) -> list[Check]:
    _say(f"6. check the cost model on every schedule: predicted (profiled, calibrated on "
         f"{CHECK_STEPS} steps) vs measured (median of {CHECK_STEPS} held-out steps)")
    checks = check_schedules(model, x0, x, y, config)
    _say(_check_table(checks))
    return checks


def _plan_for_8_devices(pipe: Pipeline, model: GPT, config: DemoConfig) -> AutoPlan:
    """The auto-planner's ranking for 8 devices under a memory cap that forces a pipeline."""
    # A cap under one device's weights + grads + Adam state.
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    limit = 0.75 * 4 * param_bytes
    _say(f"7. plan 8 devices for this model (hybridpipe plan), memory limit "
         f"{limit / 2**20:.1f} MiB per device, all-reduce at 10 GB/s: ranked by predicted step")
    planned = search(
        pipe.captured, world_size=8, batch_size=8 * config.batch_size,
        profiled_batch=config.batch_size // config.microbatches, memory_limit=limit,
        dp_bandwidth=1e10,
    )
    _say(planned.table(8))
    return planned


def _write_results(
    out: Path, pipe: Pipeline, training: Training, checks: list[Check]
) -> dict[str, float]:
    """The pictures, the Chrome trace and summary.json; returns the summary figures."""
    measured = pipe.trace
    if measured is None:
        raise RuntimeError("the pipeline recorded no trace")
    predicted = pipe.simulate()  # calibrated on the last steps' traces
    profiled = pipe.simulate(calibrated=False)
    # Compared with the median of the steps it was calibrated on, not the last one alone
    # (one step is +-10% off the median here on noise).
    calibrated_on = pipe.calibration.steps if pipe.calibration is not None else 1
    plot_timeline(
        measured, out / "timeline_measured.png", unit="s", title=f"measured: {pipe.schedule.name}"
    )
    plot_comparison(
        [predicted, measured], ["predicted", "measured"], out / "predicted_vs_measured.png",
        unit="s",
    )
    # The measured trace held in bytes: each (stage, microbatch) at its profiled activations.
    sized = dataclasses.replace(measured, activation=tuple(pipe.profiled_costs().activation_bytes))
    plot_memory(sized, out / "memory.png", unit="s")
    to_chrome_trace(measured, out / "trace.json")
    losses = training.losses
    plot_loss(losses, out / "loss.png", title="training loss (stdlib source, bytes)")
    summary = {
        "loss_first": losses[0],
        "loss_last": sum(losses[-10:]) / len(losses[-10:]),
        "held_out_before": training.held_out_before,
        "held_out_after": training.held_out_after,
        "step_time_s": sorted(training.step_times)[len(training.step_times) // 2],
        "trace_step_time_s": statistics.median(training.trace_times[-calibrated_on:]),
        "trace_steps": calibrated_on,
        "predicted_step_time_s": predicted.step_time,
        "predicted_profiled_step_time_s": profiled.step_time,
        "worst_calibrated_error": max((abs(c.calibrated_error) for c in checks), default=0.0),
        "worst_remeasured_error": max((abs(c.remeasured_error) for c in checks), default=0.0),
        "measured_bubble": measured.bubble_fraction,
        "predicted_bubble": predicted.bubble_fraction,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


@torch.no_grad()
def _evaluate(pipe: Pipeline, batches: TokenBatches, count: int = 4) -> float:
    """Mean held-out loss over `count` batches, forward only through the pipeline."""
    generator_state = batches.generator.get_state()
    total = 0.0
    for _ in range(count):
        x, y = batches.next()
        total += float(lm_loss(pipe(x), y))
    batches.generator.set_state(generator_state)
    return total / count


def _report(
    config: DemoConfig, pipe: Pipeline, simulated: list[Timeline], s: dict[str, float],
    checks: list[Check], planned: AutoPlan,
) -> str:
    return "\n".join(
        [
            "# hybridpipe demo report",
            "",
            f"GPT ({config.layers} layers, dim {config.dim}) trained {config.steps} steps on"
            f" byte-level text from the Python standard library, {config.stages} pipeline"
            f" stages on CPU,"
            f" schedule `{pipe.schedule.name}`, {config.microbatches} microbatches of"
            f" {config.batch_size // config.microbatches} sequences.",
            "",
            "## Plan",
            "",
            "```",
            str(pipe.plan),
            "```",
            "",
            "## Schedules simulated on the profiled costs",
            "",
            "```",
            _table(simulated),
            "```",
            "",
            "## The cost model per schedule: predicted vs measured",
            "",
            f"Calibrated on {CHECK_STEPS} steps' traces (pipeline.planning.calibration), "
            "measured = "
            f"median of {CHECK_STEPS} held-out steps taking turns with them; error = predicted / "
            "measured - 1; step noise = half the interquartile range of the held-out steps over "
            "their median (one step's scatter on this machine); re-measured = the calibration "
            "steps' own median measured step / measured - 1 (two medians of the same run's "
            "steps: the error of predicting by measuring again, the floor the machine's noise "
            "sets for any cost model).",
            "",
            "```",
            _check_table(checks),
            "```",
            "",
            "## Plan for 8 devices (`hybridpipe plan`)",
            "",
            "```",
            planned.table(8),
            "```",
            "",
            *_training_table(s),
            "Files: partition.png, schedules.png, timeline_measured.png, predicted_vs_measured.png,"
            " memory.png, loss.png, trace.json (open in https://ui.perfetto.dev), summary.json.",
            "",
        ]
    )


def _training_table(s: dict[str, float]) -> list[str]:
    """The report's training section (lines), from the summary figures."""
    return [
        "## Training",
        "",
        "| figure | value |",
        "|---|---|",
        f"| loss, first step | {s['loss_first']:.3f} |",
        f"| loss, mean of last 10 steps | {s['loss_last']:.3f} |",
        f"| held-out loss before / after | {s['held_out_before']:.3f} /"
        f" {s['held_out_after']:.3f} |",
        f"| median step time (incl. optimizer) | {1e3 * s['step_time_s']:.1f} ms |",
        f"| step, measured (median of the last {s['trace_steps']} traces) | "
        f"{1e3 * s['trace_step_time_s']:.1f} ms |",
        f"| step, predicted (calibrated on them / profiled) | "
        f"{1e3 * s['predicted_step_time_s']:.1f} / "
        f"{1e3 * s['predicted_profiled_step_time_s']:.1f} ms |",
        f"| bubble measured / predicted | {s['measured_bubble']:.1%} /"
        f" {s['predicted_bubble']:.1%} |",
        "",
    ]


def run_main(out: str = "out", config: DemoConfig = DemoConfig()) -> int:
    """Run the demo into folder `out` and print where its files are and a one-line summary."""
    folder = Path(out)
    started = time.perf_counter()
    s = run_demo(folder, config)
    _say(f"\nwrote {', '.join(sorted(p.name for p in folder.iterdir()))} to {folder.resolve()}/")
    _say(
        f"summary: loss {s['loss_first']:.3f} -> {s['loss_last']:.3f} (held-out "
        f"{s['held_out_before']:.3f} -> {s['held_out_after']:.3f}); step "
        f"{1e3 * s['trace_step_time_s']:.1f} ms measured (median of the last {s['trace_steps']} "
        f"traces) vs {1e3 * s['predicted_step_time_s']:.1f} ms predicted (calibrated on them); "
        f"held-out, worst per-schedule calibrated error "
        f"{s['worst_calibrated_error']:.1%} (re-measured {s['worst_remeasured_error']:.1%}); "
        f"demo took {time.perf_counter() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_main())
