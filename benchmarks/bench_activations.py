"""Benchmark: activation policies per stage (``checkpoint_activations=``) at pp=4 with 1F1B on
CPU, on the demo GPT and a Llama-style stack (Hugging Face LlamaForCausalLM, small config).

For each model and policy ("none", "full", "selective", "offload", and "auto" under a memory
limit that "none" exceeds):
- each pipeline rank's peak of held activation bytes, counted by the runtime
  (``pipe.count_saved_activations()``: the tensors autograd saves, each storage once, through
  ``torch.autograd.graph.saved_tensors_hooks``) and as the planner predicts it (the policies'
  prices measured per block, partitioner.activation_cost, at the schedule's peak);
- the step time: the median of interleaved timed steps (every policy timed once per round, so
  a busy machine slows them alike), after a warm-up step, without the counting (its hooks
  cost time: the bytes are counted in one more step);
- the predicted step: the simulator's, from costs calibrated on the traces of the even
  rounds (pipeline.planning.calibration, as bench_calibration.py does), against the median
  traced step of the odd rounds (held out; what the cost model predicts): calibrated on the
  policy's own steps, and on the "none" steps with the policy's price added as the planner
  adds it (pipeline.planning.costs.with_policies).
The memory limit is per device, parameters x 4 (weights, grads, Adam's two moments)
included: half of rank 0's "none" activations above its parameters, and at least what every
rank needs under "full". Also per transformer block: the bytes "selective" and "full" keep
over "none"'s, and the matmul and attention FLOPs each recomputes, from the planner's
measurements.

On a CPU device "offload" moves nothing (the host is the device): it runs as "none". With
BENCH_DEVICE=cuda every stage runs on cuda:0 (streams, events and copies as on four GPUs),
"offload" moves the saved tensors to pinned host memory, and each policy's step also reports
the CUDA allocator's peak (all four stages together: one device).

Writes benchmarks/results/activations.{md,json} (activations_cuda.* on CUDA).
Run: .venv/bin/python benchmarks/bench_activations.py   (a few minutes on 2 cores;
BENCH_ROUNDS=N timed rounds, default 9; BENCH_DEVICE=cuda on a GPU)
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from report import write_results
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline import Pipeline  # noqa: E402
from pipeline.app.models import GPT  # noqa: E402
from pipeline.planning.activation_plan import peaks  # noqa: E402
from pipeline.planning.calibration import (  # noqa: E402
    calibrate,
    calibrated_costs,
    predict_calibrated,
)
from pipeline.planning.costs import stage_costs, with_policies  # noqa: E402
from scheduler import Timeline  # noqa: E402

STAGES, MICROBATCHES, ROWS, SEQ, VOCAB = 4, 8, 16, 64, 256
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "9"))
DEVICE = torch.device(os.environ.get("BENCH_DEVICE", "cpu"))
POLICIES = ("none", "full", "selective", "offload")
MIB = 2**20


def gpt() -> nn.Module:
    return GPT(vocab=VOCAB, dim=128, layers=8, heads=4, max_seq=SEQ)


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=352, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _pipe(model: nn.Module, x: torch.Tensor, policy: str, limit: float | None) -> Pipeline:
    devices = [str(DEVICE)] * STAGES if DEVICE.type == "cuda" else None
    return Pipeline(model, STAGES, schedule="1f1b", microbatches=MICROBATCHES, loss_fn=lm_loss,
                    example_input=x, checkpoint_activations=policy, memory_limit=limit,
                    devices=devices)


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def _allocator_peak(pipe: Pipeline, model: nn.Module, x: torch.Tensor, y: torch.Tensor
                    ) -> float | None:
    """The CUDA allocator's peak bytes over one step (None on CPU)."""
    if DEVICE.type != "cuda":
        return None
    model.zero_grad(set_to_none=True)
    _sync()
    torch.cuda.reset_peak_memory_stats(DEVICE)
    pipe.step(x, y)
    _sync()
    return float(torch.cuda.max_memory_allocated(DEVICE))


def _fixed(pipe: Pipeline) -> list[float]:
    return [4.0 * b for b in pipe.plan.stage_params]


def _block_ratios(pipe: Pipeline, prefix: str) -> dict[str, float]:
    """Over the transformer blocks: bytes kept by "selective" and "full" over "none"'s."""
    priced = [pipe.captured.costs[v].policies for v in pipe.captured.order
              if v.startswith(prefix)]
    blocks = [p for p in priced if p is not None and p.kept["none"]]
    none = sum(p.kept["none"] for p in blocks)
    full_flops = sum(p.recompute_flops["full"] for p in blocks)
    return {"blocks": len(blocks),
            "selective_over_none": sum(p.kept["selective"] for p in blocks) / none,
            "full_over_none": sum(p.kept["full"] for p in blocks) / none,
            "recompute_flops_selective_over_full": sum(
                p.recompute_flops["selective"] for p in blocks) / full_flops}


def _predicted_steps(roomy: Pipeline, pipes: dict[str, Pipeline],
                     traces: dict[str, list[Timeline]]) -> dict[str, dict[str, float]]:
    """Per policy the simulator's step from costs calibrated on the even rounds' traces, in
    two ways: "own" (its own steps: the calibrated model under the policy) and "from_none"
    (the "none" steps, with the policy's price added as the planner adds it), with the
    median traced step of the odd rounds (held out) they predict. The stage costs are of
    each pipe's own partition (the units' measurements are the same capture's)."""
    schedule = roomy.schedule
    calibrations = {p: calibrate(schedule, t[0::2]) for p, t in traces.items()}
    predicted: dict[str, dict[str, float]] = {}
    for p, pipe in pipes.items():
        policies = pipe.plan.activations if p == "auto" else [p] * STAGES
        assert policies is not None
        profiled = stage_costs(roomy.captured, pipe.plan)
        own = predict_calibrated(schedule, calibrations[p],
                                 lambda step, c=profiled: calibrated_costs(step, c))  # type: ignore[misc]
        from_none = predict_calibrated(
            schedule, calibrations["none"],
            lambda step, c=profiled, ps=policies: with_policies(  # type: ignore[misc]
                calibrated_costs(step, c), ps))
        # Paired by round: the "none" step just before predicts this policy's step, so the
        # machine's drift between rounds (other jobs) cancels.
        paired = [predict_calibrated(
            schedule, calibrate(schedule, [before]),
            lambda step, c=profiled, ps=policies: with_policies(  # type: ignore[misc]
                calibrated_costs(step, c), ps)).step_time
            / after.step_time - 1 for before, after in zip(traces["none"], traces[p],
                                                            strict=True)]
        predicted[p] = {"held_out": statistics.median(t.step_time for t in traces[p][1::2]),
                        "own": own.step_time, "from_none": from_none.step_time,
                        "paired_error": statistics.median(paired)}
    return predicted


def run_model(name: str, build: Any, block_prefix: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = build()
    x = torch.randint(0, VOCAB, (ROWS, SEQ)).to(DEVICE)
    y = torch.randint(0, VOCAB, (ROWS, SEQ)).to(DEVICE)
    started = time.perf_counter()
    roomy = _pipe(model, x, "auto", 1e15)  # prices every policy; chooses "none"
    plan_seconds = time.perf_counter() - started
    prices = stage_costs(roomy.captured, roomy.plan).prices
    assert prices is not None
    predicted = {p: peaks(roomy.schedule, prices, [p] * STAGES) for p in POLICIES}
    fixed = _fixed(roomy)
    limit = max(fixed[0] + 0.5 * predicted["none"][0],
                *(f + a for f, a in zip(fixed, predicted["full"], strict=True)))
    pipes = {p: _pipe(model, x, p, None) for p in POLICIES}
    pipes["auto"] = _pipe(model, x, "auto", limit)
    times: dict[str, list[float]] = {p: [] for p in pipes}
    traces: dict[str, list[Timeline]] = {p: [] for p in pipes}
    for pipe in pipes.values():  # warm-up
        model.zero_grad(set_to_none=True)
        pipe.step(x, y)
    for _ in range(ROUNDS):
        for p, pipe in pipes.items():
            model.zero_grad(set_to_none=True)
            _sync()
            start = time.perf_counter()
            pipe.step(x, y)
            _sync()
            times[p].append(time.perf_counter() - start)
            assert pipe.trace is not None
            traces[p].append(pipe.trace)
    predicted_steps = _predicted_steps(roomy, pipes, traces)
    allocator = {p: _allocator_peak(pipe, model, x, y) for p, pipe in pipes.items()}
    # Counted in a step of its own: the counting hooks cost time the timed steps do not pay.
    meters = {p: pipe.count_saved_activations() for p, pipe in pipes.items()}
    for pipe in pipes.values():
        model.zero_grad(set_to_none=True)
        pipe.step(x, y)
    auto_plan = pipes["auto"].plan
    rows = {}
    for p in pipes:
        measured = [meters[p][r].peak for r in range(STAGES)]
        pred = list(auto_plan.activation_peaks or []) if p == "auto" else predicted[p]
        rows[p] = {
            "measured_peak_bytes": measured,
            "predicted_peak_bytes": pred,
            "worst_prediction_error": max(abs(a - b) / a for a, b in zip(measured, pred,
                                                                           strict=True) if a),
            "device_peak_bytes": [f + a for f, a in zip(fixed, measured, strict=True)],
            "fits_limit": all(f + a <= limit for f, a in zip(fixed, measured, strict=True)),
            "step_seconds": statistics.median(times[p]),
            "step_seconds_all": times[p],
            "traced_step_seconds_held_out": predicted_steps[p]["held_out"],
            "predicted_step_seconds_own": predicted_steps[p]["own"],
            "predicted_step_seconds_from_none": predicted_steps[p]["from_none"],
            "paired_step_error_from_none": predicted_steps[p]["paired_error"],
            "cuda_allocator_peak_bytes": allocator[p],
        }
    return {"model": name, "parameters": sum(t.numel() for t in model.parameters()),
            "memory_limit": limit, "fixed_bytes": fixed, "auto_policies": auto_plan.activations,
            "plan_seconds_with_pricing": plan_seconds,
            "block_ratios": _block_ratios(roomy, block_prefix), "policies": rows}


def _where() -> str:
    if DEVICE.type == "cuda":
        return f"one {torch.cuda.get_device_name(DEVICE)} (every stage on it)"
    return f"{platform.machine()} CPU"


def _vs(predicted: float, measured: float) -> str:
    return f"{1e3 * predicted:.0f} ms ({predicted / measured - 1:+.1%})"


def _report(results: list[dict[str, Any]]) -> str:
    lines = [
        f"# Activation policies per stage (pp=4, 1F1B, 8 microbatches, {_where()})",
        "",
        f"Batch {ROWS} x {SEQ} tokens, fp32, {STAGES} stages on {_where()} "
        f"({torch.get_num_threads()} intra-op thread(s)); step: median of {ROUNDS} interleaved "
        "steps. Peaks: activation bytes each rank holds for its backward (measured: counted by "
        "the runtime; predicted: the planner's prices at the schedule's peak). Limit: bytes per "
        "device, parameters x 4 included. Step ms: wall clock around `pipe.step`, median of all "
        "rounds; traced, held out: the median trace step time (what the cost model predicts) "
        "of the odd rounds; predicted (error against it): the simulator with costs "
        "calibrated on the even rounds' traces, of the policy's own steps, and of the "
        "\"none\" steps plus the policy's priced cost (the planner's view before running it; "
        "recomputation at the stage's measured speed); paired: the median over rounds of the "
        "error of that prediction from the round's own \"none\" step against the round's "
        "step of the policy (the machine's drift between rounds cancels). A calibration "
        "scales the simulated step by the measured step over the one its own figures "
        "simulate (`Calibration.scale`: 4 rank threads share 2 cores here, the simulator "
        "gives each a core), so the paired \"none\" is exact by construction and the paired "
        "column of a policy is the error of its price alone.",
        "",
    ]
    for res in results:
        full_t = res["policies"]["full"]["step_seconds"]
        auto_t = res["policies"]["auto"]["step_seconds"]
        lines += [
            f"## {res['model']} ({res['parameters'] / 1e6:.2f} M parameters)",
            "",
            f"memory limit {res['memory_limit'] / MIB:.2f} MiB per device; \"auto\" chose "
            f"{', '.join(res['auto_policies'])} for stages 0..3",
            "",
            "| policy | peak held per rank, measured (MiB) | predicted (MiB) | worst error "
            "| fits the limit | step ms | traced, held out | predicted: own calibration "
            "| from \"none\" + price | same, paired by round |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for p, row in res["policies"].items():
            held = row["traced_step_seconds_held_out"]
            meas = ", ".join(f"{b / MIB:.2f}" for b in row["measured_peak_bytes"])
            pred = ", ".join(f"{b / MIB:.2f}" for b in row["predicted_peak_bytes"])
            lines.append(f"| {p} | {meas} | {pred} | {row['worst_prediction_error']:.1%} | "
                         f"{'yes' if row['fits_limit'] else 'no'} | "
                         f"{1e3 * row['step_seconds']:.0f} | "
                         f"{1e3 * held:.0f} | {_vs(row['predicted_step_seconds_own'], held)} | "
                         f"{_vs(row['predicted_step_seconds_from_none'], held)} | "
                         f"{row['paired_step_error_from_none']:+.1%} |")
        peaks_line = ", ".join(f"{p} {row['cuda_allocator_peak_bytes'] / MIB:.1f} MiB"
                               for p, row in res["policies"].items()
                               if row["cuda_allocator_peak_bytes"] is not None)
        ratios = res["block_ratios"]
        lines += [
            "",
            f"\"auto\" vs uniform \"full\": {1e3 * auto_t:.0f} ms vs {1e3 * full_t:.0f} ms a "
            f"step ({(full_t - auto_t) / full_t:+.1%} time saved).",
            f"Per transformer block ({ratios['blocks']} blocks): \"selective\" keeps "
            f"{ratios['selective_over_none']:.1%} of \"none\"'s bytes, \"full\" "
            f"{ratios['full_over_none']:.1%}; \"selective\" recomputes "
            f"{ratios['recompute_flops_selective_over_full']:.1%} of the matmul and attention "
            "FLOPs \"full\" recomputes.",
            "The priced cost alone (\"from none + price\" over \"own calibration\": the same "
            "simulator, so the machine's drift between the rounds and the calibrated model's own "
            "error cancel): " + ", ".join(
                f"{p} {row['predicted_step_seconds_from_none'] / row['predicted_step_seconds_own'] - 1:+.1%}"  # noqa: E501
                for p, row in res["policies"].items() if p != "none") + ".",
            f"Planning with the policies priced: {res['plan_seconds_with_pricing']:.1f} s.",
            "",
        ]
        if peaks_line:
            lines += [f"CUDA allocator peak over one step (all stages): {peaks_line}.", ""]
    return "\n".join(lines)


def main() -> None:
    torch.set_num_threads(1)
    results = [run_model("demo GPT (8 layers, dim 128)", gpt, "blocks_"),
               run_model("Llama-style (HF LlamaForCausalLM, 8 layers, hidden 128)", llama,
                         "model_layers_")]
    name = "activations" if DEVICE.type == "cpu" else f"activations_{DEVICE.type}"
    write_results(name, {"device": str(DEVICE), "stages": STAGES, "microbatches": MICROBATCHES,
                                  "rows": ROWS, "seq": SEQ, "rounds": ROUNDS,
                                  "results": results}, _report(results))


if __name__ == "__main__":
    main()
