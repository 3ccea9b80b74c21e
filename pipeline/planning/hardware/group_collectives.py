"""Collectives measured on a real process group and fitted per group size, for pricing the
tensor-parallel groups of a job on the machine that runs it (gloo on this CPU, NCCL on GPUs).

Each kind ("all_reduce", "all_gather", "reduce_scatter") is timed at a few buffer sizes on
groups of consecutive ranks (as tp groups are placed) and fitted by least squares to the
collective model's own form (`collectives.collective_seconds`: latency + bytes x factor / bus
bandwidth), so the fit is read back through that model (`GroupCollectives.seconds`) with a
`Network` of the fitted figures. `dispatch` is DTensor's own CPU seconds per op on such a group
(a chain of tiny ops on Replicate DTensors, forward and backward, over the same on plain
tensors): every op of a tensor-parallel stage pays it, which on a CPU is a large part of a
small op.

Measured under torchrun on the job's own process group (`measure_world`: every process takes
part, a few hundred milliseconds), or, without one, on gloo processes spawned on this host
and cached (`local_collectives`, through `local.cached`)."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.planning.hardware.collectives import KINDS, Placement, collective_seconds
from pipeline.planning.hardware.local import cached
from pipeline.planning.hardware.targets import Network

SIZES = (1 << 12, 1 << 16, 1 << 20)
"""Buffer bytes timed per kind (4 KiB, 64 KiB, 1 MiB)."""


@dataclass(frozen=True)
class Fit:
    """One kind on one group size: seconds = `latency` + bytes x factor / `busbw`."""

    latency: float
    busbw: float


def factor(kind: str, ranks: int) -> float:
    """nccl-tests' bus-bandwidth factor (the collective model's)."""
    return 2 * (ranks - 1) / ranks if kind == "all_reduce" else (ranks - 1) / ranks


def fit(points: Sequence[tuple[float, float]], kind: str, ranks: int) -> Fit:
    """The least-squares (latency, bus bandwidth) of (bytes, seconds) `points` of `kind` on
    `ranks` ranks (latency kept >= 0, a slope <= 0 taken as a bandwidth of 1 TB/s)."""
    if len(points) < 2:
        raise ValueError(f"fit needs two sizes or more, got {list(points)}")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    latency = max(0.0, my - slope * mx)
    busbw = factor(kind, ranks) / slope if slope > 0 else 1e12
    return Fit(latency, busbw)


@dataclass(frozen=True)
class GroupCollectives:
    """Fitted collectives: kind -> group size -> `Fit`; `dispatch`: DTensor's extra CPU
    seconds per op on a tensor-parallel group (0 where not measured)."""

    fits: Mapping[str, Mapping[int, Fit]]
    dispatch: float = 0.0
    sources: tuple[str, ...] = field(default=())

    @property
    def sizes(self) -> list[int]:
        return sorted({n for by in self.fits.values() for n in by})

    def network(self, kind: str, ranks: int) -> Network:
        """The `Network` whose collective model gives this fit on one node of `ranks`."""
        found = self.fits.get(kind, {}).get(ranks)
        if found is None:
            raise ValueError(f"no {kind} measured on {ranks} ranks; measured sizes "
                             f"{self.sizes}: measure those groups first")
        return Network(gpus_per_node=ranks, intra_busbw=found.busbw, nic_busbw=found.busbw,
                       base_latency=found.latency, intra_step_latency=0.0,
                       intra_tree_step_latency=0.0, net_step_latency=0.0, nvls_latency=0.0,
                       sources=self.sources)

    def seconds(self, kind: str, nbytes: float, ranks: int) -> float:
        """Seconds of one `kind` of `nbytes` (the full buffer) on a group of `ranks`
        (pipeline.planning.hardware.collectives' model with the fitted figures)."""
        if ranks == 1:
            return 0.0
        return collective_seconds(self.network(kind, ranks), kind, nbytes,
                                  Placement(ranks, ranks))

    def to_dict(self) -> dict[str, Any]:
        return {"fits": {k: {str(n): [f.latency, f.busbw] for n, f in by.items()}
                         for k, by in self.fits.items()},
                "dispatch": self.dispatch, "sources": list(self.sources)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GroupCollectives:
        return cls({k: {int(n): Fit(*v) for n, v in by.items()}
                    for k, by in data["fits"].items()},
                   float(data.get("dispatch", 0.0)), tuple(data.get("sources", ())))


def _timed(kind: str, nbytes: int, group: Any, ranks: int, repeats: int) -> float:
    """The least seconds of `kind` of an `nbytes` buffer on `group` over `repeats` (each after
    a barrier; the least, as the local microbenchmarks take, the contention of a loaded
    machine left to calibration)."""
    numel = max(ranks, nbytes // 4 // ranks * ranks)
    whole, part = torch.zeros(numel), torch.zeros(numel // ranks)
    times = []
    for _ in range(repeats + 1):
        dist.barrier(group=group)
        start = time.perf_counter()
        if kind == "all_reduce":
            dist.all_reduce(whole, group=group)
        elif kind == "all_gather":
            dist.all_gather_single(whole, part, group=group)
        else:
            dist.reduce_scatter_single(part, whole, group=group)
        times.append(time.perf_counter() - start)
    return min(times[1:])


def _dispatch(group: Any, ops: int = 16, repeats: int = 5) -> float:
    """DTensor's extra seconds per op: a chain of `ops` tiny multiplies with its backward on
    Replicate DTensors over the same on plain tensors, per op (each way counted)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = DeviceMesh.from_group(group, "cpu")

    def chain(x: torch.Tensor) -> float:
        start = time.perf_counter()
        y = x
        for _ in range(ops):
            y = y * 1.0001
        y.sum().backward()
        return time.perf_counter() - start

    plain = torch.ones(64, requires_grad=True)
    wrapped = DTensor.from_local(torch.ones(64), mesh, [Replicate()], run_check=False)
    wrapped.requires_grad_(True)
    chain(plain), chain(wrapped)
    extra = min(chain(wrapped) for _ in range(repeats)) - min(chain(plain) for _ in range(repeats))
    return max(0.0, extra / (2 * ops))


def measure_world(sizes: Sequence[int], repeats: int = 5) -> GroupCollectives:
    """Time every kind on groups of each of `sizes` consecutive ranks of the initialised
    world (every process calls it; each times its own group, this process's figures are
    returned)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    fits: dict[str, dict[int, Fit]] = {k: {} for k in KINDS}
    dispatch = 0.0
    for n in sorted({s for s in sizes if 1 < s <= world and world % s == 0}):
        mine = None
        for first in range(0, world, n):
            group = dist.new_group(list(range(first, first + n)))
            if first <= rank < first + n:
                mine = group
        assert mine is not None
        for kind in KINDS:
            points = [(float(b), _timed(kind, b, mine, n, repeats)) for b in SIZES]
            fits[kind][n] = fit(points, kind, n)
        if not dispatch:
            dispatch = _dispatch(mine)
    backend = dist.get_backend()
    return GroupCollectives(fits, dispatch, (f"measured: {backend} collectives on groups of "
                                             f"{sorted(fits['all_reduce'])} ranks",))


def _worker(rank: int, world: int, path: str, result: str, sizes: Sequence[int]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank,
                            world_size=world)
    found = measure_world(sizes)
    if rank == 0:
        Path(result).write_text(json.dumps(found.to_dict()))
    dist.destroy_process_group()


def _spawned(sizes: Sequence[int]) -> dict[str, Any]:
    import torch.multiprocessing as mp

    world = max(sizes)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "collectives.json")
        mp.spawn(_worker, args=(world, os.path.join(tmp, "store"), result, tuple(sizes)),
                 nprocs=world, join=True)
        return dict(json.loads(Path(result).read_text()))


def local_collectives(sizes: Sequence[int] = (2,), refresh: bool = False) -> GroupCollectives:
    """gloo on this host, on groups of `sizes` ranks (spawned processes, one thread each),
    measured once and cached per set of sizes."""
    wanted = sorted({int(s) for s in sizes if s > 1})
    if not wanted:
        return GroupCollectives({k: {} for k in KINDS})
    kind = "collectives-v1-" + "-".join(str(s) for s in wanted)
    return GroupCollectives.from_dict(cached(kind, lambda: _spawned(wanted), refresh))
