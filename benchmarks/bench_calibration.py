"""Benchmark: how close the simulator's predicted step is to the measured one, for every
schedule, in the local executor (threads) and the distributed executor (2 gloo processes),
with profiled costs and with costs calibrated from measured traces (pipeline.planning.calibration).

Two models: an 8-block MLP-transformer stack (dim 256) and a model no one here wrote, a
Hugging Face GPT-2 built from a small config (4 layers, width 128, 64 tokens, tied embedding;
no download). Per model and schedule (p=2, m=8; 1 thread per rank; default balance="profile"):
one warm-up step, then CAL_STEPS steps whose traces calibrate the cost model and
MEASURED_STEPS held-out steps whose median trace step time is "measured", taking turns (so both
see the machine as it is). Errors are predicted / measured - 1.
Writes benchmarks/results/calibration.{md,json}.

Run: .venv/bin/python benchmarks/bench_calibration.py   (it launches its own 2 processes;
BENCH_STEPS=N sets both step counts, BENCH_MODELS=mlp or gpt2 runs one model)
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from launch import gather, hand_back
from report import write_results
from torch import nn
from torch.nn import functional as F

P, M = 2, 8
CAL_STEPS = MEASURED_STEPS = int(os.environ.get("BENCH_STEPS", "15"))
Case = tuple[nn.Module, Any, torch.Tensor, Callable[[Any, torch.Tensor], torch.Tensor]]


def _mlp() -> Case:
    from pipeline.app.models import mlp_stack

    model = mlp_stack(blocks=8, dim=256)
    return model, torch.randn(64, 256), torch.randn(64, 256), F.mse_loss


def _lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out["logits"]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _gpt2() -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=512, n_positions=64, n_embd=128, n_layer=4, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                        eos_token_id=0)
    ids, target = torch.randint(0, 512, (16, 64)), torch.randint(0, 512, (16, 64))
    return GPT2LMHeadModel(config), {"input_ids": ids}, target, _lm_loss


# name -> (description, a fresh model (seeded by the caller), its batch and loss)
MODELS: dict[str, tuple[str, Callable[[], Case]]] = {
    "mlp": ("mlp_stack(blocks=8, dim=256), batch 64", _mlp),
    "gpt2": ("Hugging Face GPT2LMHeadModel (4 layers, width 128, 4 heads, vocab 512, tied "
             "embedding), batch 16 x 64 tokens", _gpt2),
}
CHOSEN = [m for m in os.environ.get("BENCH_MODELS", ",".join(MODELS)).split(",") if m]


def measure_all(model_name: str) -> dict[str, dict[str, float]]:
    """Profiled and calibrated predictions against held-out measured steps, per schedule
    (on a distributed run, every process calls this; rank 0's figures are complete)."""
    from pipeline import Pipeline
    from pipeline.planning.calibration import calibrated_costs, held_out_check
    from pipeline.planning.costs import predict
    from scheduler import SCHEDULES

    rows = {}
    for name in SCHEDULES:
        # A fresh model each time: under torch.distributed a Pipeline empties the stages
        # other processes hold.
        torch.manual_seed(0)
        model, x, y, loss_fn = MODELS[model_name][1]()
        pipe = Pipeline(model, P, schedule=name, microbatches=M, loss_fn=loss_fn)
        check = held_out_check(pipe, x, y, CAL_STEPS, MEASURED_STEPS)
        if check is None:
            continue
        # The model before per-step prediction: one step predicted from each figure's median.
        cal = check.calibration
        of_medians = predict(pipe.schedule, calibrated_costs(cal, pipe.profiled_costs()),
                             latency=cal.latency, overhead=cal.overhead, spread=cal.spread)
        rows[name] = {
            "measured_s": check.measured,
            "profiled_s": check.profiled,
            "calibrated_s": check.calibrated,
            "profiled_error": check.profiled_error,
            "calibrated_error": check.calibrated_error,
            "overhead_s": check.calibration.overhead,
            "latency_s": check.calibration.latency,
            "step_noise": check.step_noise,
            "remeasured_error": check.remeasured_error,
            "median_figures_error": of_medians.step_time / check.measured - 1.0,
            "fit_error": check.fit_error,
        }
    return rows


def _worker() -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = {model: measure_all(model) for model in CHOSEN}
    if dist.get_rank() == 0:
        hand_back(rows)
    dist.destroy_process_group()


def _distributed() -> dict[str, dict[str, dict[str, float]]]:
    rows: dict[str, dict[str, dict[str, float]]] = gather(__file__, P, timeout=1800)
    return rows


def table(rows: dict[str, dict[str, float]]) -> list[str]:
    """Markdown rows: measured, profiled and calibrated predictions with their errors."""
    ms = 1e3
    lines = [
        "| schedule | measured ms | predicted, profiled ms (error) | predicted, calibrated ms "
        "(error) | step noise | re-measured | median figures | calibrated vs its steps | "
        "overhead ms/action | latency ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['measured_s'] * ms:.1f} | {r['profiled_s'] * ms:.1f} "
            f"({r['profiled_error']:+.1%}) | {r['calibrated_s'] * ms:.1f} "
            f"({r['calibrated_error']:+.1%}) | +-{r['step_noise']:.1%} | "
            f"{r['remeasured_error']:+.1%} | {r['median_figures_error']:+.1%} | "
            f"{r['fit_error']:+.1%} | "
            f"{r['overhead_s'] * ms:.2f} | "
            f"{r['latency_s'] * ms:.2f} |"
        )
    return lines


def main() -> None:
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    local = {model: measure_all(model) for model in CHOSEN}
    distributed = _distributed()
    meta = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cpus": os.cpu_count(), "load_average_start": load,
        "load_average_end": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "models": {m: MODELS[m][0] for m in CHOSEN}, "ranks": P, "microbatches": M,
        "calibration_steps": CAL_STEPS, "measured_steps": MEASURED_STEPS,
    }
    lines = [
        "# Predicted vs measured step time, every schedule",
        "",
        f"p={P}, m={M}, balance=\"profile\", 1 thread per rank, on {meta['cpus']} shared CPUs "
        f"(1-min load average {load:.1f} at the start, {meta['load_average_end']:.1f} at the "
        f"end; {meta['date']}). Per model and schedule: 1 warm-up step, then {CAL_STEPS} "
        f"calibration steps and {MEASURED_STEPS} held-out steps taking turns; the median of "
        "the held-out steps' traces is \"measured\"; step noise = half their interquartile "
        "range over that median. Calibrated = the median of the steps predicted from each "
        "calibration step (pipeline.planning.calibration.predict_calibrated); median figures = "
        "one step "
        "predicted from each figure's median over the calibration steps (the model before, "
        "same traces); re-measured = the calibration steps' own median measured step (the "
        "error of predicting by measuring again: the floor this machine's noise sets). Errors "
        "are against \"measured\", but \"calibrated vs its steps\": the calibrated "
        "prediction against the calibration steps' own median (the model's error without the "
        "noise between two sets of steps). "
        "Command: `.venv/bin/python benchmarks/bench_calibration.py`.",
    ]
    for model in CHOSEN:
        worst = {(kind, key): max(abs(r[key]) for r in rows[model].values())
                 for kind, rows in (("local", local), ("distributed", distributed))
                 for key in ("calibrated_error", "remeasured_error", "median_figures_error",
                             "fit_error")}
        lines += [
            "", f"## {MODELS[model][0]}",
            "", "### Local executor (one thread per rank)", "", *table(local[model]),
            "", "### Distributed executor (2 processes, gloo)", "", *table(distributed[model]),
            "", "Largest error, local / distributed: calibrated "
            f"{worst['local', 'calibrated_error']:.1%} / "
            f"{worst['distributed', 'calibrated_error']:.1%}; median figures "
            f"{worst['local', 'median_figures_error']:.1%} / "
            f"{worst['distributed', 'median_figures_error']:.1%}; re-measured "
            f"{worst['local', 'remeasured_error']:.1%} / "
            f"{worst['distributed', 'remeasured_error']:.1%}; calibrated vs its steps "
            f"{worst['local', 'fit_error']:.1%} / {worst['distributed', 'fit_error']:.1%}.",
        ]
    write_results("calibration", {"meta": meta, "local": local, "distributed": distributed},
                  "\n".join(lines))


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker()
    else:
        main()
