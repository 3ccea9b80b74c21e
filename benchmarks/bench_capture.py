"""Benchmark: what capturing real models costs and what the partitioner then sees. Writes
benchmarks/results/capture.{md,json}.

For Hugging Face GPT-2 small (the 124M config, float32, 1 x 128 tokens, on CPU): torch.export
capture time, aten nodes in the exported graph and units after grouping by module, profile time
(every unit, forward + backward), partition time (profile balance, 4 stages) and the stage
modules' build time; torch.fx on the same model, for comparison. For a Llama of about 1B
parameters (TinyLlama's shape: 22 layers, hidden 2048) built on the meta device (nothing is
allocated): capture and 8-stage parameter-balanced partition + split times, and the counts.
Built from configs: nothing is downloaded.

Run: .venv/bin/python benchmarks/bench_capture.py
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any

import torch
from report import write_results
from torch import nn

from partitioner import CaptureError, capture, partition, profile, split_model


def _timed(fn: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def _counts(graph: Any) -> dict[str, int]:
    gm = graph.graph["graph_module"]
    return {
        "aten_nodes": sum(1 for n in gm.graph.nodes if n.op == "call_function"),
        "units": len(graph.graph["order"]),
    }


def gpt2_small() -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(use_cache=False)).eval()
    params = sum(p.numel() for p in model.parameters())
    x = {"input_ids": torch.randint(0, 50257, (1, 128))}
    graph, t_capture = _timed(lambda: capture(model, (), x))
    _, t_profile = _timed(lambda: profile(graph, model, (x["input_ids"],)))
    plan, t_partition = _timed(lambda: partition(graph, 4, "profile"))
    _, t_split = _timed(lambda: split_model(graph, plan))
    try:
        capture(model, (), x, method="fx")
        fx = "captured"
    except CaptureError as exc:
        fx = " ".join(str(exc).split(". Two ways out")[0].split())[:300]
    return {
        "model": "GPT-2 small (HF GPT2LMHeadModel, 124M config), 1x128 tokens, float32",
        "parameters": params,
        **_counts(graph),
        "capture_s": t_capture,
        "profile_s": t_profile,
        "partition_s": t_partition,
        "split_s": t_split,
        "stage_units": plan.sizes,
        "imbalance": plan.imbalance,
        "fx": fx,
    }


def llama_1b_meta() -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
        use_cache=False,
    )
    with torch.device("meta"):
        model: nn.Module = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    x = {"input_ids": torch.randint(0, 32000, (1, 512)).to("meta")}
    graph, t_capture = _timed(lambda: capture(model, (), x))
    plan, t_partition = _timed(lambda: partition(graph, 8, "parameters"))
    _, t_split = _timed(lambda: split_model(graph, plan))
    return {
        "model": "Llama ~1B (TinyLlama shape, 22 layers, hidden 2048) on the meta device, "
        "1x512 tokens",
        "parameters": params,
        **_counts(graph),
        "capture_s": t_capture,
        "profile_s": None,
        "partition_s": t_partition,
        "split_s": t_split,
        "stage_units": plan.sizes,
        "imbalance": plan.imbalance,
        "fx": "not run",
    }


def main() -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = [gpt2_small(), llama_1b_meta()]
    meta = {"torch": torch.__version__, "machine": platform.machine(),
            "threads": torch.get_num_threads(), "load": os.getloadavg()[0]}
    lines = [
        "# Capture: torch.export front end on real models",
        "",
        f"torch {meta['torch']}, {meta['machine']}, {meta['threads']} threads, load average "
        f"{meta['load']:.1f} (a shared machine: times are upper bounds). "
        "Command: `.venv/bin/python benchmarks/bench_capture.py`.",
        "",
        "| model | params | aten nodes | units | capture s | profile s | partition s | split s "
        "| units per stage |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        prof = "-" if r["profile_s"] is None else f"{r['profile_s']:.2f}"
        lines.append(
            f"| {r['model']} | {r['parameters'] / 1e6:.0f}M | {r['aten_nodes']} | {r['units']} "
            f"| {r['capture_s']:.2f} | {prof} | {r['partition_s']:.3f} | {r['split_s']:.2f} "
            f"| {r['stage_units']} |"
        )
    lines += ["", f"torch.fx on GPT-2 small: {rows[0]['fx']}", ""]
    write_results("capture", {"meta": meta, "rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
