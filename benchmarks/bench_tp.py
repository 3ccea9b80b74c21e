"""Benchmark: tensor parallelism inside a stage, ``Pipeline(..., tensor_parallel=2)``, under
torchrun (2 gloo processes, 1 thread each):

- memory: the bytes one process holds of parameters plus AdamW state after a step, at tp=2
  (its shards; `local` of each DTensor) against the unsplit model's (tp=1), for a Hugging Face
  GPT-2 (fused qkv, tied embedding) and a Llama (grouped-query attention) of the same size;
- time: the median step (forward + backward, 2 microbatches) of a compute-bound wide
  transformer (the demo GPT at width 1024, 2 blocks) at tp=2 against the unsplit model's step
  in one process on one thread (rank 1 waits at a barrier meanwhile): the same cores, half
  the matmul work per process plus the all-reduces;
- communication: the collectives of one forward of the tp=2 stage (CommDebugMode), per block.

Writes benchmarks/results/tp.{md,json}. Run: .venv/bin/python benchmarks/bench_tp.py
(BENCH_REPEATS sets the timed rounds)."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from typing import Any

import torch
from launch import gather, hand_back
from report import write_results
from torch.nn import functional as F

REPEATS, WARMUP = int(os.environ.get("BENCH_REPEATS", "5")), 2
VOCAB, SEQ, ROWS = 4096, 64, 8
WIDE, WIDE_LAYERS, WIDE_SEQ, WIDE_ROWS = 1024, 2, 128, 8
MiB = 2**20


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _hf(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=256, n_layer=4, n_head=8,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ))


def _held_bytes(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> dict[str, int]:
    from pipeline.execution.distributed.dtensors import local
    from pipeline.execution.distributed.optimizers import state_bytes

    return {"params": sum(local(p).numel() * p.element_size() for p in params),
            "optimizer": state_bytes(opt)}


def _memory(name: str) -> dict[str, Any]:
    """Parameter + AdamW bytes of one process at tp=2 and of the unsplit model."""
    from pipeline import Pipeline

    x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    ref = _hf(name)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4)
    lm_loss(ref(input_ids=x), x).backward()
    ref_opt.step()
    pipe = Pipeline(_hf(name), stages=1, tensor_parallel=2, microbatches=2, loss_fn=lm_loss,
                    balance="parameters", example_input={"input_ids": x})
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    pipe.step({"input_ids": x}, x)
    opt.step()
    plan = pipe.tp_plan
    assert plan is not None
    return {"model": name, "tp1": _held_bytes(list(ref.parameters()), ref_opt),
            "tp2": _held_bytes(list(pipe.parameters()), opt),
            "replicated_bytes": sum(p.bytes for p in plan.replicated),
            "parameters": sum(p.numel() for p in ref.parameters())}


def _wide() -> dict[str, Any]:
    """Step times of the wide transformer, and its forward's collectives per block."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    from pipeline import Pipeline
    from pipeline.app.models import GPT

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT(vocab=VOCAB, dim=WIDE, layers=WIDE_LAYERS, heads=16, max_seq=WIDE_SEQ)

    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (WIDE_ROWS, WIDE_SEQ), generator=g)
    y = torch.randint(0, VOCAB, (WIDE_ROWS, WIDE_SEQ), generator=g)
    ref = build()
    pipe = Pipeline(build(), stages=1, tensor_parallel=2, microbatches=2, loss_fn=lm_loss,
                    balance="parameters", example_input=x)
    tp1: list[float] = []
    tp2: list[float] = []
    for r in range(WARMUP + REPEATS):
        dist.barrier()
        if dist.get_rank() == 0:  # the unsplit model, one process, one thread
            start = time.perf_counter()
            ref.zero_grad()
            for xm, ym in zip(x.tensor_split(2), y.tensor_split(2), strict=True):
                (lm_loss(ref(xm), ym) / 2).backward()
            if r >= WARMUP:
                tp1.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        pipe.zero_grad()
        pipe.step(x, y)
        if r >= WARMUP:
            tp2.append(time.perf_counter() - start)
    with CommDebugMode() as comm:
        pipe._executor.held()[0](x[:2])
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    return {"tp1": statistics.median(tp1) if tp1 else None, "tp2": statistics.median(tp2),
            "collectives": counts, "blocks": WIDE_LAYERS}


def worker() -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    memory = [_memory(name) for name in ("gpt2", "llama")]
    wide = _wide()
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, wide["tp2"])
    wide["tp2"] = max(every)  # the slower tp rank
    if dist.get_rank() == 0:
        hand_back({"memory": memory, "wide": wide})
    dist.destroy_process_group()


def report(data: dict[str, Any]) -> str:
    lines = [
        "# Tensor parallelism: per-process bytes, step time, collectives",
        "",
        f"{platform.machine()}, torch {torch.__version__}, 2 gloo processes (1 thread each).",
        "",
        f"Memory: parameters + AdamW state (fp32) one process holds after a step, tp=2 "
        f"(`Pipeline(stages=1, tensor_parallel=2)`, its shards) against the unsplit model. "
        f"GPT-2: width 256, 4 blocks, 8 heads, vocab {VOCAB}; Llama: width 256, 4 blocks, "
        "8 heads / 4 kv heads, ffn 688.",
        "",
        "| model | parameters | tp=1 (MiB) | tp=2 (MiB) | ratio | replicated at tp=2 (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for row in data["memory"]:
        one = row["tp1"]["params"] + row["tp1"]["optimizer"]
        two = row["tp2"]["params"] + row["tp2"]["optimizer"]
        lines.append(f"| {row['model']} | {row['parameters'] / 1e6:.2f} M | {one / MiB:.2f} | "
                     f"{two / MiB:.2f} | {two / one:.3f}x | "
                     f"{row['replicated_bytes'] / MiB:.3f} |")
    wide = data["wide"]
    lines += [
        "",
        f"Time: demo GPT width {WIDE}, {WIDE_LAYERS} blocks, 16 heads, {WIDE_ROWS} rows x "
        f"{WIDE_SEQ} tokens, 2 microbatches; medians of {REPEATS} rounds after {WARMUP} "
        "warm-up. tp=1: the unsplit model's forward + backward in one process on one thread; "
        "tp=2: `pipe.step` on two processes (the slower one).",
        "",
        "| tp=1 step (ms) | tp=2 step (ms) | ratio |",
        "|---|---|---|",
        f"| {wide['tp1'] * 1e3:.1f} | {wide['tp2'] * 1e3:.1f} | "
        f"{wide['tp2'] / wide['tp1']:.2f}x |",
        "",
        f"Collectives of one forward of the tp=2 stage ({wide['blocks']} blocks): "
        f"{wide['collectives']} (expected: 2 all-reduces per block, 1 for the vocab-parallel "
        "embedding, no all-gather of the logits under loss parallelism; no weight gathered).",
    ]
    return "\n".join(lines)


def main() -> None:
    if "--worker" in sys.argv:
        worker()
        return
    data = gather(__file__, 2, timeout=1800)
    write_results("tp", data, report(data))


if __name__ == "__main__":
    main()
