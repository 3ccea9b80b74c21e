"""Cancelling a pipeline step: `CancelToken`, which stops every worker of one step for good and
guards each gradient write, and `PipelineAborted`, what a cancelled worker raises."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class PipelineAborted(RuntimeError):
    """Raised inside a worker when another worker failed and the step is being cancelled."""


class CancelToken:
    """Cancels one executor's workers for good (the executor makes a new token, with new
    workers' state, for the next step). Workers check it at every action boundary and while
    waiting; every gradient write happens inside `writing()`, under the token's lock, so once
    `set()` has returned no worker touches `.grad` again, even one that was still computing.
    `beat` is the time any worker last started an action (for stuck-stage detection).
    Duck-compatible with `threading.Event` (`set`, `is_set`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self.beat = time.monotonic()

    def set(self) -> None:
        """Cancel; waits for a gradient write in progress to finish."""
        with self._lock:
            self._set = True

    def is_set(self) -> bool:
        return self._set

    @contextmanager
    def writing(self, where: str) -> Iterator[None]:
        """Hold the lock for one gradient write; PipelineAborted if cancelled."""
        with self._lock:
            if self._set:
                raise PipelineAborted(f"{where} skipped: the step was cancelled")
            yield
