"""Checksums of a checkpoint version's files, so that silent corruption (a flipped bit inside
tensor data, which DCP and torch.save would load as a wrong weight) is found before anything
loads: CRC32C (hardware-accelerated through the `crc32c` package; about 2 GB/s on this
project's CPUs under load, see benchmarks/bench_checkpoint.py), the checksum iSCSI, ext4 and
cloud object stores use.

When a version is complete (every process has written its DCP files and global rank 0 its
``hybridpipe.pt``), global rank 0 writes ``checksums.json`` beside them: each file's size and
CRC32C, and a CRC32C of that list itself. A reader checks the files it is about to read
(`mismatch`) and names the first that differs in a ValueError."""

from __future__ import annotations

import json
import os
from pathlib import Path

import crc32c

FILE = "checksums.json"
ALGORITHM = "crc32c"
_CHUNK = 16 * 2**20


def file_crc(path: Path) -> int:
    """CRC32C of a file's bytes, read in chunks."""
    crc = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = crc32c.crc32c(view[:n], crc)
    return crc


def _body_crc(files: dict[str, list[int]]) -> int:
    return crc32c.crc32c(json.dumps(files, sort_keys=True).encode())


def write_checksums(version: Path) -> None:
    """(Global rank 0, the version complete) checksum every file of `version` and write
    ``checksums.json`` (fsynced; the directory is fsynced when the version goes live)."""
    files = {
        p.name: [p.stat().st_size, file_crc(p)]
        for p in sorted(version.iterdir()) if p.is_file() and p.name != FILE
    }
    text = json.dumps({"algorithm": ALGORITHM, "files": files, "crc": _body_crc(files)})
    with open(version / FILE, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def recorded(version: Path) -> dict[str, list[int]] | None:
    """The checksums `write_checksums` recorded for `version` (None if it has none: a
    checkpoint written before checksums existed); a ValueError if the list is damaged."""
    path = version / FILE
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        files = saved["files"]
        ok = saved["algorithm"] == ALGORITHM and saved["crc"] == _body_crc(files)
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ValueError(
            f"checkpoint file {str(path)!r} is damaged (its own checksum does not match); "
            "nothing was loaded: load an older version (save with keep= to retain some)"
        )
    return {str(name): [int(v) for v in entry] for name, entry in files.items()}


def mismatch(path: Path, checksums: dict[str, list[int]]) -> str | None:
    """Why `path` differs from what was written (never recorded, another size, another
    CRC32C), or None when it matches."""
    if path.name not in checksums:
        return ("it has no recorded checksum (it was not written with this checkpoint, or "
                f"{FILE} was replaced)")
    size, crc = checksums[path.name]
    actual = path.stat().st_size if path.is_file() else -1
    if actual < 0:
        return "it is missing"
    if actual != size:
        return f"it has {actual} bytes, {size} written"
    if file_crc(path) != crc:
        return (f"its {ALGORITHM.upper()} checksum differs from the one written with it "
                "(silent corruption: changed bytes)")
    return None
