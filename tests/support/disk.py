"""A disk that fills up: DCP's file streams raise ENOSPC after a number of bytes, for the
checkpoint and elastic tests of what a full disk leaves behind."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest


class FullDiskStream:
    """A DCP file stream on a disk that fills up after `room` bytes."""

    def __init__(self, stream: Any, room: int) -> None:
        self.stream, self.room = stream, room

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if n > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= n
        return int(self.stream.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextmanager
def full_disk(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Within the block, DCP's files fill the disk after 1,000 bytes (ENOSPC)."""
    from torch.distributed.checkpoint import filesystem

    real = filesystem.FileSystem.create_stream

    @contextmanager
    def filling(self: Any, path: Any, mode: str) -> Any:
        with real(self, path, mode) as stream:
            yield FullDiskStream(stream, 1000) if "w" in mode else stream

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", filling)
    try:
        yield
    finally:
        monkeypatch.undo()
