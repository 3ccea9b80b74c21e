"""Where each process sits: world = data_parallel x stages as a DeviceMesh with dims
("dp", "pp"). A process's pipeline rank (which stages it holds) is its "pp" coordinate, its
replica its "dp" coordinate; the global ranks of a pipeline are a row of the mesh and the
replicas of one pipeline rank (a gradient group) a column. Nothing here computes ranks by
hand: every answer is read off the mesh."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

DIMS = ("dp", "pp")


def check_world(stages: int, data_parallel: int | None, world_size: int) -> int:
    """`data_parallel` for `stages` in a world of `world_size` processes (default
    world // stages); ValueError naming the fix when they do not fit."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be an int >= 1, got {stages!r}")
    if data_parallel is None:
        if world_size % stages != 0:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(
                f"world size {world_size} is not divisible by stages={stages}: every replica "
                f"needs {stages} processes; use stages in {divisors} or launch a multiple of "
                f"{stages} processes (torchrun --nproc-per-node)"
            )
        data_parallel = world_size // stages
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ValueError(f"data_parallel must be an int >= 1, got {data_parallel!r}")
    if stages * data_parallel != world_size:
        raise ValueError(
            f"stages={stages} x data_parallel={data_parallel} = {stages * data_parallel} "
            f"processes, but the world has {world_size}; launch {stages * data_parallel} "
            "processes, or drop data_parallel (it defaults to world size // stages)"
        )
    return data_parallel


@dataclass(frozen=True)
class Layout:
    """This process's place in a (dp, pp) DeviceMesh: `grid[d][p]` is the global rank of
    pipeline rank p in replica d (`mesh.mesh`), `(dp_rank, pp_rank)` this process's
    coordinate (`mesh.get_coordinate()`)."""

    grid: tuple[tuple[int, ...], ...]
    rank: int
    dp_rank: int
    pp_rank: int

    @classmethod
    def of(cls, mesh: DeviceMesh) -> Layout:
        if mesh.mesh_dim_names != DIMS:
            raise ValueError(f"the mesh has dims {mesh.mesh_dim_names}; expected {DIMS}")
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise ValueError("this process is not part of the (dp, pp) mesh")
        grid = tuple(tuple(int(r) for r in row) for row in mesh.mesh.tolist())
        dp_rank, pp_rank = coordinate
        return cls(grid, grid[dp_rank][pp_rank], dp_rank, pp_rank)

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
        return self.stages * self.data_parallel

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
        for d, row in enumerate(self.grid):
            if rank in row:
                return d, row.index(rank)
        raise ValueError(f"rank {rank} is not in the mesh {self.grid}")

    def describe(self, rank: int | None = None) -> str:
        """E.g. 'rank 5 (pipeline rank 1 of replica 1)'."""
        r = self.rank if rank is None else rank
        d, p = self.coordinate(r)
        return f"rank {r} (pipeline rank {p} of replica {d})"


def make_layout(
    stages: int, data_parallel: int | None = None, *, world_size: int, rank: int
) -> Layout:
    """The Layout of `rank` in the mesh `init_device_mesh` would build for this world, without
    creating process groups (for planning and tests)."""
    dp = check_world(stages, data_parallel, world_size)
    mesh = DeviceMesh(
        "cpu", torch.arange(world_size).reshape(dp, stages), mesh_dim_names=DIMS,
        _init_backend=False, _rank=rank,
    )
    return Layout.of(mesh)
