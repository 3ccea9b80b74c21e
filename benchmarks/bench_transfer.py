"""Benchmark: the time a tensor takes from its sender's send call to its receiver's wait
returning, 2 gloo ranks on this machine, by how the send is posted (inline from the sending
thread, or from the executor's per-step sender thread, `pipeline.execution.distributed.p2p._Sender`,
without and with its handoff: the caller waits until the thread has taken the message) and
by what the sender does next (kernels, which release Python's GIL, or Python code, which holds
it). Rank 0 sends a 16 KiB message, then works ~0.6 ms, then waits for rank 1's reply; rank 1
waits, stamps the arrival (perf_counter is one clock for both processes), works, replies: the
1F1B exchange. Writes benchmarks/results/transfer.{md,json}.

Run: .venv/bin/python benchmarks/bench_transfer.py   (it launches its own 2 processes)
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
from launch import gather, hand_back
from report import write_results

ROUNDS, WARMUP = 300, 20
CASES = [(posting, after) for after in ("kernels", "Python")
         for posting in ("inline", "sender thread", "handoff")]


def _kernels(a: torch.Tensor, b: torch.Tensor) -> None:
    for _ in range(12):
        a = torch.tanh(a @ b)


def _python() -> None:
    x = 0
    for _ in range(20_000):
        x += 1


def _worker() -> None:
    import torch.distributed as dist

    from pipeline.execution.distributed.p2p import _Sender

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.new_group([0, 1])
    a, b = torch.randn(16, 256), torch.randn(256, 256) / 16
    reply = torch.zeros(1)
    results = {}
    for posting, after in CASES:
        work = (lambda: _kernels(a, b)) if after == "kernels" else _python
        sender = _Sender(group, handoff=posting == "handoff") if posting != "inline" else None
        delays, posted = [], []
        for i in range(ROUNDS):
            if rank == 0:
                message = torch.randn(16 * 256, dtype=torch.float64)
                message[-1] = time.perf_counter()
                if sender is None:
                    posted.append(group.send([message], 1, i))
                else:
                    sender.post((message, 1, i, "message"))
                work()
                group.recv([reply], 1, ROUNDS + i).wait()
            else:
                buffer = torch.empty(16 * 256, dtype=torch.float64)
                group.recv([buffer], 0, i).wait()
                delays.append(time.perf_counter() - buffer[-1].item())
                work()
                group.send([reply], 0, ROUNDS + i).wait()
        if sender is not None:
            posted += [p[0] for p in sender.close(60.0)]
        for w in posted:
            w.wait()
        if rank == 1:
            kept = sorted(delays[WARMUP:])
            results[f"{posting}, then {after}"] = {
                "median_s": statistics.median(kept), "p90_s": kept[int(0.9 * len(kept))],
                "mean_s": statistics.fmean(kept),
            }
        dist.barrier()
    if rank == 1:
        hand_back(results)
    dist.destroy_process_group()


def main() -> None:
    load = os.getloadavg()[0]
    rows = gather(__file__, 2, timeout=600)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average_start": load,
            "rounds": ROUNDS - WARMUP, "torch": torch.__version__}
    lines = [
        "# Send to arrival, 2 gloo ranks",
        "",
        f"{meta['rounds']} exchanges per case after {WARMUP} warm-up ones (1-min load average "
        f"{load:.1f} at the start; {meta['date']}). A 16 KiB message; the sender's next work "
        "takes ~0.6 ms either way. Command: `.venv/bin/python benchmarks/bench_transfer.py`.",
        "",
        "| posting, then the sender's next work | median us | p90 us | mean us |",
        "|---|---:|---:|---:|",
        *(f"| {case} | {1e6 * r['median_s']:.0f} | {1e6 * r['p90_s']:.0f} | "
          f"{1e6 * r['mean_s']:.0f} |" for case, r in rows.items()),
    ]
    write_results("transfer", {"meta": meta, "cases": rows}, "\n".join(lines))


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker()
    else:
        main()
