"""DCP saves that exchange nothing between processes: each process runs its own save with
``no_dist=True`` (DCP's save planning otherwise gathers and scatters plans and metadata with
torch's object collectives, which unpickle what other ranks send), writes its data files
under its global rank (``__<rank>_<n>.distcp``) and its part of DCP's index to
``__<rank>.metadata`` (torch's rank-local format, ``use_collectives=False``); once every
process is done, global rank 0 merges the parts (`merge_parts`) into the one ``.metadata``
that loading reads. The parts travel through the checkpoint directory, which is trusted
(its files are unpickled at load anyway), never through the network."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

PART = "__{rank}.metadata"  # torch's name for a rank-local index


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


def merge(parts: list[Metadata]) -> Metadata:
    """One index from the processes' parts: each tensor's chunks (a DTensor's shards become
    one tensor's chunks) and where each chunk is stored (the first process's copy of a
    chunk several wrote). A ValueError if a tensor's chunks do not cover it."""
    tensors: dict[str, STORAGE_TYPES] = {}
    storage: dict[MetadataIndex, Any] = {}
    planner_data: dict[str, Any] = {}
    for part in parts:
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
