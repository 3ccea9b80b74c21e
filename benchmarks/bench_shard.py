"""Benchmark: sharded data parallelism, ``Pipeline(..., shard=None | "optimizer" | "full")``, side
by side under torchrun (4 gloo processes, 1 thread each; a short run) at every (stages,
data_parallel) layout four processes allow: pp=4 x dp=1, pp=2 x dp=2, pp=1 x dp=4. Per mode:
the bytes each process holds of parameters, gradients and AdamW state after a step (local
shards of DTensors; the largest process and the mean), against ZeRO's arithmetic (fp32 Adam:
4 + 4 + 8 bytes per parameter; ZeRO-1 shards the 8 over dp, FSDP all 16), and the median time of
a step plus the optimizer's step (the slowest process's median). The three modes' Pipelines of
one layout are stepped in turn each round, so they see the same machine. The model: a GPT
(pipeline.app.models.GPT, vocab 512, width 128, 8 blocks, ~1.7 M parameters, fp32), 16 rows x
32 tokens per replica, 4 microbatches, 1F1B. Writes benchmarks/results/shard.{md,json}.

Run: .venv/bin/python benchmarks/bench_shard.py   (BENCH_REPEATS sets the timed rounds)
"""

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

REPEATS, WARMUP = int(os.environ.get("BENCH_REPEATS", "6")), 2
VOCAB, DIM, LAYERS, SEQ, ROWS, M = 512, 128, 8, 32, 16, 4
LAYOUTS = [(4, 1), (2, 2), (1, 4)]  # (stages, data_parallel)
MODES = [None, "optimizer", "full"]
MiB = 2**20


def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.size(-1)), target.reshape(-1))


def worker() -> None:
    import torch.distributed as dist

    from pipeline import Pipeline
    from pipeline.app.models import GPT
    from pipeline.execution.distributed.dtensors import local
    from pipeline.execution.distributed.optimizers import state_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows: list[dict[str, Any]] = []
    for stages, dp in LAYOUTS:
        g = torch.Generator().manual_seed(dist.get_rank())
        x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        y = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        runs = []
        for shard in MODES:
            torch.manual_seed(0)
            model = GPT(vocab=VOCAB, dim=DIM, layers=LAYERS, heads=4, max_seq=SEQ)
            pipe = Pipeline(model, stages=stages, data_parallel=dp, shard=shard, microbatches=M,
                            loss_fn=lm_loss, balance="parameters", capture_method="fx",
                            example_input=x)
            runs.append((shard, pipe, pipe.optimizer(torch.optim.AdamW, lr=1e-4), []))
        for r in range(WARMUP + REPEATS):
            for _, pipe, opt, times in runs:
                dist.barrier()
                start = time.perf_counter()
                pipe.zero_grad()
                pipe.step(x, y)
                opt.step()
                if r >= WARMUP:
                    times.append(time.perf_counter() - start)
        total = sum(p.numel() for p in GPT(vocab=VOCAB, dim=DIM, layers=LAYERS, heads=4,
                                           max_seq=SEQ).parameters())
        for shard, pipe, opt, times in runs:
            params = list(pipe.parameters())
            mine = {
                "params": sum(local(p).numel() * p.element_size() for p in params),
                "grads": sum(local(p.grad).numel() * p.element_size()
                             for p in params if p.grad is not None),
                "optimizer": state_bytes(opt),
                "step": statistics.median(times),
            }
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            rows.append({"stages": stages, "data_parallel": dp, "shard": shard,
                         "parameters": total, "ranks": every})
        del runs
    if dist.get_rank() == 0:
        hand_back(rows)
    dist.destroy_process_group()


def report(rows: list[dict[str, Any]]) -> str:
    lines = [
        "# Sharded data parallelism: per-process bytes and step time",
        "",
        f"{platform.machine()}, torch {torch.__version__}, 4 gloo processes (1 thread each); "
        f"GPT {rows[0]['parameters'] / 1e6:.2f} M parameters (fp32, AdamW); {ROWS} rows x "
        f"{SEQ} tokens per replica, {M} microbatches, 1F1B; medians of {REPEATS} rounds after "
        f"{WARMUP} warm-up, the three modes stepped in turn each round.",
        "",
        "Bytes: the largest process (params + grads + AdamW state, MiB); 'expected' is ZeRO's "
        "fp32 arithmetic for that process's share of the model (1/pp of it): 16 B/param "
        "unsharded, 8 + 8/dp with ZeRO-1, 16/dp with FSDP.",
        "",
        "| pp x dp | shard | params | grads | optimizer | total | expected | vs none | "
        "step (ms) | vs none |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base: dict[tuple[int, int], tuple[float, float]] = {}
    for row in rows:
        ranks = row["ranks"]
        worst = max(ranks, key=lambda r: r["params"] + r["grads"] + r["optimizer"])
        total = worst["params"] + worst["grads"] + worst["optimizer"]
        step = max(r["step"] for r in ranks)
        key = (row["stages"], row["data_parallel"])
        if row["shard"] is None:
            base[key] = (total, step)
        share = row["parameters"] / row["stages"]
        dp = row["data_parallel"]
        per_param = {None: 16, "optimizer": 8 + 8 / dp, "full": 16 / dp}[row["shard"]]
        lines.append(
            f"| {row['stages']} x {dp} | {row['shard']} | {worst['params'] / MiB:.2f} | "
            f"{worst['grads'] / MiB:.2f} | {worst['optimizer'] / MiB:.2f} | {total / MiB:.2f} | "
            f"{share * per_param / MiB:.2f} | {total / base[key][0]:.2f}x | {step * 1e3:.1f} | "
            f"{step / base[key][1]:.2f}x |"
        )
    lines += [
        "",
        "Reading: ZeRO-1 keeps every gradient and parameter whole and shards AdamW's two "
        "moments (whole parameters per replica, balanced by size, so a shard is only about "
        "1/dp); FSDP shards all three along dim 0. At dp=1 both are the unsharded run plus "
        "their bookkeeping. The expected column counts a pipeline rank's 1/pp of the model; "
        "uneven stages (the embedding and head) make the largest process hold more.",
    ]
    return "\n".join(lines)


def main() -> None:
    if "--worker" in sys.argv:
        worker()
        return
    rows = gather(__file__, 4, timeout=900)
    write_results("shard", rows, report(rows))


if __name__ == "__main__":
    main()
