"""Checkpoint save and load, gathered to rank 0 vs sharded (torch.distributed.checkpoint), for
a model four times one rank's share: pp=4 gloo processes on CPU, each holding a quarter of a
16-layer MLP (1536 x 1536 fp32 Linear layers, ~151 MB in all).

- gather: ``sd = pipe.state_dict()`` (every stage's tensors pickled to global rank 0), rank 0
  writes one file atomically (temp file, fsync, os.replace); load: every process
  ``torch.load(file, mmap=True)`` and ``pipe.load_state_dict(sd)`` (its own keys).
- sharded: ``pipe.save_checkpoint(dir)`` / ``pipe.load_checkpoint(dir)``: every process writes
  and reads only its own stages' tensors.

Checksums: every sharded save writes CRC32C lists (pipeline/checkpoint/checksums.py) and every
sharded load verifies the files it reads; "unchecked" variants run the same save and load with
the checksumming switched off (patched out in this benchmark only), so the difference is what
the checksums cost; as that difference is within this machine's noise, the time spent inside
CRC32C during each operation is measured too (`_TimedCrc`). The CRC32C throughput of one core
is measured on 256 MiB.

Per operation: wall time on rank 0 (barrier before and after) and the peak resident memory
(RSS) above the level just before the operation, on rank 0 and the largest on the other ranks,
sampled every millisecond from /proc/self/statm (glibc's mmap threshold is fixed, so freed
tensor memory leaves RSS and each operation shows its own allocations). Rounds alternate the
order of the two variants; medians over the rounds. Writes benchmarks/results/checkpoint.{md,json}.

Run: .venv/bin/python benchmarks/bench_checkpoint.py   (it launches its own 4 processes)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from launch import torchrun
from report import write_results
from torch import nn

WORLD, LAYERS, DIM, ROUNDS = 4, 16, 1536, 16  # even: each order as often


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_during(op: Callable[[], None]) -> float:
    """Peak RSS above the level before `op`, in MiB, sampled every millisecond."""
    base, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)  # a sampling period, not synchronisation

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        op()
    finally:
        done.set()
        sampler.join()
    return max(0, max(peak[0], _rss()) - base) / 2**20


@contextmanager
def _unchecked() -> Iterator[None]:
    """Sharded save/load with the checksums switched off (the baseline for their cost)."""
    import pipeline.checkpoint.saveload as saveload
    from pipeline.checkpoint.parts import RankWriter

    class Plain(RankWriter):  # the same per-process DCP save, without the hashing
        sums: dict[str, list[int]] = {}

    saved = {k: getattr(saveload, k) for k in (
        "ChecksummingWriter", "write_rank_checksums", "write_index_checksums", "mismatch")}
    saveload.ChecksummingWriter = Plain  # type: ignore[misc,assignment]
    saveload.write_rank_checksums = lambda *a: None  # type: ignore[assignment]
    saveload.write_index_checksums = lambda *a: None  # type: ignore[assignment]
    saveload.mismatch = lambda *a: None  # type: ignore[assignment]
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(saveload, k, v)


def _unchecked_op(op: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        with _unchecked():
            op()
    return run


class _TimedCrc:
    """Stands in for the `crc32c` module in pipeline.checkpoint.checksums: every CRC32C
    computed by a save or a load (shards as written, files verified before a load, the lists
    themselves) is timed, page faults of the files it hashes included."""

    def __init__(self, real: Any) -> None:
        self.real, self.seconds = real, 0.0

    def crc32c(self, data: Any, value: int = 0) -> int:
        start = time.perf_counter()
        try:
            return int(self.real.crc32c(data, value))
        finally:
            self.seconds += time.perf_counter() - start


def _crc_gbps() -> float:
    import crc32c
    data = os.urandom(256 * 2**20)
    start = time.perf_counter()
    crc32c.crc32c(data)
    return len(data) / (time.perf_counter() - start) / 1e9


def _worker(out: Path) -> None:
    import torch.distributed as dist

    import pipeline.checkpoint.checksums as checksums
    from pipeline import Pipeline
    from pipeline.checkpoint import atomic_save

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    timed = checksums.crc32c = _TimedCrc(checksums.crc32c)  # type: ignore[assignment]
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(LAYERS)])
    pipe = Pipeline(model, stages=WORLD, microbatches=4, balance="parameters",
                    example_input=torch.zeros(4, DIM))
    share = sum(p.numel() * p.element_size() for p in pipe.parameters())
    whole = LAYERS * (DIM * DIM + DIM) * 4
    single = out / "gathered.pt"

    def gather_save() -> None:
        sd = pipe.state_dict()
        if sd is not None:
            atomic_save(sd, single)

    def gather_load() -> None:
        pipe.load_state_dict(torch.load(single, mmap=True, weights_only=True))

    ops: dict[str, Callable[[], None]] = {
        "gather save": gather_save,
        "sharded save": lambda: pipe.save_checkpoint(out / "sharded"),
        "gather load": gather_load,
        "sharded load": lambda: pipe.load_checkpoint(out / "sharded"),
        "unchecked save": _unchecked_op(lambda: pipe.save_checkpoint(out / "unchecked")),
        "unchecked load": _unchecked_op(lambda: pipe.load_checkpoint(out / "sharded")),
    }
    rows: list[dict[str, Any]] = []
    for r in range(ROUNDS):
        order = (["gather", "sharded", "unchecked"] if r % 2 == 0
                 else ["unchecked", "sharded", "gather"])
        for kind in ("save", "load"):
            for variant in order:
                name = f"{variant} {kind}"
                dist.barrier()
                start, hashing = time.perf_counter(), timed.seconds
                peak = _peak_during(ops[name])
                hashing = timed.seconds - hashing
                dist.barrier()
                seconds = time.perf_counter() - start
                peaks: list[float] = [0.0] * WORLD
                dist.all_gather_object(peaks, peak)
                hashed: list[float] = [0.0] * WORLD
                dist.all_gather_object(hashed, hashing)
                rows.append({"round": r, "op": name, "seconds": seconds, "peak_mib": peaks,
                             "crc_seconds": hashed})
    if rank == 0:
        (out / "rows.json").write_text(json.dumps(
            {"rows": rows, "model_bytes": whole, "rank0_share_bytes": share,
             "crc32c_gb_per_s": _crc_gbps()}
        ))
    dist.destroy_process_group()


def _launch(out: Path) -> dict[str, Any]:
    # A fixed mmap threshold: every tensor buffer is its own mapping, returned to the OS when
    # freed, so RSS shows each operation's own allocations.
    torchrun(__file__, WORLD, str(out), MALLOC_MMAP_THRESHOLD_="65536")
    result: dict[str, Any] = json.loads((out / "rows.json").read_text())
    return result


def _summary(data: dict[str, Any]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name in ("gather save", "sharded save", "unchecked save", "gather load", "sharded load",
                 "unchecked load"):
        rows = [r for r in data["rows"] if r["op"] == name]
        out[name] = {
            "seconds": statistics.median(r["seconds"] for r in rows),
            "rank0_peak_mib": statistics.median(r["peak_mib"][0] for r in rows),
            "others_peak_mib": statistics.median(max(r["peak_mib"][1:]) for r in rows),
            "crc_seconds": statistics.median(max(r["crc_seconds"]) for r in rows),
        }
    return out


def _report(data: dict[str, Any], summary: dict[str, dict[str, float]]) -> str:
    mib = 2**20
    lines = [
        "# Checkpoints: gathered to rank 0 vs sharded (torch.distributed.checkpoint)",
        "",
        f"pp={WORLD} gloo processes on CPU (1 thread each), {LAYERS}-layer MLP of {DIM} x {DIM} "
        f"fp32 Linear layers: model {data['model_bytes'] / mib:.0f} MiB, rank 0 holds "
        f"{data['rank0_share_bytes'] / mib:.0f} MiB. Medians of {ROUNDS} rounds (order "
        "alternating); peak = resident memory above the level before the operation.",
        "",
        "| operation | seconds | rank 0 peak MiB | other ranks' peak MiB |",
        "|---|---:|---:|---:|",
    ]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['seconds']:.2f} | {s['rank0_peak_mib']:.0f} | "
                     f"{s['others_peak_mib']:.0f} |")
    ratio = {kind: summary[f"gather {kind}"]["seconds"] / summary[f"sharded {kind}"]["seconds"]
             for kind in ("save", "load")}
    per_round = {
        kind: [
            next(r["seconds"] for r in data["rows"]
                 if r["round"] == k and r["op"] == f"gather {kind}")
            / next(r["seconds"] for r in data["rows"]
                   if r["round"] == k and r["op"] == f"sharded {kind}")
            for k in range(ROUNDS)
        ]
        for kind in ("save", "load")
    }
    lines += [
        "",
        *_checksum_lines(data, summary),
        "",
        f"Sharded vs gathered speed: save {ratio['save']:.2f}x (per round, median and "
        f"quartiles: {_quartiles(per_round['save'], '.2f')}), load {ratio['load']:.2f}x "
        f"({_quartiles(per_round['load'], '.2f')}).",
        "",
        "Command: `.venv/bin/python benchmarks/bench_checkpoint.py`",
    ]
    return "\n".join(lines) + "\n"


def _checksum_lines(data: dict[str, Any], summary: dict[str, dict[str, float]]) -> list[str]:
    """What the checksums cost: time inside CRC32C, and checked minus unchecked per round."""
    def seconds(op: str, k: int) -> float:
        return float(next(r["seconds"] for r in data["rows"] if r["round"] == k and r["op"] == op))

    diff = {kind: [1e3 * (seconds(f"sharded {kind}", k) - seconds(f"unchecked {kind}", k))
                   for k in range(ROUNDS)] for kind in ("save", "load")}
    save = summary["sharded save"]["seconds"]
    crc = {kind: summary[f"sharded {kind}"]["crc_seconds"] for kind in ("save", "load")}
    return [
        f"Checksums (CRC32C, {data['crc32c_gb_per_s']:.2f} GB/s on one core here): time inside "
        f"CRC32C itself (the slowest process, median): save {1e3 * crc['save']:.1f} ms, load "
        f"{1e3 * crc['load']:.1f} ms, i.e. {100 * crc['save'] / save:.1f}% and "
        f"{100 * crc['load'] / save:.1f}% of the checksummed save's time. Checked minus "
        f"unchecked, paired within each of the {ROUNDS} rounds (median, quartiles): "
        + "; ".join(f"{kind} {_quartiles(diff[kind])} ms" for kind in ("save", "load")) + ".",
    ]


def _quartiles(values: list[float], spec: str = "+.1f") -> str:
    low, mid, high = statistics.quantiles(values, n=4)
    return f"{mid:{spec}} ({low:{spec}} to {high:{spec}})"


def main() -> None:
    if "--worker" in sys.argv:
        _worker(Path(sys.argv[-1]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        data = _launch(Path(tmp))
    summary = _summary(data)
    report = _report(data, summary)
    write_results("checkpoint", {**data, "summary": summary}, report, indent=1)


if __name__ == "__main__":
    main()
