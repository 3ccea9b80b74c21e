"""Checksums of a checkpoint version's files, so that silent corruption (a changed bit inside
tensor data, which DCP and torch.save would load as a wrong weight) is found before anything
loads: CRC32C, the checksum of iSCSI, ext4 metadata and cloud object stores, computed in
hardware by the `crc32c` package (a few GB/s a core: benchmarks/results/checkpoint.md).

Each process checksums its DCP shard files as it writes them (`ChecksummingWriter`: the bytes
are hashed on their way to the file, never read back) and writes ``checksums-r<rank>.json``;
global rank 0 adds ``checksums-index.json`` for DCP's index and ``hybridpipe.pt`` before the
version goes live. Each list carries a CRC32C of itself. A reader checks the files it is about
to read (`mismatch`) against the union of the lists (`recorded`)."""

from __future__ import annotations

import io
import json
import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import crc32c
from torch.distributed.checkpoint.filesystem import FileSystem

from pipeline.checkpoint.parts import RankWriter

ALGORITHM = "crc32c"
PREFIX = "checksums-"
INDEX = f"{PREFIX}index.json"
Sums = dict[str, list[int]]  # file name -> [size, crc32c]


def file_crc(path: Path) -> int:
    """CRC32C of a file's bytes, hashed from a read-only memory map: one pass over the page
    cache with no copy and no buffer to allocate (a 16 MiB read buffer cost more than the
    hashing itself: a fresh zeroed mapping per call). The caller checks the size first; files
    here are never truncated in place (a version is written once, then only deleted)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return 0  # an empty file cannot be mapped
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return cast(int, crc32c.crc32c(view))


class _CrcStream(io.RawIOBase):
    """A file opened for writing that hashes every byte written to it."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw = raw
        self.crc = 0
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = crc32c.crc32c(view, self.crc)
        self.size += len(view)
        return cast(int, self.raw.write(view))

    def tell(self) -> int:
        return cast(int, self.raw.tell())

    def fileno(self) -> int:
        return cast(int, self.raw.fileno())

    def flush(self) -> None:
        self.raw.flush()


class _ChecksummingFileSystem(FileSystem):
    def __init__(self, sums: Sums) -> None:
        super().__init__()
        self.sums = sums

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as raw:
            if mode != "wb" or not str(path).endswith(".distcp"):
                yield raw
                return
            stream = _CrcStream(raw)
            yield cast(io.IOBase, stream)
            self.sums[Path(path).name] = [stream.size, stream.crc]


class ChecksummingWriter(RankWriter):
    """Process `rank`'s DCP writer (`RankWriter`) that checksums the shard files it writes
    (`sums`)."""

    def __init__(self, path: str | os.PathLike[str], rank: int) -> None:
        super().__init__(path, rank)
        self.sums: Sums = {}
        self.fs = _ChecksummingFileSystem(self.sums)


def _write_list(path: Path, files: Sums) -> None:
    body = json.dumps({"algorithm": ALGORITHM, "files": files,
                       "crc": crc32c.crc32c(json.dumps(files, sort_keys=True).encode())})
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_rank_checksums(version: Path, rank: int, sums: Sums) -> None:
    """This process's shard checksums, once its DCP write is done."""
    _write_list(version / f"{PREFIX}r{rank}.json", sums)


def write_index_checksums(version: Path, names: tuple[str, ...]) -> None:
    """(Global rank 0, before the version goes live) checksum the small index files."""
    _write_list(version / INDEX, {n: [(version / n).stat().st_size, file_crc(version / n)]
                                  for n in names})


def rank_lists(version: Path) -> int:
    """How many processes' checksum lists `version` holds."""
    return sum(1 for p in version.glob(f"{PREFIX}r*.json"))


def recorded(version: Path) -> Sums | None:
    """Every checksum written for `version` (None if it has none: a checkpoint written before
    checksums existed); a ValueError naming a list that is itself damaged."""
    lists = sorted(version.glob(f"{PREFIX}*.json"))
    if not lists:
        return None
    merged: Sums = {}
    for path in lists:
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
            files = saved["files"]
            ok = saved["algorithm"] == ALGORITHM and saved["crc"] == crc32c.crc32c(
                json.dumps(files, sort_keys=True).encode())
            merged.update({str(k): [int(v[0]), int(v[1])] for k, v in files.items()})
        except (ValueError, KeyError, TypeError, IndexError):
            ok = False
        if not ok:
            raise ValueError(
                f"checkpoint file {str(path)!r} is damaged (its own checksum does not match); "
                "nothing was loaded: load an older version (save with keep= to retain some)"
            )
    return merged


def mismatch(path: Path, sums: Sums) -> str | None:
    """Why `path` differs from what was written (never recorded, another size, another
    CRC32C), or None when it matches."""
    if path.name not in sums:
        return ("it has no recorded checksum (it was not written with this checkpoint, or a "
                "process's checksum list is missing)")
    size, crc = sums[path.name]
    actual = path.stat().st_size if path.is_file() else -1
    if actual < 0:
        return "it is missing"
    if actual != size:
        return f"it has {actual} bytes, {size} written"
    if file_crc(path) != crc:
        return (f"its {ALGORITHM.upper()} checksum differs from the one written with it "
                "(silent corruption: changed bytes)")
    return None
