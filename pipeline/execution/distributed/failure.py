"""The failure protocol between processes: every wait is bounded by the timeout; a process
that fails records the first failure of the job in the c10d store and tears its process
group down, so that its peers' waits fail at once and each of them raises `RankFailure`
naming the process that failed first (or the one that stopped answering). During setup,
before any tensor moved, the same reports travel through the store's sync points instead
(pipeline.execution.distributed.agreement)."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from pipeline.execution.distributed.topology import Layout
from pipeline.execution.timeouts import ENV_COMPILE_TIMEOUT, ENV_TIMEOUT

_FAILED_COUNT = "hybridpipe/failed/count"
_FAILED_TEXT = "hybridpipe/failed/text"


class RankFailure(RuntimeError):
    """Another rank failed (raised, was killed, or stopped answering); names it."""


def raised_text(describe: str, err: BaseException, what: str) -> str:
    """How a process's own failure is reported to the others (at setup and in steps)."""
    return f"{describe} raised {type(err).__name__} during its {what}: {err}"


def stopped_text(describe: str, what: str, cause: str) -> str:
    """The message of the RankFailure a process raises for another one's failure."""
    return f"{describe} stopped its {what} because {cause}"


class CommError(RuntimeError):
    """A wait on another rank failed (connection closed, timed out); `peer` is its global
    rank, None for a collective (which does not say which member is gone)."""

    def __init__(self, message: str, peer: int | None) -> None:
        super().__init__(message)
        self.peer = peer


class Failures:
    """Reports and explains failures for this process (`layout`) through the c10d `store`;
    `on_report` hears every report (the setup agreement passes it to its sync points)."""

    def __init__(
        self, store: dist.Store, layout: Layout, timeout: float,
        on_report: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.layout = layout
        self.timeout = timeout
        self.wait = timedelta(seconds=timeout)
        self.broken: str | None = None
        self.on_report = on_report
        self.setting = f"; set Pipeline(timeout=...) or ${ENV_TIMEOUT}"  # what bounds waits

    def report(self, text: str) -> None:
        """Record the first failure of the job in the store (later reports are dropped)."""
        try:
            if self.store.add(_FAILED_COUNT, 1) == 1:
                self.store.set(_FAILED_TEXT, text)
        except RuntimeError:
            pass  # the store went down with the failed rank: peers fall back to their own view
        if self.on_report is not None:
            self.on_report(text)

    def cause(self) -> str | None:
        """The failure recorded in the store, if any (never blocks)."""
        try:
            if self.store.check([_FAILED_TEXT]):
                return self.store.get(_FAILED_TEXT).decode()
        except RuntimeError:
            return None
        return None

    def _await_cause(self, seconds: float) -> str | None:
        try:
            self.store.wait([_FAILED_TEXT], timedelta(seconds=seconds))
        except RuntimeError:  # DistStoreError (timeout, store gone) derives from RuntimeError
            return None
        return self.cause()

    @contextmanager
    def allowing(self, seconds: float) -> Iterator[None]:
        """Bound the waits inside by the compile allowance `seconds` instead of the timeout
        (never by less): a step in which a process may be compiling (see
        pipeline.execution.distributed.executor)."""
        saved = self.timeout, self.wait, self.setting
        if seconds > self.timeout:
            self.timeout, self.wait = seconds, timedelta(seconds=seconds)
            self.setting = (", the compile allowance of a step in which a process may "
                            f"compile; set Pipeline(compile_timeout=...) or ${ENV_COMPILE_TIMEOUT}")
        try:
            yield
        finally:
            self.timeout, self.wait, self.setting = saved

    @staticmethod
    def tear_down() -> None:
        """Destroy the process groups so peers blocked on this rank fail at once."""
        if dist.is_initialized():
            dist.destroy_process_group()

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Run a collective piece of work; on failure record/explain it, tear the groups down
        and raise (the original error for a local fault, RankFailure for a peer's)."""
        if self.broken is not None:
            raise RankFailure(
                f"{self.layout.describe()} cannot run a {what}: the process groups were torn "
                f"down after an earlier failure ({self.broken}); restart the job from a checkpoint"
            )
        try:
            yield
        except RankFailure:
            raise  # already explained by an inner guard
        except BaseException as err:
            cause = self.cause()
            comm = err if isinstance(err, CommError) else self.tp_collective_error(err)
            if cause is None and comm is not None:
                if comm.peer is None:
                    # A collective does not say which member is gone; a point-to-point peer
                    # of the failed rank usually does, moments later.
                    cause = self._await_cause(min(self.timeout, 3.0))
                if cause is None:
                    peer = "a peer" if comm.peer is None else self.layout.describe(comm.peer)
                    cause = f"{peer} stopped responding (killed, crashed or hung): {comm}"
                    self.report(cause)
            if cause is not None:  # another rank failed first; this error follows from it
                self.broken = cause
                self.tear_down()
                raise RankFailure(stopped_text(self.layout.describe(), what, cause)) from err
            text = raised_text(self.layout.describe(), err, what)
            self.report(text)
            self.broken = text
            self.tear_down()
            err.add_note(f"hybridpipe: {text}; the other ranks are told and stop")
            raise

    def tp_collective_error(self, err: BaseException) -> CommError | None:
        """`err` as a CommError when it is a tensor-parallel collective's failure: a
        RuntimeError raised inside torch.distributed while a stage ran on its tp group (the
        other waits of a step go through `wait_work`). Its peer is the other member of a tp
        group of 2; None (any member) in a larger one."""
        tp = self.layout.tp_ranks()
        if len(tp) < 2 or not isinstance(err, RuntimeError) or isinstance(err, RankFailure):
            return None
        frames = traceback.extract_tb(err.__traceback__)
        if not any(f"torch{os.sep}distributed{os.sep}" in f.filename for f in frames):
            return None
        others = [r for r in tp if r != self.layout.rank]
        source = self.layout.describe(others[0]) if len(others) == 1 else f"tp group {tp}"
        return CommError(
            f"{self.layout.describe()} waiting for a tensor-parallel collective with {source} "
            f"failed (timeout {self.timeout:g} s{self.setting}): {str(err).splitlines()[0]}",
            others[0] if len(others) == 1 else None,
        )

    def wait_work(self, work: Any, peer: int | None, what: object) -> None:
        """Wait for a torch.distributed Work under the timeout, as a CommError on failure."""
        try:
            work.wait(timeout=self.wait)
        except RuntimeError as err:
            source = "the other ranks" if peer is None else self.layout.describe(peer)
            raise CommError(
                f"{self.layout.describe()} waiting for {what} from {source} failed "
                f"(timeout {self.timeout:g} s{self.setting}): "
                f"{str(err).splitlines()[0]}",
                peer,
            ) from err
