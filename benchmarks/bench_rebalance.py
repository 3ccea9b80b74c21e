"""Benchmark: re-balancing a running distributed job (pipe.rebalance under torchrun, pp=2 on 2
gloo processes of 1 thread each, 1F1B, 4 microbatches, Adam).

The model's compute is uneven per parameter: 6 looped blocks (one 64x64 linear applied 16
times) then 6 wide MLP blocks (64 -> 512 -> 64): the same compute each, a looped block 1/16 of
a wide one's parameters. Two cases:
- wrong plan: balance="parameters" puts most of the compute on rank 0; a job started so with
  rebalance=True re-partitions after its third step. Compared with the static plans
  balance="parameters", balance="profile" and the re-balanced sizes given as balance=[...]
  (the best static plan is the fastest of them);
- heterogeneous: rank 1 is made 3x slower in every block's forward (it sleeps as long as the
  block ran: a slower or busier device, in this benchmark only); a job started from the
  profiled plan (right for equal devices) with rebalance=True, against that plan and the
  re-balanced sizes as a static plan.
Every configuration is a Pipeline of its own in one launch; their steps take turns round by
round (drift and other load hit all alike), each after a barrier (none pays for another's
optimizer step on the other rank); step time = rank 0's wall time of pipe.step, median
over the measured rounds (after warm-up; the re-balance happens during warm-up). Also the
move: seconds from the decision to the rebuilt executor, bytes received (weights, grads, Adam
state) on each rank, tensors moved. Writes benchmarks/results/rebalance.{md,json}.

Run: .venv/bin/python benchmarks/bench_rebalance.py   (it launches its own 2 processes;
BENCH_ROUNDS sets the measured rounds)
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
from torch import nn
from torch.nn import functional as F

ROUNDS, WARMUP = int(os.environ.get("BENCH_ROUNDS", "12")), 4
DIM, SEQ, HIDDEN, ROWS, M, REPEAT = 64, 128, 512, 4, 4, 16
SLOWDOWN = 3.0  # the heterogeneous case's slow rank runs each block's forward this much longer


class Repeated(nn.Module):
    """Much compute per parameter: one small linear applied REPEAT times (as a weight-shared
    recurrent or looped block is): as much compute as a `Wide` block, 1/16 of its parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(REPEAT):
            x = x + torch.tanh(self.proj(x))
        return x


class Wide(nn.Module):
    """Many parameters per unit of compute: a wide MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


def _model(slow: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(Repeated() for _ in range(6)), *(Wide() for _ in range(6)))
    if slow:
        for block in model:
            block.register_forward_pre_hook(lambda m, _: setattr(m, "_t0", time.perf_counter()))
            block.register_forward_hook(
                lambda m, *_: time.sleep((SLOWDOWN - 1) * (time.perf_counter() - m._t0)))
    return model


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


class Run:
    """One configuration: a Pipeline, its optimizer and its measured step times."""

    def __init__(self, slow: bool, balance: Any, rebalance: bool) -> None:
        from pipeline import Pipeline

        self.pipe = Pipeline(_model(slow), stages=2, schedule="1f1b", microbatches=M,
                             loss_fn=_mse, balance=balance, rebalance=rebalance,
                             capture_method="fx", leaf_modules=(Repeated, Wide))
        self.opt: torch.optim.Optimizer | None = None
        self.times: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor, measured: bool) -> None:
        import torch.distributed as dist

        self.pipe.zero_grad()
        dist.barrier()  # the previous run's optimizer step is over on every rank
        start = time.perf_counter()
        self.pipe.step(x, y)
        elapsed = time.perf_counter() - start
        if self.opt is None:
            self.opt = self.pipe.optimizer(torch.optim.Adam, lr=1e-4)
        self.opt.step()
        if measured:
            self.times.append(elapsed)


def _case(slow_rank: int | None, start: str) -> dict[str, Any]:
    """The static plans and the job started from `start` with rebalance=True, in turns."""
    import torch.distributed as dist

    slow = dist.get_rank() == slow_rank
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(ROWS, SEQ, DIM, generator=g), torch.randn(ROWS, SEQ, DIM, generator=g)
    runs = {f"static {b}": Run(slow, b, False) for b in dict.fromkeys(("parameters", start))}
    runs["rebalance=True"] = job = Run(slow, start, True)
    for _ in range(WARMUP):
        for run in runs.values():
            run.step(x, y, measured=False)
    report = job.pipe.rebalanced
    assert report is not None, "the job did not re-balance during the warm-up"
    if report.applied:
        runs["static re-balanced sizes"] = Run(slow, list(report.after), False)
        for _ in range(2):
            runs["static re-balanced sizes"].step(x, y, measured=False)
    for _ in range(ROUNDS):
        for run in runs.values():
            run.step(x, y, measured=True)
    move = job.pipe._executor.last_move  # noqa: SLF001 - the move's own figures
    moved = torch.tensor([0.0 if move is None else move.bytes_received])
    dist.all_reduce(moved)
    return {
        "start": start, "slow_rank": slow_rank,
        "plans": {name: run.pipe.plan.sizes for name, run in runs.items()},
        "first_plan": report.before, "report": str(report), "applied": report.applied,
        "predicted_ms": [1e3 * report.predicted_before, 1e3 * report.predicted_after],
        "step_ms": {name: 1e3 * statistics.median(run.times) for name, run in runs.items()},
        "move_s": None if move is None else move.seconds,
        "moved_tensors": None if move is None else move.tensors_moved,
        "moved_bytes": float(moved.item()),
    }


def _worker() -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {"wrong plan": _case(None, "parameters"), "heterogeneous": _case(1, "profile")}
    if dist.get_rank() == 0:
        hand_back(results)
    dist.destroy_process_group()


def _report(data: dict[str, Any]) -> str:
    lines = [
        "# Re-balancing a running distributed job", "",
        f"pp=2 (2 gloo processes, 1 thread each), 1F1B, {M} microbatches of {ROWS // M} rows x "
        f"{SEQ} positions; 6 looped blocks (a 64x64 linear applied {REPEAT} times) + 6 wide "
        f"MLP blocks (64 -> {HIDDEN} -> 64; the same compute, 16x the parameters); Adam. "
        "Step: rank 0's wall time of pipe.step (after a barrier), "
        f"median of {ROUNDS} rounds taking turns. Machine: {data['machine']}.", "",
        "| case | run | plan (units per stage) | step ms | vs best static |",
        "|---|---|---|---:|---:|",
    ]
    for case, res in data["cases"].items():
        statics = {k: v for k, v in res["step_ms"].items() if k.startswith("static")}
        best = min(statics.values())
        for name, ms in res["step_ms"].items():
            lines.append(f"| {case} | {name} | {res['plans'][name]} | {ms:.1f} | "
                         f"{ms / best - 1:+.1%} |")
    lines += ["", "| case | re-balance | move s | tensors moved | bytes received (all ranks) |",
              "|---|---|---:|---:|---:|"]
    for case, res in data["cases"].items():
        move = "-" if res["move_s"] is None else f"{res['move_s']:.3f}"
        lines.append(f"| {case} | {res['report']} | {move} | {res['moved_tensors']} | "
                     f"{res['moved_bytes']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if "--worker" in sys.argv:
        _worker()
        return
    cases = gather(__file__, 2, timeout=1800)
    data = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, torch "
                       f"{torch.__version__}", "rounds": ROUNDS, "cases": cases}
    write_results("rebalance", data, _report(data))


if __name__ == "__main__":
    main()
