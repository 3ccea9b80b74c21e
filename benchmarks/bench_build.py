"""Benchmark: what building a Pipeline costs on real models, split into capture (torch.export
with only the batch dim dynamic, grouped into units), profile (every unit forward + backward;
identical units measured once), partition (4 stages) and split (the stage modules), next to
torch.export alone on the same call (the same dynamic dims) and torch.distributed.pipelining's
`pipeline()` front end where it works (split at the middle block), the capture with every
dim dynamic (what capture did before) where that takes seconds, not minutes, and torch.fx's
capture (or why it fails). Writes
benchmarks/results/build.{md,json}.

Models, built from configs (nothing is downloaded), float32 on CPU: Hugging Face GPT-2 small
(124M, 2 x 128 tokens), ALBERT base (one shared layer called 12 times: 12 units balanced
over the 4 stages), a Llama of about 1B parameters (TinyLlama's shape) on the meta device
(capture and a parameter-balanced partition: nothing to profile there), torchvision Swin-T and
MaxViT-T and timm ViT-S/16 (2 x 3 x 224 x 224).

Run: .venv/bin/python benchmarks/bench_build.py [model ...]
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from report import write_results
from torch import nn

from partitioner import CaptureError, capture, partition, profile, split_model
from partitioner.exported import export_flat
from pipeline.planning.shapes import pairs_for

CPU: dict[str, float] = {}  # phase -> CPU seconds of the last timed call


def _timed(fn: Callable[[], Any], phase: str = "") -> tuple[Any, float]:
    """`fn()` and its wall seconds; its CPU seconds (this process, one torch thread) go to
    CPU[phase]: on a shared machine the wall time also holds other users' load."""
    start, cpu = time.perf_counter(), time.process_time()
    value = fn()
    CPU[phase] = time.process_time() - cpu
    return value, time.perf_counter() - start


def _gpt2() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], str]:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(use_cache=False)).eval()
    return model, (), {"input_ids": torch.randint(0, 50257, (2, 128))}, "transformer.h.6"


def _albert() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], str]:
    from transformers import AlbertConfig, AlbertForMaskedLM

    model = AlbertForMaskedLM(AlbertConfig.from_dict(ALBERT_BASE)).eval()
    return model, (), {"input_ids": torch.randint(0, 30000, (2, 128))}, \
        "albert.encoder.embedding_hidden_mapping_in"


# albert-base-v2's shape: one layer called 12 times.
ALBERT_BASE = {"vocab_size": 30000, "embedding_size": 128, "hidden_size": 768,
               "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
               "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def _llama_meta() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
        use_cache=False,
    )
    with torch.device("meta"):
        model: nn.Module = LlamaForCausalLM(config)
    ids = torch.randint(0, 32000, (2, 512)).to("meta")
    return model, (), {"input_ids": ids}, "model.layers.11"


def _images() -> tuple[torch.Tensor]:
    return (torch.randn(2, 3, 224, 224),)


def _swin() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], str]:
    from torchvision.models import swin_t

    return swin_t().eval(), _images(), {}, "features.5"


def _maxvit() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], str]:
    from torchvision.models import maxvit_t

    return maxvit_t().eval(), _images(), {}, "blocks.2"


def _vit() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], str]:
    import timm

    return timm.create_model("vit_small_patch16_224", pretrained=False).eval(), _images(), {}, \
        "blocks.6"


MODELS: dict[str, tuple[str, Callable[[], tuple[nn.Module, tuple[Any, ...], dict[str, Any],
                                                    str]], bool]] = {
    # name: (description, factory, also capture with every dim dynamic)
    "gpt2": ("GPT-2 small (HF, 124M), 2x128 tokens", _gpt2, True),
    "albert": ("ALBERT base (HF, one layer called 12 times), 2x128 tokens", _albert, False),
    "llama-1b-meta": ("Llama ~1.1B (TinyLlama shape) on meta, 2x512 tokens", _llama_meta,
                      False),
    "swin_t": ("torchvision Swin-T, 2x3x224x224", _swin, True),
    "maxvit_t": ("torchvision MaxViT-T, 2x3x224x224", _maxvit, False),
    "vit_small": ("timm ViT-S/16, 2x3x224x224", _vit, True),
}


def _torch_pipeline(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    split: str) -> float | str:
    """torch.distributed.pipelining's pipeline() front end (its own torch.export) split at
    `split`: seconds, or why it failed."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    try:
        _, seconds = _timed(lambda: pipeline(model, mb_args=args, mb_kwargs=kwargs or None,
                                             split_spec={split: SplitPoint.BEGINNING}),
                            "torch_pipeline")
        return seconds
    except Exception as exc:  # report whatever it raises
        return " ".join(f"{type(exc).__name__}: {exc}".split())[:160]


def measure(name: str) -> dict[str, Any]:
    description, factory, all_dynamic = MODELS[name]
    torch.manual_seed(0)
    model, args, kwargs, split = factory()
    meta = any(p.is_meta for p in model.parameters())
    flat = [*args, *kwargs.values()]
    _, t_export = _timed(lambda: torch.export.export(
        model, args, kwargs, strict=False,
        dynamic_shapes=tuple({0: torch.export.Dim.AUTO} for _ in flat)), "torch_export")
    graph, t_capture = _timed(lambda: capture(model, args, kwargs), "capture")
    t_profile = None
    if not meta:
        costs, t_profile = _timed(lambda: profile(graph, model, tuple(flat)), "profile")
        graph = graph.with_costs(costs)
    balance = "parameters" if meta else "profile"
    plan, t_partition = _timed(lambda: partition(graph, 4, balance), "partition")
    _, t_split = _timed(lambda: split_model(graph, plan), "split")
    every = None
    if all_dynamic:
        dims = pairs_for(flat, range(1, max(t.dim() for t in flat)))
        _, every = _timed(lambda: export_flat(model, args, kwargs, dims), "all_dims_dynamic")
    fx: float | str | None = None
    if not meta:
        try:
            _, fx = _timed(lambda: capture(model, args, kwargs, method="fx"), "fx")
        except CaptureError as exc:
            fx = " ".join(str(exc).split(". Two ways out")[0].split())[:160]
    CPU.pop("", None)
    pipe = _torch_pipeline(model, args, kwargs, split)
    return {
        "model": description,
        "parameters": sum(p.numel() for p in model.parameters()),
        "aten_nodes": sum(
            1 for n in graph.graph_module.graph.nodes if n.op == "call_function"
        ),
        "units": len(graph.order),
        "profiled_units": len(graph.order) - len(plan.shared),
        "dynamic_dims": plan.dynamic_dims,
        "capture_s": t_capture,
        "profile_s": t_profile,
        "partition_s": t_partition,
        "split_s": t_split,
        "balance": balance,
        "bound_ratio": plan.bound_ratio,
        "torch_export_s": t_export,
        "torch_pipeline": pipe,
        "all_dims_dynamic_export_s": every,
        "fx_capture": fx,
        "cpu_s": dict(CPU),
    }


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    rows = []
    for name in names:
        CPU.clear()
        rows.append(measure(name))
        print(rows[-1], file=sys.stderr, flush=True)
    meta = {"torch": torch.__version__, "machine": platform.machine(),
            "threads": torch.get_num_threads(), "load": os.getloadavg()[0]}
    lines = [
        "# Build: capture / profile / partition / split on real models",
        "",
        f"torch {meta['torch']}, {meta['machine']}, {meta['threads']} threads, load average "
        f"{meta['load']:.1f} (a shared machine: times are upper bounds). Command: "
        f"`.venv/bin/python benchmarks/bench_build.py {' '.join(names)}`. Seconds; 4 stages.",
        "",
        "Each cell: wall seconds / CPU seconds of this process (one torch thread; the CPU "
        "figure is what the machine's load does not inflate).",
        "",
        "| model | params | aten ops | units (profiled) | capture | profile | partition | "
        "split | torch.export alone | torch pipeline() | export, every dim dynamic | "
        "torch.fx capture | bound ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---:|",
    ]
    for r in rows:
        cpu = r["cpu_s"]

        def both(key: str, phase: str, digits: int = 2, r: dict[str, Any] = r,
                 cpu: dict[str, float] = cpu) -> str:
            wall = r[key]
            if not isinstance(wall, float):
                return "-" if wall is None else f"fails: {wall}"
            return f"{wall:.{digits}f} / {cpu[phase]:.{digits}f}"

        lines.append(
            f"| {r['model']} | {r['parameters'] / 1e6:.0f}M | {r['aten_nodes']} | {r['units']} "
            f"({r['profiled_units']}) | {both('capture_s', 'capture')} | "
            f"{both('profile_s', 'profile')} | {both('partition_s', 'partition', 3)} | "
            f"{both('split_s', 'split')} | {both('torch_export_s', 'torch_export')} | "
            f"{both('torch_pipeline', 'torch_pipeline')} | "
            f"{both('all_dims_dynamic_export_s', 'all_dims_dynamic')} | "
            f"{both('fx_capture', 'fx')} | {r['bound_ratio']:.3f} |"
        )
    lines += [
        "",
        "Dynamic dims: " + "; ".join(f"{r['model'].split(' (')[0]}: {r['dynamic_dims']}"
                                     for r in rows) + ".",
        "",
        "capture = torch.export (batch dim dynamic) + grouping into units + shape propagation; "
        "torch.export alone is the first part. profile measures one unit of each set of "
        "identical units (same ops and shapes). The meta Llama is partitioned by parameters "
        "(nothing to run). torch pipeline() is torch.distributed.pipelining's front end split "
        "in two at the middle block (ALBERT: before its encoder, since one module called 12 "
        "times cannot be split inside). bound ratio: the 4-stage plan's slowest stage over "
        "max(total / 4, heaviest unit) (profiled; by parameters for the meta Llama).",
    ]
    write_results("build", {"meta": meta, "rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:] or list(MODELS))
