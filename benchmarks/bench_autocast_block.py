"""Benchmark: a model whose whole forward runs under its own ``with torch.autocast(...)`` block
(cut between its modules, every op entering the block itself: partitioner.autocast) against
the same model without the block built with ``mixed_precision=torch.bfloat16`` (one autocast
per stage forward), side by side (steps interleaved, rotated each round) in one process (local
executor, 2 stages, 1F1B, 4 microbatches). The model: a GPT-like stack (embedding, 4
TransformerEncoderLayers of width 128, a vocabulary head), 16 rows x 32 tokens, on CPU. Per way:
the median step time, and the ops run under the block per step (each entering it). Also: one
small op called bare and through `Autocasted`, the cost of entering the block per op.
Writes benchmarks/results/autocast_block.{md,json}.

Run: .venv/bin/python benchmarks/bench_autocast_block.py   (BENCH_REPEATS sets the rounds)
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
from report import write_results
from torch import nn
from torch.nn import functional as F

from partitioner.autocast import Autocasted, Region
from pipeline import Pipeline

REPEATS, WARMUP = int(os.environ.get("BENCH_REPEATS", "10")), 2
VOCAB, DIM, LAYERS, SEQ, ROWS, M = 256, 128, 4, 32, 16, 4


class GPT(nn.Module):
    def __init__(self, block: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = block
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(DIM, 4, 4 * DIM, dropout=0.0, batch_first=True)
            for _ in range(LAYERS)
        )
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.block):
            x = self.tok(idx)
            for layer in self.blocks:
                x = layer(x)
            out = self.head(x)
        return out.float()


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float().flatten(0, 1), target.flatten())


def per_call(fn: Callable[[], object], calls: int = 2000) -> float:
    for _ in range(100):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    y = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    pipes = {
        "block around forward": Pipeline(GPT(True), stages=2, microbatches=M, loss_fn=loss_fn),
        "mixed_precision=bf16": Pipeline(GPT(False), stages=2, microbatches=M, loss_fn=loss_fn,
                                         mixed_precision=torch.bfloat16),
    }
    times: dict[str, list[float]] = {name: [] for name in pipes}
    names = list(pipes)
    for r in range(WARMUP + REPEATS):
        for name in names[r % 2:] + names[: r % 2]:
            start = time.perf_counter()
            pipes[name].step(x, y)
            if r >= WARMUP:
                times[name].append(time.perf_counter() - start)
    block = pipes["block around forward"]
    ops = sum(isinstance(n.target, Autocasted) for s in block.stage_modules
              for n in s.graph.nodes) * M
    median = {name: statistics.median(t) for name, t in times.items()}
    ratio = median["block around forward"] / median["mixed_precision=bf16"]
    small = torch.randn(4, 4)
    relu = torch.ops.aten.relu.default
    wrapped = Autocasted(relu, (Region("cpu", torch.bfloat16, True, True),))
    bare_s, wrapped_s = per_call(lambda: relu(small)), per_call(lambda: wrapped(small))
    data = {
        "config": {"dim": DIM, "layers": LAYERS, "seq": SEQ, "rows": ROWS, "microbatches": M,
                   "stages": 2, "repeats": REPEATS, "torch": torch.__version__,
                   "cpu": platform.processor() or platform.machine()},
        "median_step_s": median, "ops_under_block_per_step": ops,
        "ratio_block_to_mixed_precision": ratio,
        "relu_4x4_bare_us": bare_s * 1e6, "relu_4x4_autocasted_us": wrapped_s * 1e6,
    }
    rows = "\n".join(f"| {name} | {median[name] * 1e3:.1f} |" for name in names)
    report = f"""# An autocast block around the whole forward vs mixed_precision=

GPT-like stack ({LAYERS} layers, width {DIM}), {ROWS} rows x {SEQ} tokens, {M} microbatches,
2 stages, 1F1B, CPU, 1 thread, {REPEATS} interleaved steps each (median).

| way | step (ms) |
|---|---|
{rows}

Step time, block / mixed_precision=: {ratio:.2f}. Ops run under the block per step (forward
ops, each entering it itself): {ops}. One aten.relu on a 4x4 tensor: {bare_s * 1e6:.1f} us bare,
{wrapped_s * 1e6:.1f} us through `Autocasted` (entering and leaving torch.autocast).
Timings on a shared machine; the side-by-side ratio is what to read.
"""
    write_results("autocast_block", data, report)


if __name__ == "__main__":
    main()
