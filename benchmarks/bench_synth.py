"""Benchmark: schedules synthesised from costs (scheduler.synthesize) against the hand-written
generators, side by side in one run.

1. Simulated, random profiles (T_W < T_F < T_B per stage as the Zero Bubble paper counts
   for transformer layers; "head": heavy embedding stage 0 and head stage p-1; optional
   transfer latency): the synthesised step against the best generator that fits the same
   in-flight limit (1F1B's p-r, ZB-H1's p, ZB-H2's 2p-1, and p/2 where none fits) and
   against `scheduler.lower_bound` (the gap), with the search's seconds.
2. Measured, p=2, m=8, one thread per rank: the demo model (GPT, vocab 256, dim 160, 6 layers)
   and an uneven one (GPT, vocab 8192, dim 96, 2 layers: the embedding and the LM head carry
   most of the work), local executor (threads) and distributed (2 gloo processes under
   torchrun). zb-h1 runs CAL_STEPS steps; from its calibration (measured action times,
   overhead per action, latency) schedules are synthesised within 1F1B's memory (p-r on rank
   r), ZB-H1's (p) and ZB-H2's (2p-1). Then per executor, on the same stage sizes, zb-h1
   runs CAL_STEPS steps whose calibration predicts every schedule (one step of mean actions,
   pipeline.planning.costs.predict), and synth, zb-h1, zb-h2 and 1f1b take turns for
   MEASURED_STEPS steps (measured = median trace makespan).

Writes benchmarks/results/synth.{md,json}.
Run: .venv/bin/python benchmarks/bench_synth.py   (BENCH_STEPS=N sets both step counts)
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from launch import gather, hand_back
from report import RESULTS, write_results
from torch.nn import functional as F

P, M = 2, 8
CAL_STEPS = MEASURED_STEPS = int(os.environ.get("BENCH_STEPS", "8"))
GENERATORS = ("zb-h1", "zb-h2", "1f1b")
MODELS = {
    "demo": ("demo GPT (vocab 256, dim 160, 6 layers, 4 heads), batch 16 x 64 tokens",
             dict(vocab=256, dim=160, layers=6, heads=4, max_seq=64)),
    "uneven": ("embedding/head-heavy GPT (vocab 8192, dim 96, 2 layers, 4 heads), batch 16 x "
               "64 tokens", dict(vocab=8192, dim=96, layers=2, heads=4, max_seq=64)),
}


# ------------------------------------------------------------------------------ 1. simulated


def _profile(rng: random.Random, kind: str, p: int) -> tuple[list[float], ...]:
    """F, B, W per stage: 0.8-1.2 with B 1.1-1.4 x F and W 0.6-0.9 x F; "head" also makes
    the embedding's forward 1.2-2 x and the head's 1.5-2.5 x heavier."""
    f = [rng.uniform(0.8, 1.2) for _ in range(p)]
    b = [x * rng.uniform(1.1, 1.4) for x in f]
    w = [x * rng.uniform(0.6, 0.9) for x in f]
    if kind == "head":
        f[0] *= rng.uniform(1.2, 2.0)
        for costs in (f, b, w):
            costs[-1] *= rng.uniform(1.5, 2.5)
    return f, b, w


def _limits(p: int) -> dict[str, list[int]]:
    """In-flight limits per rank: 1F1B's own (p - r), ZB-H1's (p), ZB-H2's (2p-1), and half
    of ZB-H1's (no generator fits: against the lower bound only)."""
    return {"1F1B (p-r)": [p - r for r in range(p)], "p": [p] * p, "2p-1": [2 * p - 1] * p,
            "p/2": [p // 2] * p}


def simulated() -> list[dict[str, Any]]:
    from scheduler import build_schedule, lower_bound, simulate, synthesize

    rng = random.Random(0)
    rows = []
    for kind in ("head", "mild"):
        for p, m in ((4, 16), (8, 32)):
            f, b, w = _profile(rng, kind, p)
            for comm in (0.0, 0.2):
                for label, limit in _limits(p).items():
                    best = ("none fits", float("inf"))
                    for name in ("gpipe", "1f1b", "1f1b-eager", "zb-h1", "zb-h2"):
                        timeline = simulate(build_schedule(name, p, m), f, b, w, comm)
                        fits = all(x <= y for x, y in zip(timeline.peak_inflight, limit,
                                                          strict=True))
                        if fits and timeline.step_time < best[1]:
                            best = (name, timeline.step_time)
                    started = time.perf_counter()
                    schedule = synthesize(p, m, f, b, w, comm, memory_limit=limit)
                    seconds = time.perf_counter() - started
                    step = simulate(schedule, f, b, w, comm).step_time
                    bound = lower_bound(p, m, f, b, w, comm)
                    rows.append({
                        "profile": kind, "p": p, "m": m, "limit": label, "comm": comm,
                        "best_generator": best[0], "generator_step": best[1],
                        "synth_step": step, "lower_bound": bound, "seconds": seconds,
                        "gain": 1 - step / best[1] if best[0] != "none fits" else None,
                        "synth_gap": step / bound - 1,
                        "generator_gap": best[1] / bound - 1 if best[0] != "none fits" else None,
                    })
    return rows


# ------------------------------------------------------------------------------- 2. measured


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, vocab, (16, 64), generator=g),
            torch.randint(0, vocab, (16, 64), generator=g))


def _lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.size(-1)), target.reshape(-1))


def _pipe(model_name: str, schedule: Any, balance: Any) -> Any:
    from pipeline import Pipeline
    from pipeline.app.models import GPT

    torch.manual_seed(0)
    model = GPT(**MODELS[model_name][1])
    return Pipeline(model, P, schedule=schedule, microbatches=M, loss_fn=_lm_loss,
                    balance=balance, capture_method="fx")


def _take_turns(pipes: dict[str, Any], x: torch.Tensor, y: torch.Tensor,
                steps: int) -> dict[str, dict[str, float]]:
    """Every pipe steps once per round (1 warm-up round first); per pipe the median trace
    makespan and the median wall time of a step (trace None: not rank 0, left out)."""
    traces: dict[str, list[float]] = {n: [] for n in pipes}
    walls: dict[str, list[float]] = {n: [] for n in pipes}
    for i in range(steps + 1):
        for name, pipe in pipes.items():
            pipe.zero_grad()
            started = time.perf_counter()
            pipe.step(x, y)
            wall = time.perf_counter() - started
            if i > 0 and pipe.trace is not None:
                traces[name].append(pipe.trace.step_time)
                walls[name].append(wall)
    return {n: {"measured_s": statistics.median(traces[n]), "wall_s": statistics.median(walls[n])}
            for n in pipes if traces[n]}


SYNTH_LIMITS = {"1F1B": [P - r for r in range(P)], "ZB-H1": [P] * P, "ZB-H2": [2 * P - 1] * P}


def calibrate_and_synthesize(model_name: str) -> dict[str, Any]:
    """On a zb-h1 pipe of this model: its stage sizes, profiled costs, and the schedules
    synthesised from its calibration within 1F1B's, ZB-H1's and ZB-H2's memory."""
    from pipeline.planning.synthesis import propose_schedule

    x, y = _batch(MODELS[model_name][1]["vocab"])
    zb = _pipe(model_name, "zb-h1", "profile")
    _take_turns({"zb-h1": zb}, x, y, CAL_STEPS)
    profiled = zb.profiled_costs()
    synth = {f"synth ({label} memory)": propose_schedule(zb.schedule, zb.calibration, profiled,
                                                         limits)[1].to_text()
             for label, limits in SYNTH_LIMITS.items()}
    return {"sizes": zb.plan.sizes, "synth": synth, "profiled": asdict(profiled)}


def _from_text(text: str) -> Any:
    from scheduler import Schedule

    return Schedule.from_text(text, name="synth")


def measure(model_name: str, setup: dict[str, Any]) -> dict[str, Any]:
    """Every schedule on the same stage sizes: zb-h1 runs CAL_STEPS steps alone, and its
    calibration predicts every schedule; then all take turns for MEASURED_STEPS steps (each
    process of a distributed run calls this; rank 0's figures are complete)."""
    from pipeline.planning.calibration import calibrated_costs
    from pipeline.planning.costs import StageCosts, predict

    x, y = _batch(MODELS[model_name][1]["vocab"])
    pipes = {n: _pipe(model_name, n, setup["sizes"]) for n in GENERATORS}
    pipes.update({k: _pipe(model_name, _from_text(v), setup["sizes"])
                  for k, v in setup["synth"].items()})
    _take_turns({"zb-h1": pipes["zb-h1"]}, x, y, CAL_STEPS)
    cal = pipes["zb-h1"].calibration
    predicted = None
    if cal is not None:
        costs = calibrated_costs(cal, StageCosts(**setup["profiled"]))
        predicted = {n: predict(pipe.schedule, costs, latency=cal.latency,
                                overhead=cal.overhead).step_time for n, pipe in pipes.items()}
    measured = _take_turns(pipes, x, y, MEASURED_STEPS)
    return {"predicted": predicted, "measured": measured,
            "overhead_s": cal.overhead if cal else None,
            "latency_s": cal.latency if cal else None}


def _worker(setup_file: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    setups = json.loads(Path(setup_file).read_text())
    rows = {name: measure(name, setup) for name, setup in setups.items()}
    if dist.get_rank() == 0:
        hand_back(rows)
    dist.destroy_process_group()


# --------------------------------------------------------------------------------- report


def _simulated_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| profile | p | m | in-flight limit | comm | best generator (step) | synth step | "
             "gain | lower bound | synth gap | generator gap | search s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fits = r["gain"] is not None
        lines.append(
            f"| {r['profile']} | {r['p']} | {r['m']} | {r['limit']} | {r['comm']} | "
            + (f"{r['best_generator']} ({r['generator_step']:.2f})" if fits else "none fits")
            + f" | {r['synth_step']:.2f} | " + (f"{r['gain']:+.1%}" if fits else "-")
            + f" | {r['lower_bound']:.2f} | {r['synth_gap']:.1%} | "
            + (f"{r['generator_gap']:.1%}" if fits else "-") + f" | {r['seconds']:.2f} |")
    lines.append("")
    for label in _limits(4):
        some = [r for r in rows if r["limit"] == label]
        fit = [r for r in some if r["gain"] is not None]
        text = (f"gain over the best fitting generator mean "
                f"{statistics.fmean(r['gain'] for r in fit):+.1%}, max "
                f"{max(r['gain'] for r in fit):+.1%}; generator gap mean "
                f"{statistics.fmean(r['generator_gap'] for r in fit):.1%}; " if fit
                else "no generator fits; ")
        lines.append(f"- limit {label}: {text}synth gap to the lower bound mean "
                     f"{statistics.fmean(r['synth_gap'] for r in some):.1%}.")
    lines += ["", f"Longest search: {max(r['seconds'] for r in rows):.2f} s (p=8, m=32). The "
              "lower bound ignores memory, so under a tight limit part of the gap is the "
              "limit's own cost."]
    return lines


def _measured_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    ms = 1e3
    lines = ["| schedule | " + " | ".join(
        f"{w} predicted ms | {w} measured ms (error) | {w} wall ms" for w in runs) + " |",
        "|---|" + "---|---|---|" * len(runs)]
    for name in runs["local"]["measured"]:
        cells = []
        for run in runs.values():
            pred, got = run["predicted"][name], run["measured"][name]
            cells.append(f"{pred * ms:.1f} | {got['measured_s'] * ms:.1f} "
                         f"({pred / got['measured_s'] - 1:+.1%}) | {got['wall_s'] * ms:.1f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    pairs = (("1F1B", "1f1b"), ("ZB-H1", "zb-h1"), ("ZB-H2", "zb-h2"))
    for where, run in runs.items():
        got, pred = run["measured"], run["predicted"]
        ratios = []
        for label, gen in pairs:
            synth = f"synth ({label} memory)"
            ratios.append(f"{label} {got[synth]['measured_s'] / got[gen]['measured_s']:.3f} "
                          f"(predicted {pred[synth] / pred[gen]:.3f})")
        lines += ["", f"{where} (calibrated overhead {run['overhead_s'] * ms:.2f} ms/action, "
                  f"latency {run['latency_s'] * ms:.2f} ms): measured synth / generator at the "
                  f"same memory: {', '.join(ratios)}."]
    return lines


def main() -> None:
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    sim = simulated()
    setups = {name: calibrate_and_synthesize(name) for name in MODELS}
    local = {name: measure(name, setups[name]) for name in MODELS}
    setup_file = RESULTS / ".bench_synth-setup.json"
    setup_file.write_text(json.dumps(setups))
    try:
        distributed = gather(__file__, P, str(setup_file), timeout=1800)
    finally:
        setup_file.unlink()
    meta = {"python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "load_average_start": load,
            "load_average_end": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "ranks": P, "microbatches": M, "calibration_steps": CAL_STEPS,
            "measured_steps": MEASURED_STEPS}
    lines = [
        "# Synthesised schedules against the generators", "",
        f"{meta['cpus']} shared CPUs, 1-min load average {load:.1f} at the start, "
        f"{meta['load_average_end']:.1f} at the end ({meta['date']}). "
        "Command: `.venv/bin/python benchmarks/bench_synth.py`.", "",
        "## Simulated: random uneven profiles", "",
        "Per stage F 0.8-1.2, B 1.1-1.4 x F, W 0.6-0.9 x F ('mild'); 'head' also has a "
        "heavy embedding (F x1.2-2) and head (F, B, W x1.5-2.5); 'comm' = latency per "
        "cross-rank transfer; the best generator is the fastest of gpipe, 1f1b, 1f1b-eager, "
        "zb-h1, zb-h2 within the limit (per rank); gap = step / lower bound - 1.",
        "", *_simulated_table(sim),
    ]
    for name, (description, _) in MODELS.items():
        lines += ["", f"## Measured: {description}", "",
                  f"p={P}, m={M}, stage sizes {setups[name]['sizes']} (profile-balanced); "
                  f"schedules synthesised from {CAL_STEPS} calibrated zb-h1 steps (local); then "
                  f"per executor {CAL_STEPS} zb-h1 steps whose calibration predicts every "
                  f"schedule, and {MEASURED_STEPS} steps per schedule taking turns (measured = "
                  "median trace makespan; wall = median step call).", "",
                  *_measured_table({"local": local[name], "distributed": distributed[name]})]
    write_results("synth", {"meta": meta, "simulated": sim, "setups": setups, "local": local,
                            "distributed": distributed}, "\n".join(lines))


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker(sys.argv[sys.argv.index("--worker") + 1])
    else:
        main()
