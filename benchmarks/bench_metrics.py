"""What measuring the per-step metrics costs a step (pipe.metrics, pipeline.facade.metrics).

A transformers GPT-2 config (2 layers, 64 wide, sequence 64) in Pipeline(stages=2,
microbatches=4) on CPU, steps alternating between metrics recorded and not (the recording
replaced by a no-op), so both see the same machine load; besides, the recording itself timed
alone. The one-time FLOP count (fake tensors, at the first figure that needs it) is timed
apart. Writes benchmarks/results/metrics.md and .json.

    python benchmarks/bench_metrics.py [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from report import write_results
from torch.nn import functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from pipeline.api import Pipeline
from pipeline.facade.metrics import FlopCount


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.reshape(-1, out.logits.size(-1)), target.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    steps = parser.parse_args().steps
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    pipe = Pipeline(GPT2LMHeadModel(config), stages=2, microbatches=4, loss_fn=lm_loss)
    x = torch.randint(0, 512, (8, 64))
    for _ in range(3):  # warm-up (plan, first steps)
        pipe.step(x, x)
    recorder = pipe._metrics
    record = recorder.after_step
    alone: list[float] = []

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = record(*args, **kwargs)
        alone.append(time.perf_counter() - start)
        return result

    on: list[float] = []
    off: list[float] = []
    for i in range(2 * steps):
        measured = i % 2 == 0
        recorder.after_step = timed if measured else (lambda *a, **k: None)  # type: ignore
        start = time.perf_counter()
        pipe.step(x, x)
        (on if measured else off).append(time.perf_counter() - start)
    recorder.after_step = record  # type: ignore[method-assign]
    fresh = FlopCount()
    decision = pipe._setup.require_plan()
    fresh.snapshot(decision.captured.graph_module, decision.example)
    start = time.perf_counter()
    fresh.per_unit()
    count_s = time.perf_counter() - start
    figures = pipe.metrics
    assert figures is not None
    data = {
        "steps_each": steps,
        "step_ms_with_metrics": 1e3 * statistics.median(on),
        "step_ms_without": 1e3 * statistics.median(off),
        "record_ms": 1e3 * statistics.median(alone),
        "record_share_of_step": statistics.median(alone) / statistics.median(off),
        "flop_count_once_s": count_s,
        "last_line": figures.line(),
    }
    report = "\n".join([
        "# Per-step metrics: what measuring costs a step",
        "",
        "`python benchmarks/bench_metrics.py` (GPT-2 config 2x64, seq 64, batch 8,",
        "Pipeline(stages=2, microbatches=4), CPU, 1 intra-op thread; steps alternate between",
        f"metrics on and off, {steps} each; medians).",
        "",
        "| | ms |",
        "|---|---|",
        f"| step, metrics recorded | {data['step_ms_with_metrics']:.2f} |",
        f"| step, not recorded | {data['step_ms_without']:.2f} |",
        f"| the recording alone | {data['record_ms']:.4f} |",
        "",
        f"Recording is {100 * data['record_share_of_step']:.3f}% of a step. The FLOP count, once "
        f"per Pipeline at the first figure that needs it: {count_s:.2f} s.",
        "",
        f"Last line: `{data['last_line']}`",
        "",
    ])
    write_results("metrics", data, report)


if __name__ == "__main__":
    main()
