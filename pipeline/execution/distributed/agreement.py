"""Setup-time agreement of a distributed Pipeline's processes, over the c10d store (the setup
side of the failure protocol in pipeline.execution.distributed.failure).

Before the first tensor moves, the processes meet at sync points (the settings, the first
batch, the plan, the start). At each, every process checks in with its settings; global rank 0,
the plan's owner, compares them with its own and gives one verdict that every process reads:
rank 0's payload (the example microbatch, the plan), or a message naming each differing
setting, its value on each rank and the fix (`SettingsMismatch`, raised on every process;
what is compared: pipeline.planning.settings), or
a failure (`RankFailure` naming the rank and what it was doing). Only store keys are used, no
collective: a collective with a dead peer is what ends gloo in an abort or a bare "Read error".

Keys of sync point n of this job's k-th Pipeline (both counted alike on every process, since
every process makes the same calls):

- ``hybridpipe/setup/<k>/<n>/arrive/<rank>``: the process's settings, or its error;
- ``hybridpipe/setup/<k>/<n>/verdict``: the answer. Rank 0 writes it, but so may a process
  that failed or gave up waiting; the first writer wins (compare_set), so there is one answer;
- ``hybridpipe/setup/<k>/phase/<rank>``: what the process is doing now, read to explain why
  it did not come.

A process that raises during a `phase` writes its error as its arrival and as the verdict of
the sync point it would reach next, so its peers stop at once. One that was killed or hangs is
named when the waits for it end, after ``timeout`` seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, cast

import torch.distributed as dist

from pipeline.execution.distributed import wire
from pipeline.execution.distributed.failure import RankFailure, raised_text, stopped_text
from pipeline.execution.timeouts import ENV_COMPILE_TIMEOUT, ENV_TIMEOUT
from pipeline.planning.settings import Settings, mismatch_message

_PREFIX = "hybridpipe/setup"
_NAMED = 8  # silent ranks named in one message


class SettingsMismatch(ValueError):
    """The processes built their Pipelines with different settings (raised on every process
    before any tensor moved)."""


def _blob(obj: object) -> str:
    """`obj` encoded for a store value (pipeline.execution.distributed.wire: data, never
    pickle; the store takes bytes, though typed as str)."""
    return cast(str, wire.dumps(obj))


def _read(blob: bytes) -> tuple[str, Any]:
    """A (kind, body) verdict or arrival read back; a `wire.WireError` for anything that this
    job did not write (a foreign client's value is refused, never run)."""
    value = wire.loads(blob)
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str)):
        raise wire.WireError(
            f"a value in this job's store is not a hybridpipe setup message: {value!r:.80}"
        )
    return value


class Agreement:
    """This process's side of the setup sync points of one Pipeline (see the module
    docstring). `describe` names a global rank in messages (set once the layout is known)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: float) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.setting = f"set Pipeline(timeout=...) or ${ENV_TIMEOUT}"  # what bounds waits
        # The k-th Pipeline on this process is the k-th on every process.
        self.pipeline = store.add(f"{_PREFIX}/count/{rank}", 1)
        self.seq = 0  # sync points passed
        self.failed: str | None = None
        self.describe: Callable[[int], str] = lambda r: f"rank {r}"

    def _key(self, *parts: object) -> str:
        return "/".join([_PREFIX, str(self.pipeline), *(str(p) for p in parts)])

    def note(self, what: str) -> None:
        """Record what this process is doing (read by peers to explain a silence)."""
        try:
            self.store.set(self._key("phase", self.rank), what)
        except RuntimeError:
            pass  # the store is gone: the next sync says so

    @contextmanager
    def phase(self, what: str) -> Iterator[None]:
        """A piece of setup: recorded as this process's phase; if it raises, every peer is
        told at its next sync point, and the error is re-raised here."""
        self.note(what)
        try:
            yield
        except (RankFailure, SettingsMismatch):
            raise  # every process reads these from the same verdict
        except BaseException as err:
            if self.failed is None:
                text = raised_text(self.describe(self.rank), err, what)
                self.fail(text)
                err.add_note(f"hybridpipe: {text}; the other ranks are told and stop")
            raise

    @contextmanager
    def allowing(self, seconds: float) -> Iterator[None]:
        """Bound the sync points inside by the compile allowance `seconds` instead of the
        timeout (never by less): setup with compile=, in which global rank 0 may profile
        compiled units while the others wait for its plan."""
        saved = self.timeout, self.setting
        if seconds > self.timeout:
            self.timeout = seconds
            self.setting = ("the compile allowance of setup with compile=; set "
                            f"Pipeline(compile_timeout=...) or ${ENV_COMPILE_TIMEOUT}")
        try:
            yield
        finally:
            self.timeout, self.setting = saved

    def fail(self, text: str) -> None:
        """Tell the peers this process failed: `text` becomes its arrival at the pending sync
        point and that point's verdict (unless it has one already)."""
        self.failed = text
        blob = _blob(("failed", text))
        try:
            self.store.set(self._key(self.seq, "arrive", self.rank), blob)
            self.store.compare_set(self._key(self.seq, "verdict"), "", blob)
        except RuntimeError:
            pass  # the store went down with its host: the peers' waits time out instead

    def sync(self, what: str, value: Any = None, settings: Settings | None = None) -> Any:
        """Meet every process at sync point `what`; return global rank 0's `value` (tensors
        arrive on CPU) once every process's `settings` match. Raises SettingsMismatch when
        they differ, RankFailure when a process failed or did not come within the timeout."""
        n = self.seq
        with self.phase(f"wait at {what}"):
            try:
                self.store.set(self._key(n, "arrive", self.rank),
                               _blob(("ok", dict(settings or {}))))
                kind, body = (self._judge(n, what, value) if self.rank == 0
                              else self._await_verdict(n, what))
            except RuntimeError as err:  # the store itself stopped answering (DistError)
                kind, body = "failed", (
                    f"the c10d store stopped answering ({str(err).splitlines()[0]}); its host "
                    "(torchrun's agent, or global rank 0's process) is gone")
        self.seq += 1
        if kind == "ok":
            return body
        if kind == "mismatch":
            raise SettingsMismatch(body)
        if kind == "silent":
            body, silent = body
            if self.rank in silent:  # this process came late: the others gave up on it
                raise RankFailure(f"{self.describe(self.rank)} reached {what} after the other "
                                  f"processes had stopped waiting for it: {body}")
        raise RankFailure(stopped_text(self.describe(self.rank), f"setup at {what}", body))

    def _judge(self, n: int, what: str, value: Any) -> tuple[str, Any]:
        keys = [self._key(n, "arrive", r) for r in range(self.world_size)]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout))
        except RuntimeError:  # DistStoreError on timeout
            return self._decide(n, ("silent", self._silence(n, what)))
        arrivals = [_read(v) for v in self.store.multi_get(keys)]
        failures = [body for kind, body in arrivals if kind == "failed"]
        if failures:
            return self._decide(n, ("failed", failures[0]))
        text = mismatch_message(what, [body for _, body in arrivals])
        return self._decide(n, ("ok", value) if text is None else ("mismatch", text))

    def _await_verdict(self, n: int, what: str) -> tuple[str, Any]:
        key = self._key(n, "verdict")
        try:
            self.store.wait([key], timedelta(seconds=self.timeout))
        except RuntimeError:  # rank 0 may still wait for a silent peer: name it ourselves
            return self._decide(n, ("silent", self._silence(n, what)))
        kind, body = _read(self.store.get(key))
        return kind, body

    def _decide(self, n: int, verdict: tuple[str, Any]) -> tuple[str, Any]:
        """Publish `verdict` unless there is one already; return the one every rank reads."""
        stored = self.store.compare_set(self._key(n, "verdict"), "", _blob(verdict))
        kind, body = _read(stored)
        return kind, body

    def _silence(self, n: int, what: str) -> tuple[str, list[int]]:
        """Name the processes that did not arrive at sync point n, with their last phase."""
        missing = [r for r in range(self.world_size)
                   if not self.store.check([self._key(n, "arrive", r)])]
        names = []
        for r in (missing or [0])[:_NAMED]:  # everyone came: rank 0 did not answer
            key = self._key("phase", r)
            last = (f"last reported: {self.store.get(key).decode()}"
                    if self.store.check([key]) else "it never started building this Pipeline")
            names.append(f"{self.describe(r)} ({last})")
        more = f" and {len(missing) - _NAMED} more" if len(missing) > _NAMED else ""
        verb = "did not answer at" if not missing else "did not reach"
        text = (f"{', '.join(names)}{more} {verb} {what} within {self.timeout:g} s "
                f"({self.setting}): it was killed, crashed, exited early or hangs")
        return text, missing or [0]

