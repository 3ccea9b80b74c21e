"""Asynchronous checkpoint saves: DCP's `async_save` stages this process's tensors (a CPU copy)
while the caller waits, then writes them from a background thread; global rank 0 makes the new
version live once every process's files and checksum lists are written. One save is in flight
at a time; its outcome (an error, a full disk named as such) comes back at `wait`, which the
next save calls.

Under torch.distributed each process's background write runs on its own (no collectives:
pipeline.checkpoint.parts), and global rank 0 waits for the others' files in the checkpoint
directory. `wait` learns whether any process failed over a gloo process group of the writer's
own, made at the first asynchronous save (every process saves at the same step, so the groups
are made in the same order everywhere), so it never interleaves with the training's
collectives on the default group."""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch.distributed.checkpoint as dcp
from torch import Tensor

from pipeline.checkpoint.checksums import ChecksummingWriter, rank_lists, write_rank_checksums
from pipeline.checkpoint.files import _single_process_quiet, as_disk_full, failure_reason
from pipeline.execution.processes import Processes

_WRITERS: weakref.WeakSet[AsyncWriter] = weakref.WeakSet()
_FAILED = "failed-r{rank}.txt"  # a process's failed write, for global rank 0 to see at once


def _mark_failed(version: Path, rank: int, err: BaseException) -> None:
    """Tell global rank 0, which waits for every process's files in `version`, that this
    process's write failed (without it rank 0 would wait for the timeout)."""
    try:
        (version / _FAILED.format(rank=rank)).write_text(
            f"process {rank}: {failure_reason(err)}")
    except OSError:
        pass  # a full disk or the version already removed: rank 0 times out instead


@atexit.register
def _release_groups() -> None:
    """Drop the writers' process groups while the interpreter is whole (atexit runs after the
    non-daemon threads, a write in flight included, have ended): a gloo group left for the
    interpreter's teardown could end the process in std::terminate."""
    for writer in list(_WRITERS):
        writer._any = None


class AsyncWriter:
    """Runs one process's asynchronous saves (`start`) and waits for them (`wait`)."""

    def __init__(self, processes: Processes, timeout: float) -> None:
        self._processes = processes
        self.timeout = timeout
        # Whether any process's save failed (a side channel, made at the first save).
        self._any: Callable[[bool, float], bool] | None = None
        _WRITERS.add(self)
        self._done: threading.Event | None = None  # set when the save in flight has ended
        self._error: BaseException | None = None
        self._where: tuple[Path, int] = (Path(), 0)

    def start(
        self, tensors: dict[str, Tensor], version: Path, *, finish: Callable[[], None] | None,
        discard: Callable[[], None], root: Path, need: int,
    ) -> None:
        """Stage `tensors` (returns when copied) and write them to `version` in the
        background; then `finish` (global rank 0: metadata and the switch to the new
        version) or, on failure, `discard`. The caller has waited for the previous save."""
        if self._done is not None:
            raise RuntimeError("a checkpoint save is still in flight; call wait() first")
        if self._any is None:
            self._any = self._processes.side_channel(self.timeout)
        done = threading.Event()
        self._error, self._where = None, (root, need)

        rank, world = self._processes.rank, self._processes.world_size
        storage = ChecksummingWriter(version, rank)

        def ended(future: Any) -> None:
            try:
                future.result()
                write_rank_checksums(version, rank, storage.sums)  # after its index part
                if finish is not None:
                    self._await_checksums(version, world)
                    finish()
            except BaseException as err:  # handed to wait(), in the caller's thread
                discard()
                _mark_failed(version, rank, err)
                self._error = err
            finally:
                done.set()

        with _single_process_quiet():  # each process on its own: no DCP collectives
            future = dcp.async_save(tensors, storage_writer=storage, no_dist=True)
        self._done = done
        # A Future: FileSystemWriter stages (copies) before async_save returns.
        cast(Future, future).add_done_callback(ended)

    def _await_checksums(self, version: Path, world: int) -> None:
        """(Global rank 0) wait until every process has written its checksum list (each does
        so as its own background write ends), bounded by the timeout."""
        deadline = time.monotonic() + self.timeout
        while rank_lists(version) < world:
            failed = sorted(version.glob(_FAILED.format(rank="*")))
            if failed:
                raise RuntimeError(
                    f"the background checkpoint write failed on another process "
                    f"({failed[0].read_text(errors='replace')}); the previous checkpoint "
                    "stays live"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {rank_lists(version)} of {world} processes wrote their checkpoint "
                    f"checksums to {str(version)!r} within {self.timeout:g} s; the previous "
                    "checkpoint stays live"
                )
            time.sleep(0.01)  # a poll with a deadline: the lists arrive within milliseconds

    def wait(self, timeout: float | None = None) -> None:
        """Return once the save in flight (if any) is live on every process; raise its error
        (a full disk as OSError(ENOSPC)) otherwise. Under torch.distributed every process
        calls it. Bounded by `timeout` seconds (default: the pipeline's timeout)."""
        done = self._done
        if done is None:
            return
        limit = self.timeout if timeout is None else timeout
        if not done.wait(limit):  # still in flight: a later wait waits for it again
            raise TimeoutError(
                f"the background checkpoint save to {str(self._where[0])!r} did not end within "
                f"{limit:g} s; the previous checkpoint stays live. Wait longer "
                "(pipe.wait_checkpoint(timeout=...)) or check the storage"
            )
        self._done = None
        failed = self._error is not None
        # Every process learns whether any failed (global rank 0's switch included).
        if self._any is not None and self._any(failed, limit) and not failed:
            raise RuntimeError(
                "the background checkpoint save failed on another process (its error is "
                "raised there); the previous checkpoint stays live"
            )
        if self._error is not None:
            err, self._error = self._error, None
            raise as_disk_full(err, *self._where)
