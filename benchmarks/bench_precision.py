"""Benchmark: ``mixed_precision=torch.bfloat16`` against fp32 on the same pipeline, side by side
(steps interleaved, rotated each round), in one process (local executor, 2 ranks) and under
torchrun (2 gloo processes, 1 thread each; a short run). Per precision: the median step time,
the bytes crossing stage boundaries per step (F messages, the stages' outputs, plus B messages,
a gradient per floating-point output, same dtype), and the peak activation memory per rank: the
bytes each stage saves for backward per microbatch (``saved_tensors_hooks`` during a real
step, parameters excluded; autocast's bf16 weight copies included, since they are held per
microbatch) held from each F to its B as in the step's measured trace (``Timeline(activation=
...)``). The model: a GPT-like stack (embedding, 4 TransformerEncoderLayers of width 256, a
vocabulary head), 16 rows x 64 tokens, 4 microbatches, 1F1B, 2 stages. Writes
benchmarks/results/precision.{md,json}.

Run: .venv/bin/python benchmarks/bench_precision.py   (BENCH_REPEATS sets the rounds)
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from launch import gather, hand_back
from report import write_results
from torch import nn
from torch.nn import functional as F

REPEATS, WARMUP = int(os.environ.get("BENCH_REPEATS", "12")), 2
VOCAB, DIM, LAYERS, SEQ, ROWS, M = 512, 256, 4, 128, 16, 4
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(DIM, 4, 4 * DIM, dropout=0.0, batch_first=True)
            for _ in range(LAYERS)
        )
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def mlp() -> nn.Module:
    """A plain stack: every activation, so every cut, is a bf16 tensor under autocast."""
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM), nn.GELU()]
    return nn.Sequential(*layers)


def _ce(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1))


def _batch(model: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if model == "gpt":
        return (torch.randint(0, VOCAB, (ROWS, SEQ), generator=g),
                torch.randint(0, VOCAB, (ROWS, SEQ), generator=g))
    return torch.randn(ROWS, SEQ, DIM, generator=g), torch.randn(ROWS, SEQ, DIM, generator=g)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


# name -> (model factory, loss, what crosses the stage boundary)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[Any, Any], torch.Tensor], str]] = {
    "gpt": (GPT, _ce, "GPT-like stack (embedding, 4 post-norm TransformerEncoderLayers, head): "
            "the residual stream, fp32 under autocast (LayerNorm runs in fp32)"),
    "mlp": (mlp, _mse, "MLP stack (4 x Linear-GELU-Linear-GELU): a GELU output, bf16 "
            "under autocast"),
}


class Meter:
    """Counts, during the steps it is armed for, the bytes each stage module returns (what
    crosses to the next stage) and saves for backward per forward call."""

    def __init__(self, pipe: Any) -> None:
        self.sent = 0
        self.saved: dict[int, int] = {}
        self.armed = False
        self.figures: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        params = {p.data_ptr() for p in pipe.module.parameters()}
        held = pipe.stage_modules
        last = pipe.schedule.num_stages - 1  # v=1: stage s runs on pipeline rank s
        stages = range(last + 1) if len(held) == last + 1 else [
            0 if pipe.holds_first_stage else last]
        for stage, module in zip(stages, held, strict=True):
            module.register_forward_pre_hook(self._enter(stage, params))
            module.register_forward_hook(self._exit(stage, stage == last))

    def _enter(self, stage: int, params: set[int]) -> Any:
        def hook(_m: nn.Module, _args: Any) -> None:
            if not self.armed or not torch.is_grad_enabled():
                return
            seen: set[int] = set()
            total = [0]

            def pack(t: torch.Tensor) -> torch.Tensor:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in params and ptr not in seen:
                    seen.add(ptr)
                    total[0] += t.untyped_storage().nbytes()
                return t

            stack = ExitStack()
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
            self._local.open = (stack, total)

        return hook

    def _exit(self, stage: int, last: bool) -> Any:
        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            opened = getattr(self._local, "open", None)
            if opened is None:
                return
            stack, total = opened
            stack.close()
            self._local.open = None
            sent = 0 if last else sum(
                t.nbytes * (2 if t.is_floating_point() else 1) for t in out
            )  # the F message, and for a floating-point tensor its gradient coming back
            with self._lock:
                self.sent += sent
                self.saved[stage] = total[0]  # every microbatch has the same shapes here

        return hook


def _build(model: str, mixed: torch.dtype | None) -> tuple[Any, Meter]:
    from pipeline import Pipeline

    torch.manual_seed(0)
    build, loss, _ = MODELS[model]
    pipe = Pipeline(build(), stages=2, schedule="1f1b", microbatches=M, loss_fn=loss,
                    balance="parameters", mixed_precision=mixed)
    pipe.step(*_batch(model))  # plans
    pipe.zero_grad()
    return pipe, Meter(pipe)


def measure(model: str, rank: int | None) -> dict[str, Any]:
    """Both precisions side by side; figures for `rank` (None: every rank of the process)."""
    from scheduler import Timeline

    x, y = _batch(model)
    runs = {name: _build(model, dtype) for name, dtype in PRECISIONS.items()}
    times: dict[str, list[float]] = {k: [] for k in runs}
    keys = list(runs)
    for i in range(WARMUP + REPEATS):
        for key in keys[i % len(keys):] + keys[: i % len(keys)]:
            pipe, meter = runs[key]
            pipe.zero_grad()
            meter.armed = i == WARMUP
            meter.sent = 0
            start = time.perf_counter()
            pipe.step(x, y)
            elapsed = time.perf_counter() - start
            if i >= WARMUP:
                times[key].append(elapsed)
            if meter.armed:
                trace, sent, saved = pipe.trace, meter.sent, dict(meter.saved)
                stages = pipe.schedule.num_stages
                activation = tuple(float(saved.get(s, 0)) for s in range(stages))
                peaks = Timeline(trace.events, trace.num_ranks, trace.splits_backward,
                                 activation=activation).peak_memory
                ranks = range(trace.num_ranks) if rank is None else [rank]
                meter.figures = {"sent_bytes": sent, "saved_per_microbatch": saved,
                                 "peak_activation_bytes": {str(r): peaks[r] for r in ranks}}
    return {k: {"median_s": statistics.median(v), "samples_s": v, **runs[k][1].figures}
            for k, v in times.items()}


def _worker() -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mine = {model: measure(model, dist.get_rank()) for model in MODELS}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        hand_back(every)
    dist.destroy_process_group()


def _merge(per_rank: list[dict[str, Any]], model: str) -> dict[str, Any]:
    """One process per rank: the slowest rank's step time, bytes and peaks summed by rank."""
    out: dict[str, Any] = {}
    for key in PRECISIONS:
        runs = [r[model][key] for r in per_rank]
        out[key] = {
            "median_s": max(r["median_s"] for r in runs),
            "sent_bytes": sum(r["sent_bytes"] for r in runs),
            "peak_activation_bytes": {k: v for r in runs
                                      for k, v in r["peak_activation_bytes"].items()},
        }
    return out


def _table(title: str, res: dict[str, Any]) -> list[str]:
    f32, b16 = res["fp32"], res["bf16"]
    lines = [f"### {title}", "", "| | fp32 | bf16 | bf16 / fp32 |", "|---|---|---|---|"]
    lines.append(f"| step time (median) | {f32['median_s'] * 1e3:.1f} ms | "
                 f"{b16['median_s'] * 1e3:.1f} ms | {b16['median_s'] / f32['median_s']:.2f} |")
    lines.append(f"| bytes sent per step | {f32['sent_bytes'] / 2**20:.2f} MiB | "
                 f"{b16['sent_bytes'] / 2**20:.2f} MiB | "
                 f"{b16['sent_bytes'] / f32['sent_bytes']:.2f} |")
    for r in sorted(f32["peak_activation_bytes"]):
        a, b = f32["peak_activation_bytes"][r], b16["peak_activation_bytes"][r]
        lines.append(f"| peak activation memory, rank {r} | {a / 2**20:.2f} MiB | "
                     f"{b / 2**20:.2f} MiB | {b / a:.2f} |")
    return [*lines, ""]


def main() -> None:
    torch.set_num_threads(2)
    local = {model: measure(model, None) for model in MODELS}
    every = gather(__file__, 2, timeout=1200)
    dist_run = {model: _merge(every, model) for model in MODELS}
    data = {"local": local, "distributed": dist_run, "repeats": REPEATS,
            "shape": {"vocab": VOCAB, "dim": DIM, "layers": LAYERS, "seq": SEQ, "rows": ROWS,
                      "microbatches": M, "schedule": "1f1b", "stages": 2},
            "cpu": platform.processor() or platform.machine(), "torch": torch.__version__}
    report = [
        "# Mixed precision: bf16 against fp32", "",
        f"Width {DIM}, {ROWS} rows x {SEQ} tokens per step, {M} microbatches, 1F1B over 2 "
        f"stages; medians of {REPEATS} steps, the two precisions interleaved. Bytes sent: F "
        "messages plus the gradients coming back. Peak activation memory: bytes saved for "
        "backward per microbatch (measured; autocast's bf16 weight copies included) held from F "
        "to B in the measured trace.", "",
    ]
    for model, (_, _, crossing) in MODELS.items():
        report += [f"## {crossing}", "",
                   *_table("One process (local executor, 2 ranks as threads, 2 torch threads)",
                           local[model]),
                   *_table("torchrun, 2 gloo processes, 1 thread each (slowest rank's time)",
                           dist_run[model])]
    write_results("precision", data, "\n".join(report))


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker()
    else:
        main()
