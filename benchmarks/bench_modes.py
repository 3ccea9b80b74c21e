"""What switching train/eval mode and evaluating cost (pipe.eval(), pipe.evaluate; see
pipeline/facade/train_eval.py).

A transformers GPT-2 config (4 layers, 64 wide, dropout 0.1, sequence 64, batch 8) in
Pipeline(stages=2, microbatches=4) on CPU, one process: a training step; the first switch to
eval mode (the model captured once more, on a fake stand-in) with its evaluation; later
evaluations that switch (train step, pipe.eval(), evaluate, pipe.train()) and ones that do not;
the process's peak RSS before and after the switches (no weight is copied). Medians over
--repeats. Writes benchmarks/results/modes.md and .json.

    python benchmarks/bench_modes.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from report import write_results
from torch.nn import functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from pipeline.api import Pipeline


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.reshape(-1, out.logits.size(-1)), target.reshape(-1))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    repeats = parser.parse_args().repeats
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=4, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    pipe = Pipeline(model, stages=2, microbatches=4, loss_fn=lm_loss)
    x = torch.randint(0, 512, (8, 64))
    for _ in range(3):
        pipe.step(x, x)
    step = statistics.median(timed(lambda: pipe.step(x, x)) for _ in range(repeats))
    before = rss_mib()
    pipe.eval()
    first = timed(lambda: pipe.evaluate(x, x))
    staying = statistics.median(timed(lambda: pipe.evaluate(x, x)) for _ in range(repeats))
    forward = statistics.median(
        timed(lambda: torch.no_grad()(pipe.forward)(x)) for _ in range(repeats))
    switching, back = [], []
    for _ in range(repeats):
        pipe.train()
        back.append(timed(lambda: pipe.step(x, x)))
        pipe.eval()
        switching.append(timed(lambda: pipe.evaluate(x, x)))
    pipe.train()
    after = rss_mib()
    data = {
        "step_ms": 1e3 * step,
        "first_switch_and_evaluate_s": first,
        "evaluate_ms": 1e3 * staying,
        "no_grad_forward_ms": 1e3 * forward,
        "switch_to_train_and_step_ms": 1e3 * statistics.median(back),
        "switch_and_evaluate_ms": 1e3 * statistics.median(switching),
        "peak_rss_mib_before": before,
        "peak_rss_mib_after": after,
    }
    report = "\n".join([
        "# Train/eval mode switches and evaluate: what they cost",
        "",
        "`python benchmarks/bench_modes.py` (transformers GPT-2 config 4x64, dropout 0.1, seq 64,",
        f"batch 8, Pipeline(stages=2, microbatches=4), CPU, 1 thread; medians of {repeats}).",
        "",
        "| | |",
        "|---|---|",
        f"| training step | {data['step_ms']:.1f} ms |",
        f"| first pipe.eval() + evaluate (captures the eval graph on meta) | {first:.2f} s |",
        f"| evaluate, staying in eval mode | {data['evaluate_ms']:.1f} ms |",
        f"| pipe(x) under torch.no_grad() | {data['no_grad_forward_ms']:.1f} ms |",
        f"| later pipe.eval() + evaluate (switching code, no capture) | "
        f"{data['switch_and_evaluate_ms']:.1f} ms |",
        f"| later pipe.train() + step (switching code back) | "
        f"{data['switch_to_train_and_step_ms']:.1f} ms |",
        f"| peak RSS before the first switch / after all | {before:.0f} MiB / {after:.0f} MiB |",
        "",
    ])
    write_results("modes", data, report)


if __name__ == "__main__":
    main()
