"""Benchmark: a model built on meta under tensor parallelism, ``Pipeline(meta_model,
stages=pp, tensor_parallel=tp, init_fn="reset_parameters")``, under torchrun (4 gloo
processes, 1 thread each): each process materialises its own stages' tensors and keeps only
its shards. Per process, side by side for pp=4 x tp=1, pp=2 x tp=2 and pp=1 x tp=4 on a
Hugging Face GPT-2 (width 512, 4 blocks, vocab 4096: 14.7 M parameters, fp32):

- the parameter bytes it holds (each DTensor's local shard, every tensor once) over the whole
  model's, against 1/(pp x tp);
- its peak resident memory while the Pipeline is built, over the base after imports
  (ru_maxrss), against the whole model's bytes: the stage's whole tensors exist while their
  initialisation runs, before they are cut.

Writes benchmarks/results/tp_meta.{md,json}. Run: .venv/bin/python benchmarks/bench_tp_meta.py"""

from __future__ import annotations

import platform
import resource
import sys
from typing import Any

import torch
from launch import gather, hand_back
from report import write_results
from torch.nn import functional as F

VOCAB, SEQ, ROWS = 4096, 32, 4
LAYOUTS = ((4, 1), (2, 2), (1, 4))
MiB = 2**20


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def worker(pp: int, tp: int) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import GPT2Config, GPT2LMHeadModel

    from pipeline import Pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=512, n_layer=4, n_head=8,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    base = _peak_rss()
    x = torch.randint(0, VOCAB, (ROWS, SEQ))
    pipe = Pipeline(model, stages=pp, tensor_parallel=tp, microbatches=pp, loss_fn=lm_loss,
                    balance="parameters", example_input={"input_ids": x},
                    init_fn="reset_parameters")
    held = {id(p): p for p in pipe.parameters()}
    mine = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in held.values())
    row = {"rank": dist.get_rank(), "held": mine, "whole": whole,
           "peak_added": _peak_rss() - base}
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        hand_back({"pp": pp, "tp": tp, "rows": rows})
    dist.destroy_process_group()


def report(data: dict[str, Any]) -> str:
    lines = [
        "# A meta-built model under tensor parallelism: what each process holds", "",
        f"{platform.machine()}, torch {torch.__version__}, 4 gloo processes (torchrun, 1 "
        "thread each); Hugging Face GPT-2, width 512, 4 blocks, vocab 4096, fp32, built on "
        "meta, init_fn='reset_parameters'.", "",
        "| layout | 1/(pp x tp) | parameter bytes held per process / whole model | "
        "peak RSS added while building / whole model |",
        "|---|---|---|---|",
    ]
    for run in data["runs"]:
        rows = run["rows"]
        whole = rows[0]["whole"]
        held = ", ".join(f"{r['held'] / whole:.3f}" for r in rows)
        peak = ", ".join(f"{r['peak_added'] / whole:.2f}" for r in rows)
        lines.append(f"| pp={run['pp']} x tp={run['tp']} | {1 / (run['pp'] * run['tp']):.3f} "
                     f"| {held} | {peak} |")
    whole = data["runs"][0]["rows"][0]["whole"]
    lines += ["", f"Whole model: {whole / MiB:.1f} MiB of parameters. Held bytes are exact; "
              "the peak is the process's resident high-water mark over its base after "
              "imports (it includes capture and planning on meta, the stage's whole tensors "
              "during their initialisation, and allocator slack)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    if "--worker" in sys.argv:
        worker(int(sys.argv[-2]), int(sys.argv[-1]))
        return
    runs = [gather(__file__, 4, str(pp), str(tp), timeout=1800) for pp, tp in LAYOUTS]
    data = {"runs": runs}
    write_results("tp_meta", data, report(data))


if __name__ == "__main__":
    main()
