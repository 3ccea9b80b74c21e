"""Running calls on a Pipeline: one step or forward at a time, and a step whose gradients
accumulate into ``.grad`` only when it succeeds."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from torch import nn

from pipeline.execution.executor import Executor
from pipeline.execution.program import StepResult

_F = TypeVar("_F", bound=Callable[..., Any])


class CallGuard:
    """Who is running a call on one Pipeline (see `one_at_a_time`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = ""


def one_at_a_time(method: _F) -> _F:
    """A Pipeline runs one step or forward at a time: a second call from another thread while
    one runs is a RuntimeError naming both (it would share the workers and the .grad). The
    decorated method's object keeps its `CallGuard` in ``_busy``."""

    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        me = f"Pipeline.{method.__name__} in thread {threading.current_thread().name!r}"
        busy: CallGuard = self._busy
        if not busy.lock.acquire(blocking=False):
            raise RuntimeError(
                f"{me} was called while {busy.running} is running; a Pipeline runs one "
                "call at a time: call it from one thread, or give each thread its own Pipeline"
            )
        busy.running = me
        try:
            return method(self, *args, **kwargs)
        finally:
            busy.lock.release()

    return guarded  # type: ignore[return-value]


def run_step(
    executor: Executor, parameters: Iterable[nn.Parameter], args: tuple[Any, ...] | None,
    targets: Any,
) -> StepResult:
    """Run one step with the parameters' ``.grad`` cleared, then add the gradients it produced
    (unscaled first under fp16 loss scaling) to those from before; if the step fails, ``.grad``
    is put back as it was."""
    params = [p for p in parameters if p.requires_grad]
    before = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        result = executor.run_step(args, targets)
        executor.precision.unscale_([p.grad for p in params if p.grad is not None])
    except BaseException:
        for p, g in zip(params, before, strict=True):
            p.grad = g
        raise
    for p, g in zip(params, before, strict=True):
        if g is not None:
            p.grad = g if p.grad is None else g.add_(p.grad)
    return result
