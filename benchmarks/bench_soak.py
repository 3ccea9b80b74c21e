"""Soak: 200 consecutive training steps of the distributed executor (pp=2 x dp=2, 4 gloo
processes on CPU, 1 thread each) with a checkpoint every 20 steps, recording each process's
resident memory (RSS), thread count and open file descriptors after the first step and at
every checkpoint. A leak shows as growth between the first checkpoint and the end. Writes
benchmarks/results/soak.{md,json}.

Run: .venv/bin/python benchmarks/bench_soak.py   (it launches its own 4 processes)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from launch import torchrun
from report import write_results
from torch.nn import functional as F

WORLD, STAGES, STEPS, EVERY = 4, 2, 200, 20


def _usage() -> dict[str, float]:
    """This process's RSS (MiB), threads and open file descriptors, from /proc."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return {
        "rss_mib": pages * os.sysconf("SC_PAGE_SIZE") / 2**20,
        "threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
    }


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _worker(out: Path) -> None:
    import torch.distributed as dist

    from pipeline import Pipeline
    from pipeline.app.models import GPT
    from pipeline.app.textdata import TokenBatches, stdlib_corpus

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(vocab=256, dim=64, layers=4, heads=4, max_seq=32)
    pipe = Pipeline(model, stages=STAGES, schedule="1f1b", microbatches=4, loss_fn=_lm_loss,
                    balance="parameters", example_input=torch.zeros(8, 32, dtype=torch.long))
    if pipe.distributed is None:
        raise SystemExit("the soak workers must run under torch.distributed")
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    data = TokenBatches(stdlib_corpus(200_000), 8, 32, seed=pipe.distributed.layout.dp_rank)
    samples: list[dict[str, float]] = []
    losses = []
    t0 = time.perf_counter()
    for step in range(1, STEPS + 1):
        x, y = data.next()
        pipe.zero_grad()
        losses.append(float(pipe.step(x, y)))
        optimizer.step()
        if step == 1 or step % EVERY == 0:
            if step % EVERY == 0:
                pipe.save_checkpoint(out / "soak", optimizer=optimizer, extra={"step": step})
            samples.append({"step": step, **_usage()})
    elapsed = time.perf_counter() - t0
    (out / f"rank{rank}.json").write_text(json.dumps(
        {"samples": samples, "losses": losses, "seconds": elapsed}
    ))
    dist.destroy_process_group()


def _launch(out: Path) -> list[dict[str, Any]]:
    torchrun(__file__, WORLD, str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _report(ranks: list[dict[str, Any]]) -> str:
    lines = [
        "# Soak: 200 distributed steps (pp=2 x dp=2, CPU, gloo)",
        "",
        f"GPT (dim 64, 4 layers), batch 8 x 32 tokens per replica, 1F1B with 4 microbatches, "
        f"AdamW; checkpoint (model + optimizer, atomic) every {EVERY} steps. Figures per process "
        "after step 1, at the first checkpoint (step 20) and after step 200.",
        "",
        "| rank | RSS MiB step 1 / 20 / 200 | growth 20->200 | threads 1 / 20 / 200 | "
        "fds 1 / 20 / 200 | s per step |",
        "|---|---|---:|---|---|---:|",
    ]
    for rank, data in enumerate(ranks):
        s = {d["step"]: d for d in data["samples"]}
        first, warm, last = s[1], s[EVERY], s[STEPS]
        lines.append(
            f"| {rank} | {first['rss_mib']:.1f} / {warm['rss_mib']:.1f} / {last['rss_mib']:.1f} | "
            f"{last['rss_mib'] - warm['rss_mib']:+.1f} | "
            f"{first['threads']} / {warm['threads']} / {last['threads']} | "
            f"{first['fds']} / {warm['fds']} / {last['fds']} | {data['seconds'] / STEPS:.3f} |"
        )
    losses = ranks[0]["losses"]
    lines += ["", f"Loss (mean over replicas) step 1: {losses[0]:.3f}, step {STEPS}: "
              f"{losses[-1]:.3f}. RSS at every checkpoint, rank 0: "
              + ", ".join(f"{d['rss_mib']:.1f}" for d in ranks[0]["samples"])]
    return "\n".join(lines) + "\n"


def main() -> None:
    if "--worker" in sys.argv:
        _worker(Path(sys.argv[-1]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        ranks = _launch(Path(tmp))
    report = _report(ranks)
    write_results("soak", ranks, report, indent=1)


if __name__ == "__main__":
    main()
