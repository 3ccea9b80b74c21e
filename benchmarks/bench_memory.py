"""Benchmark: memory per process of a model bigger than one process's share, and the cost
estimate that balances a model built on meta.

1. Peak RSS per process (ru_maxrss) of a Llama-style model of 374M parameters (fp32, 1.39 GiB;
   hidden 1024, 24 layers, vocab 32000) at pp=2 and pp=4 under torchrun (gloo, 1 thread per
   process), built on CPU (every process builds the whole model) and on meta (each process
   materialises its own stages, ``init_fn="reset_parameters"``; "meta+load": from a state
   dict file, ``pipe.load_state_dict(torch.load(path, mmap=True))``): after the imports, after
   building the model, once the Pipeline is built (construction), and after two steps without
   zero_grad (gradient accumulation; default "atomic" mode and, on meta at pp=2,
   ``grad_accumulation="in_place"``). Set against the process's share of the model (largest
   stage's parameter bytes) and the whole model. balance="parameters" for both builds, so they
   split alike (profiling the 374M model on CPU would take minutes).
2. Estimated (FLOPs + bytes on meta, partitioner.estimate) against profiled (measured on CPU)
   stage costs on GPT-2 and Llama configs at 4 stages: each plan's stage costs read on the
   profiled node times, and the estimate-balanced plan's bottleneck over the profile-balanced
   one's (1.00 = as good as profiling).

Writes benchmarks/results/memory.{md,json}.
Run: .venv/bin/python benchmarks/bench_memory.py   (it launches its own processes; a few
minutes on 2 cores; BENCH_PARTS=memory or BENCH_PARTS=estimate runs one part)
"""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
import time
from typing import Any

import torch
from launch import gather, hand_back
from report import RESULTS, write_results

GIB = 2**30
ROWS, SEQ = 2, 16
LLAMA_400M = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                  num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                  max_position_embeddings=256)
RUNS = (("cpu", 2, "atomic"), ("meta", 2, "atomic"), ("meta", 2, "in_place"),
        ("meta+load", 2, "atomic"), ("cpu", 4, "atomic"), ("meta", 4, "atomic"))
WEIGHTS = RESULTS / ".llama374m.pt"  # the meta+load runs' state dict (written, then removed)


def _peak() -> float:
    """This process's peak resident set so far, GiB (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def _lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                             target.reshape(-1))


def worker(build: str, stages: int, accumulation: str) -> None:
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline import Pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    marks = {"imports": _peak()}
    config = LlamaConfig(**LLAMA_400M)
    if build.startswith("meta"):
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
    else:
        model = LlamaForCausalLM(config)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    marks["model built"] = _peak()
    x = torch.randint(0, 32000, (ROWS, SEQ))
    y = torch.randint(0, 32000, (ROWS, SEQ))
    pipe = Pipeline(model, stages=stages, loss_fn=_lm_loss, microbatches=2, balance="parameters",
                    example_input={"input_ids": x}, grad_accumulation=accumulation,
                    init_fn="reset_parameters" if build == "meta" else None)
    if build == "meta+load":  # each process reads its own stages' bytes of the mmap'd file
        pipe.load_state_dict(torch.load(WEIGHTS, mmap=True, weights_only=True))
    marks["Pipeline built"] = _peak()
    share = sum(p.numel() * p.element_size() for p in pipe.parameters())
    begin = time.perf_counter()
    for _ in range(2):  # no zero_grad: the second step accumulates
        pipe.step({"input_ids": x}, y)
    marks["after 2 steps"] = _peak()
    mine = {"marks": marks, "share": share / GIB, "total": total / GIB,
            "step_s": (time.perf_counter() - begin) / 2}
    found: list[Any] = [None] * stages if dist.get_rank() == 0 else []
    dist.gather_object(mine, found if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() == 0:
        hand_back(found)


def memory_part() -> list[dict[str, Any]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    torch.save(LlamaForCausalLM(LlamaConfig(**LLAMA_400M)).state_dict(), WEIGHTS)
    rows: list[dict[str, Any]] = []
    try:
        for build, stages, accumulation in RUNS:
            found = gather(__file__, stages, build, str(stages), accumulation, timeout=1800)
            rows += [{"build": build, "pp": stages, "grad_accumulation": accumulation,
                      "rank": rank, **got} for rank, got in enumerate(found)]
    finally:
        WEIGHTS.unlink()
    return rows


def memory_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## Peak RSS per process (GiB), Llama-style 374M parameters (1.39 GiB fp32)",
        "",
        "| build | pp | .grad mode | rank | imports | model built | Pipeline built | after 2 "
        "steps | own share | construction - imports | / share |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        m = row["marks"]
        grown = m["Pipeline built"] - m["imports"]
        lines.append(
            f"| {row['build']} | {row['pp']} | {row['grad_accumulation']} | {row['rank']} | "
            f"{m['imports']:.2f} | {m['model built']:.2f} | {m['Pipeline built']:.2f} | "
            f"{m['after 2 steps']:.2f} | {row['share']:.2f} | {grown:.2f} | "
            f"{grown / row['share']:.2f} |"
        )
    lines += ["", "construction - imports: what building the model and the Pipeline added to "
              "the process's peak; / share: that over the process's own parameter bytes (1.0 = "
              "its share and nothing else; the whole model is pp x the share)."]
    return lines


def _estimate_vs_profile(name: str, build: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    from partitioner import capture, partition, profile
    from partitioner.estimate import estimate

    torch.manual_seed(0)
    real = build()
    profiled = capture(real, (), batch)
    profiled = profiled.with_costs(
        profile(profiled, real, tuple(batch.values()), repeats=5, warmup=2))
    with torch.device("meta"):
        model = build()
    meta_batch = {k: v.to("meta") for k, v in batch.items()}
    estimated = capture(model, (), meta_batch)
    estimated = estimated.with_costs(estimate(estimated, tuple(batch.values())))
    if estimated.order != profiled.order:
        raise SystemExit(f"{name}: the meta and CPU captures differ; cannot compare")
    by_profile = partition(profiled, 4, "profile")
    by_estimate = partition(estimated, 4, "profile")
    on_measured = partition(profiled, 4, by_estimate.sizes)  # the estimate's cut, real costs
    est_total = sum(by_estimate.stage_costs)
    prof_total = sum(by_profile.stage_costs)
    return {
        "model": name,
        "nodes": len(profiled.order),
        "profile_sizes": by_profile.sizes,
        "estimate_sizes": by_estimate.sizes,
        "estimated_share": [c / est_total for c in by_estimate.stage_costs],
        "profiled_share_of_estimate_cut": [c / sum(on_measured.stage_costs)
                                           for c in on_measured.stage_costs],
        "profiled_share": [c / prof_total for c in by_profile.stage_costs],
        "bottleneck_ratio": on_measured.bottleneck / by_profile.bottleneck,
    }


def estimate_part() -> list[dict[str, Any]]:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    def gpt2() -> torch.nn.Module:
        return GPT2LMHeadModel(GPT2Config(vocab_size=8000, n_positions=128, n_embd=256,
                                          n_layer=6, n_head=4))

    def llama() -> torch.nn.Module:
        return LlamaForCausalLM(LlamaConfig(vocab_size=8000, hidden_size=256,
                                            intermediate_size=704, num_hidden_layers=6,
                                            num_attention_heads=4, num_key_value_heads=4,
                                            max_position_embeddings=128))

    torch.set_num_threads(1)
    batch = {"input_ids": torch.randint(0, 8000, (4, 64))}
    return [_estimate_vs_profile("GPT-2 (6 x 256, vocab 8000)", gpt2, batch),
            _estimate_vs_profile("Llama (6 x 256, vocab 8000)", llama, batch)]


def estimate_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["## Estimated (FLOPs + bytes on meta) vs profiled stage costs, 4 stages",
             "", "| model | nodes | profile cut | estimate cut | estimated shares | profiled "
             "shares of the estimate's cut | profiled shares (profile's cut) | bottleneck, "
             "estimate's cut / profile's cut |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def pct(xs: list[float]) -> str:
            return " ".join(f"{100 * v:.0f}%" for v in xs)
        lines.append(
            f"| {r['model']} | {r['nodes']} | {r['profile_sizes']} | {r['estimate_sizes']} | "
            f"{pct(r['estimated_share'])} | {pct(r['profiled_share_of_estimate_cut'])} | "
            f"{pct(r['profiled_share'])} | {r['bottleneck_ratio']:.2f} |"
        )
    lines += ["", "Both on one microbatch of 4 x 64 tokens; profiled times are CPU medians of 5 "
              "runs (1 thread). The bottleneck ratio reads both cuts on the profiled node times."]
    return lines


def main() -> None:
    parts = os.environ.get("BENCH_PARTS", "memory,estimate").split(",")
    saved = RESULTS / "memory.json"
    data: dict[str, Any] = json.loads(saved.read_text()) if saved.exists() else {}
    data.update(machine=f"{platform.machine()}, {os.cpu_count()} CPUs", torch=torch.__version__)
    if "memory" in parts:
        data["memory"] = memory_part()
    if "estimate" in parts:
        data["estimate"] = estimate_part()  # a part not rerun keeps its last results
    lines = ["# Memory of a model bigger than one process, and the cost estimate on meta", "",
             f"{data['machine']}, torch {data['torch']}; `python benchmarks/bench_memory.py`.",
             ""]
    if "memory" in data:
        lines += memory_lines(data["memory"]) + [""]
    if "estimate" in data:
        lines += estimate_lines(data["estimate"])
    write_results("memory", data, "\n".join(lines))


if __name__ == "__main__":
    if "--worker" in sys.argv:
        build, stages, accumulation = sys.argv[sys.argv.index("--worker") + 1:][:3]
        worker(build, int(stages), accumulation)
    else:
        main()
