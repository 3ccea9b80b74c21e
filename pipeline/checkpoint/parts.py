"""DCP saves that exchange nothing between processes: each process runs its own save with
``no_dist=True`` (DCP's save planning otherwise gathers and scatters plans and metadata with
torch's object collectives, which unpickle what other ranks send), writes its data files
under its global rank (``__<rank>_<n>.distcp``) and its part of DCP's index to
``__<rank>.metadata`` (torch's rank-local format, ``use_collectives=False``); once every
process is done, global rank 0 merges the parts (`merge_parts`) into the one ``.metadata``
that loading reads. The parts travel through the checkpoint directory, which is trusted
(its files are unpickled at load anyway), never through the network.

A DTensor shard is one chunk of its tensor, except a fused projection's tensor-parallel shard
(``_StridedShard``: each rank holds its part of each of the projection's chunks, which is no
contiguous block; DCP would record it as one and load it wrong at another tp degree). Such a
shard is written as one piece per projection chunk (`strided_pieces`, each a plain
``Shard`` of that chunk under a key of its own), and the merge turns the pieces back into
chunks of the one tensor (`merge`), so the index holds every tensor under its model key, as
one whole tensor that loads at any layout."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

PART = "__{rank}.metadata"  # torch's name for a rank-local index
_PIECE = "{key}@strided:dim{dim}:{j}of{n}"  # one projection chunk of a strided shard
_PIECE_KEY = re.compile(r"^(?P<key>.*)@strided:dim(?P<dim>\d+):(?P<j>\d+)of(?P<n>\d+)$")


def strided_pieces(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """`tensors` with each DTensor held as a ``_StridedShard`` (a fused projection's
    tensor-parallel shard: this rank's heads of q, k and v) replaced by one piece per
    projection chunk, each a ``Shard`` of that chunk (a contiguous block DCP can record);
    `merge` makes them chunks of the one tensor again."""
    out: dict[str, Tensor] = {}
    for key, t in tensors.items():
        placement = t.placements[0] if isinstance(t, DTensor) and t.device_mesh.ndim == 1 \
            else None
        n = placement.split_factor if isinstance(placement, _StridedShard) else None
        if not isinstance(t, DTensor) or not isinstance(placement, _StridedShard) \
                or not isinstance(n, int) or n < 2:
            out[key] = t
            continue
        local = t.to_local()
        dim = placement.dim
        size = local.shape[dim] // n
        for j in range(n):
            piece = local.narrow(dim, j * size, size).contiguous()
            out[_PIECE.format(key=key, dim=dim, j=j, n=n)] = DTensor.from_local(
                piece, t.device_mesh, [Shard(dim)], run_check=False)
    return out


class RankWriter(FileSystemWriter):
    """DCP's FileSystemWriter for a save run with ``no_dist=True`` by process `rank` of a job:
    files named by that rank, its index part in ``__<rank>.metadata``."""

    def __init__(self, path: str | os.PathLike[str], rank: int) -> None:
        super().__init__(path)
        self.global_rank = rank

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # DCP passes rank 0 under no_dist; the rank-local format names files by the real one.
        kwargs.update(rank=self.global_rank, use_collectives=False)
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    def _metadata_exists(self) -> bool:
        # torch's looks for rank 0's part, which another process may just have written.
        return bool(self.fs.exists(self._get_metadata_path(self.global_rank)))


def _chunk_key(chunk: ChunkStorageMetadata) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(chunk.offsets), tuple(chunk.sizes)


def _merge_entry(key: str, have: STORAGE_TYPES, item: STORAGE_TYPES) -> None:
    """Add `item`'s chunks to `have` (the same tensor saved by another process); a chunk two
    processes both wrote (a replicated shard) is kept once."""
    if not isinstance(have, TensorStorageMetadata) or not isinstance(
            item, TensorStorageMetadata):
        return  # bytes: one copy is the value
    if tuple(have.size) != tuple(item.size) or have.properties.dtype != item.properties.dtype:
        raise ValueError(
            f"the processes saved {key!r} with different shapes or dtypes "
            f"({tuple(have.size)} {have.properties.dtype} vs {tuple(item.size)} "
            f"{item.properties.dtype}); every process must hold the same model"
        )
    seen = {_chunk_key(c) for c in have.chunks}
    have.chunks.extend(c for c in item.chunks if _chunk_key(c) not in seen)


def _shifted(chunk: ChunkStorageMetadata, dim: int, by: int) -> torch.Size:
    offsets = list(chunk.offsets)
    offsets[dim] += by
    return torch.Size(offsets)


def _rejoined(part: Metadata) -> Metadata:
    """`part` with the pieces of strided shards (`strided_pieces`) as chunks of their tensor:
    piece j of n holds block j of the tensor's n along its dim."""
    entries: dict[str, STORAGE_TYPES] = {}
    moved: dict[str, tuple[str, int, int]] = {}  # piece key -> (key, dim, offset of block j)
    for key, item in part.state_dict_metadata.items():
        found = _PIECE_KEY.match(key)
        if found is None or not isinstance(item, TensorStorageMetadata):
            entries[key] = item
            continue
        base, dim, j, n = (found["key"], int(found["dim"]), int(found["j"]), int(found["n"]))
        by = j * item.size[dim]
        moved[key] = (base, dim, by)
        size = list(item.size)
        size[dim] *= n
        chunks = [ChunkStorageMetadata(offsets=_shifted(c, dim, by), sizes=c.sizes)
                  for c in item.chunks]
        whole = TensorStorageMetadata(item.properties, torch.Size(size), chunks)
        if base in entries:
            _merge_entry(base, entries[base], whole)
        else:
            entries[base] = whole
    storage: dict[MetadataIndex, Any] = {}
    for index, info in (part.storage_data or {}).items():
        if index.fqn in moved and index.offset is not None:
            base, dim, by = moved[index.fqn]
            offsets = list(index.offset)
            offsets[dim] += by
            index = MetadataIndex(base, torch.Size(offsets))
        storage[index] = info
    planner_data = {k: v for k, v in (part.planner_data or {}).items() if k not in moved}
    planner_data.update({base: (base,) for base, _, _ in moved.values()})
    return Metadata(state_dict_metadata=entries, planner_data=planner_data,
                    storage_data=storage)


def merge(parts: list[Metadata]) -> Metadata:
    """One index from the processes' parts: each tensor's chunks (a DTensor's shards become
    one tensor's chunks, the pieces of a strided shard too) and where each chunk is stored
    (the first process's copy of a chunk several wrote). A ValueError if a tensor's chunks
    do not cover it."""
    tensors: dict[str, STORAGE_TYPES] = {}
    storage: dict[MetadataIndex, Any] = {}
    planner_data: dict[str, Any] = {}
    for part in map(_rejoined, parts):
        for key, item in part.state_dict_metadata.items():
            if key not in tensors:
                tensors[key] = (
                    TensorStorageMetadata(item.properties, item.size, list(item.chunks))
                    if isinstance(item, TensorStorageMetadata) else item
                )
            else:
                _merge_entry(key, tensors[key], item)
        for index, info in (part.storage_data or {}).items():
            storage.setdefault(index, info)
        planner_data.update(part.planner_data or {})
    for key, item in tensors.items():
        if isinstance(item, TensorStorageMetadata) and len(item.size) > 0:
            covered = sum(math.prod(c.sizes) for c in item.chunks)
            if covered != math.prod(item.size):
                raise ValueError(
                    f"the processes' saved shards of {key!r} cover {covered} of its "
                    f"{math.prod(item.size)} elements; the checkpoint would be incomplete"
                )
    return Metadata(state_dict_metadata=tensors, planner_data=planner_data,
                    storage_data=storage)


def merge_parts(version: Path, world: int) -> None:
    """(Global rank 0, every process's save done) merge the `world` processes' index parts in
    `version` into its ``.metadata`` (written by DCP's own writer: temp file, fsync, rename),
    then delete the parts."""
    reader = FileSystemReader(version)
    parts = []
    for rank in range(world):
        if not (version / PART.format(rank=rank)).is_file():
            raise FileNotFoundError(
                f"process {rank} wrote no checkpoint index part "
                f"{str(version / PART.format(rank=rank))!r}; the save is incomplete"
            )
        parts.append(reader.read_metadata(rank=rank))
    merged = merge(parts)
    results = [WriteResult(index=index, size_in_bytes=info.length, storage_data=info)
               for index, info in merged.storage_data.items()]
    FileSystemWriter(version).finish(metadata=merged, results=[results])
    for rank in range(world):
        (version / PART.format(rank=rank)).unlink()
