"""Where each process sits: world = data_parallel x stages x tensor_parallel as a DeviceMesh
with dims ("dp", "pp", "tp"), tp innermost (consecutive ranks: a tp group sits within one
node). A process's pipeline rank (which stages it holds) is its "pp" coordinate, its replica
its "dp" coordinate, its part of each held stage's width its "tp" coordinate. Pipeline peers
and gradient groups are taken at the process's own tp coordinate: a pipeline is the ranks of
one (dp, tp) pair, a gradient group the ranks of one (pp, tp) pair. Nothing here computes
ranks by hand: every answer is read off the mesh."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

DIMS = ("dp", "pp", "tp")


def check_world(stages: int, data_parallel: int | None, world_size: int,
                tensor_parallel: int = 1) -> int:
    """`data_parallel` for `stages` x `tensor_parallel` processes per replica in a world of
    `world_size` processes (default world // (stages x tp)); ValueError naming the fix when
    they do not fit."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be an int >= 1, got {stages!r}")
    tp = tensor_parallel
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel must be an int >= 1, got {tp!r}")
    per_replica = stages * tp
    what = f"stages={stages}" if tp == 1 else f"stages={stages} x tensor_parallel={tp}"
    if data_parallel is None:
        if world_size % per_replica != 0:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(
                f"world size {world_size} is not divisible by {what}: every replica "
                f"needs {per_replica} processes; use stages x tensor_parallel in {divisors} or "
                f"launch a multiple of {per_replica} processes (torchrun --nproc-per-node)"
            )
        data_parallel = world_size // per_replica
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ValueError(f"data_parallel must be an int >= 1, got {data_parallel!r}")
    if per_replica * data_parallel != world_size:
        raise ValueError(
            f"{what} x data_parallel={data_parallel} = {per_replica * data_parallel} "
            f"processes, but the world has {world_size}; launch {per_replica * data_parallel} "
            "processes, or drop data_parallel (it defaults to world size // "
            f"{'stages' if tp == 1 else '(stages x tensor_parallel)'})"
        )
    return data_parallel


@dataclass(frozen=True)
class Layout:
    """This process's place in a (dp, pp, tp) DeviceMesh: `cube[d][p][t]` is the global rank
    of tp rank t of pipeline rank p in replica d (`mesh.mesh`), `(dp_rank, pp_rank,
    tp_rank)` this process's coordinate (`mesh.get_coordinate()`); `grid[d][p]` the global
    ranks at this process's tp coordinate (its pipelines and gradient groups)."""

    cube: tuple[tuple[tuple[int, ...], ...], ...]
    rank: int
    dp_rank: int
    pp_rank: int
    tp_rank: int = 0

    @classmethod
    def of(cls, mesh: DeviceMesh) -> Layout:
        if mesh.mesh_dim_names != DIMS:
            raise ValueError(f"the mesh has dims {mesh.mesh_dim_names}; expected {DIMS}")
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise ValueError("this process is not part of the (dp, pp, tp) mesh")
        cube = tuple(tuple(tuple(int(r) for r in row) for row in plane)
                     for plane in mesh.mesh.tolist())
        dp_rank, pp_rank, tp_rank = coordinate
        return cls(cube, cube[dp_rank][pp_rank][tp_rank], dp_rank, pp_rank, tp_rank)

    @property
    def grid(self) -> tuple[tuple[int, ...], ...]:
        """`grid[d][p]`: the global rank of pipeline rank p in replica d at this process's tp
        coordinate."""
        return tuple(tuple(row[self.tp_rank] for row in plane) for plane in self.cube)

    @property
    def tensor_parallel(self) -> int:
        """Ranks sharing each held stage's width (the mesh's "tp" size)."""
        return len(self.cube[0][0])

    def tp_ranks(self) -> list[int]:
        """Global ranks of this process's tp group (its pipeline rank in its replica)."""
        return list(self.cube[self.dp_rank][self.pp_rank])

    @property
    def stages(self) -> int:
        """Pipeline ranks per replica (the mesh's "pp" size)."""
        return len(self.grid[0])

    @property
    def data_parallel(self) -> int:
        """Replicas of the pipeline (the mesh's "dp" size)."""
        return len(self.grid)

    @property
    def world_size(self) -> int:
        return self.stages * self.data_parallel * self.tensor_parallel

    def global_rank(self, pp_rank: int, dp_rank: int | None = None) -> int:
        """The global rank of pipeline rank `pp_rank` in replica `dp_rank` (default: ours)."""
        return self.grid[self.dp_rank if dp_rank is None else dp_rank][pp_rank]

    def pipeline_ranks(self, dp_rank: int | None = None) -> list[int]:
        """Global ranks of one replica's pipeline, in pipeline-rank order (a mesh row)."""
        return list(self.grid[self.dp_rank if dp_rank is None else dp_rank])

    def replica_ranks(self, pp_rank: int | None = None) -> list[int]:
        """Global ranks holding the same stages, one per replica (a mesh column): a
        gradient group."""
        p = self.pp_rank if pp_rank is None else pp_rank
        return [row[p] for row in self.grid]

    def coordinate(self, rank: int) -> tuple[int, int]:
        """(replica, pipeline rank) of global rank `rank`."""
        d, p, _ = self.coordinate3(rank)
        return d, p

    def coordinate3(self, rank: int) -> tuple[int, int, int]:
        """(replica, pipeline rank, tp rank) of global rank `rank`."""
        for d, plane in enumerate(self.cube):
            for p, row in enumerate(plane):
                if rank in row:
                    return d, p, row.index(rank)
        raise ValueError(f"rank {rank} is not in the mesh {self.cube}")

    def describe(self, rank: int | None = None) -> str:
        """E.g. 'rank 5 (pipeline rank 1 of replica 1)', with the tp rank when tp > 1."""
        r = self.rank if rank is None else rank
        d, p, t = self.coordinate3(r)
        tp = f", tp rank {t}" if self.tensor_parallel > 1 else ""
        return f"rank {r} (pipeline rank {p}{tp} of replica {d})"


def make_layout(
    stages: int, data_parallel: int | None = None, *, world_size: int, rank: int,
    tensor_parallel: int = 1,
) -> Layout:
    """The Layout of `rank` in the mesh `init_device_mesh` would build for this world, without
    creating process groups (for planning and tests)."""
    dp = check_world(stages, data_parallel, world_size, tensor_parallel)
    warn_if_tp_spans_nodes(tensor_parallel, os.environ.get("LOCAL_WORLD_SIZE"))
    mesh = DeviceMesh(
        "cpu", torch.arange(world_size).reshape(dp, stages, tensor_parallel),
        mesh_dim_names=DIMS, _init_backend=False, _rank=rank,
    )
    return Layout.of(mesh)


def warn_if_tp_spans_nodes(tensor_parallel: int, local_world_size: str | None) -> None:
    """A UserWarning when a tp group of `tensor_parallel` consecutive ranks crosses a node
    boundary (torchrun's `LOCAL_WORLD_SIZE` processes per node, not a multiple of tp): it is
    correct, but every collective inside each stage's ops then crosses the network."""
    if tensor_parallel == 1 or not local_world_size:
        return
    node = int(local_world_size)
    if node % tensor_parallel:
        fits = [t for t in range(1, node + 1) if node % t == 0]
        warnings.warn(
            f"tensor_parallel={tensor_parallel} does not divide the {node} processes per node "
            f"(LOCAL_WORLD_SIZE={node}): some tp groups span two nodes and run each stage's "
            f"collectives over the network; use tensor_parallel in {fits} or launch a "
            "multiple of it per node (torchrun --nproc-per-node)", stacklevel=3)
