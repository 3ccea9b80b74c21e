"""What periodic checkpoints cost a training run, synchronous vs asynchronous, and how long a
resume takes: pp=4 gloo processes on CPU (1 thread each), each holding a quarter of a 16-layer
MLP (1024 x 1024 fp32 Linear layers, 64 MiB in all) trained with Adam, so each process writes
its 16 MiB share of weights plus 32 MiB of Adam moments per save.

Per round, three runs of STEPS steps each: no saves, `Checkpointer(every=EVERY)` synchronous,
and asynchronous (`async_save=True`: DCP's async_save copies the tensors, a background thread
writes them; the next save and `close()` wait for it). The order rotates between rounds.
- step stall per save = (run time with saves - run time without) / saves: everything a save
  costs the run, the copy, the write or its contention with the steps, and the final wait;
- save call = median time the step that saves spends inside `maybe_save` (what blocks);
- full write = a synchronous save's call (the whole write, fsync included).
Then the resume time: `Checkpointer.resume()` at the layout it was saved at (pp=4) and at
pp=2 x dp=2 (other shards, each process reads only its own keys), wall time on rank 0 with a
barrier before and after. Medians over ROUNDS rounds. Writes benchmarks/results/resume.{md,json}.

Run: .venv/bin/python benchmarks/bench_resume.py   (it launches its own 4 processes)
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from launch import gather, hand_back
from report import write_results
from torch import nn

WORLD, LAYERS, DIM, BATCH = 4, 16, 1024, 64
STEPS, EVERY, ROUNDS = 12, 4, 5
MODES = ("none", "sync", "async")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(LAYERS)])


def _pipe(stages: int) -> Any:
    from pipeline import Pipeline

    return Pipeline(_model(), stages=stages, microbatches=4, balance="parameters",
                    loss_fn=nn.MSELoss(), example_input=torch.zeros(BATCH // (WORLD // stages),
                                                                    DIM))


def _run(pipe: Any, mode: str, root: Path) -> dict[str, Any]:
    import torch.distributed as dist

    from pipeline import Checkpointer

    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-4)
    ckpt = Checkpointer(pipe, root, optimizer, every=EVERY, keep=1, async_save=mode == "async")
    x = torch.randn(BATCH, DIM)
    calls = []
    dist.barrier()
    start = time.perf_counter()
    for step in range(STEPS):
        pipe.zero_grad()
        pipe.step(x, x)
        optimizer.step()
        if mode != "none":
            before = time.perf_counter()
            ckpt.maybe_save(step + 1)
            if (step + 1) % EVERY == 0:
                calls.append(time.perf_counter() - before)
    ckpt.close()
    dist.barrier()
    return {"seconds": time.perf_counter() - start, "save_calls": calls}


def _resume(stages: int, root: Path) -> float:
    import torch.distributed as dist

    from pipeline import Checkpointer

    pipe = _pipe(stages)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-4)
    dist.barrier()
    start = time.perf_counter()
    resumed = Checkpointer(pipe, root, optimizer).resume()
    dist.barrier()
    if resumed is None or resumed.step != STEPS:
        raise RuntimeError(f"resumed {resumed}, expected the save after step {STEPS}")
    return time.perf_counter() - start


def _worker(out: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    pipe = _pipe(WORLD)
    share = sum(p.numel() * p.element_size() for p in pipe.parameters())
    rows: list[dict[str, Any]] = []
    for r in range(ROUNDS):
        for mode in MODES[r % len(MODES):] + MODES[: r % len(MODES)]:
            rows.append({"round": r, "mode": mode, **_run(pipe, mode, out / f"{mode}-{r}")})
        rows.append({"round": r, "mode": "resume same layout",
                     "seconds": _resume(WORLD, out / f"sync-{r}")})
        rows.append({"round": r, "mode": "resume pp=2 x dp=2",
                     "seconds": _resume(2, out / f"sync-{r}")})
    if dist.get_rank() == 0:
        hand_back({"rows": rows, "rank0_share_bytes": share,
                   "model_bytes": LAYERS * (DIM * DIM + DIM) * 4})
    dist.destroy_process_group()


def _summary(data: dict[str, Any]) -> dict[str, Any]:
    rows = data["rows"]

    def median(mode: str, key: str = "seconds") -> float:
        return statistics.median(r[key] for r in rows if r["mode"] == mode)

    saves = STEPS // EVERY
    out: dict[str, Any] = {f"run {mode}": median(mode) for mode in MODES}
    for mode in MODES[1:]:
        per_round = [
            (next(r["seconds"] for r in rows if r["round"] == k and r["mode"] == mode)
             - next(r["seconds"] for r in rows if r["round"] == k and r["mode"] == "none"))
            / saves for k in range(ROUNDS)
        ]
        out[f"stall per save {mode}"] = statistics.median(per_round)
        out[f"stall per save {mode} per round"] = per_round
        out[f"save call {mode}"] = statistics.median(
            c for r in rows if r["mode"] == mode for c in r["save_calls"])
    out["step"] = median("none") / STEPS
    out["resume same layout"] = median("resume same layout")
    out["resume pp=2 x dp=2"] = median("resume pp=2 x dp=2")
    return out


def _report(data: dict[str, Any], s: dict[str, Any]) -> str:
    mib = 2**20
    written = 3 * data["rank0_share_bytes"] / mib
    return "\n".join([
        "# Periodic checkpoints: step stall sync vs async, and resume time",
        "",
        f"pp={WORLD} gloo processes on CPU (1 thread each), {LAYERS}-layer MLP of {DIM} x {DIM} "
        f"fp32 Linear layers, Adam: model {data['model_bytes'] / mib:.0f} MiB, each process "
        f"holds {data['rank0_share_bytes'] / mib:.0f} MiB and writes {written:.0f} MiB per save "
        f"(weights + two moments). {STEPS} steps per run, a save every {EVERY} steps; medians "
        f"of {ROUNDS} rounds (run order rotating).",
        "",
        "| | sync | async |",
        "|---|---:|---:|",
        f"| step stall per save (s) | {s['stall per save sync']:.3f} | "
        f"{s['stall per save async']:.3f} |",
        f"| time inside the save call (s) | {s['save call sync']:.3f} | "
        f"{s['save call async']:.3f} |",
        f"| run of {STEPS} steps (s; {s['run none']:.2f} without saves) | "
        f"{s['run sync']:.2f} | {s['run async']:.2f} |",
        "",
        "Stall per save in each round (s): sync "
        + ", ".join(f"{v:.2f}" for v in s["stall per save sync per round"]) + "; async "
        + ", ".join(f"{v:.2f}" for v in s["stall per save async per round"])
        + f". Load average of the machine during the run: {data['load'][0]:.1f} at the start, "
        f"{data['load'][1]:.1f} at the end (2 cores, shared).",
        "",
        f"A step without a save takes {s['step']:.3f} s. The asynchronous save stalls the run "
        f"{s['stall per save async'] / s['stall per save sync']:.2f}x as long as the "
        f"synchronous one (its call blocks for "
        f"{s['save call async'] / s['save call sync']:.2f}x the synchronous write).",
        "",
        f"Resume (`Checkpointer.resume()`: model, Adam state, RNG, all processes): "
        f"{s['resume same layout']:.2f} s at the saved layout (pp={WORLD}), "
        f"{s['resume pp=2 x dp=2']:.2f} s at pp=2 x dp=2.",
        "",
        "Command: `.venv/bin/python benchmarks/bench_resume.py`",
    ]) + "\n"


def main() -> None:
    if "--worker" in sys.argv:
        _worker(Path(sys.argv[-1]))
        return
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        data = gather(__file__, WORLD, tmp)
    data["load"] = [load, os.getloadavg()[0]]
    summary = _summary(data)
    write_results("resume", {**data, "summary": summary}, _report(data, summary), indent=1)


if __name__ == "__main__":
    main()
