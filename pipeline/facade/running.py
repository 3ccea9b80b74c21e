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
from pipeline.planning.microbatch import Microbatches

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


GRAD_ACCUMULATION = ("atomic", "in_place")


def check_grad_accumulation(value: object) -> str:
    if value not in GRAD_ACCUMULATION:
        raise ValueError(
            f"grad_accumulation={value!r}: use 'atomic' (a failed step leaves .grad as it was; "
            "accumulating across steps holds a second copy of the gradients during a step) or "
            "'in_place' (steps add into the existing .grad: no second copy)"
        )
    return str(value)


def run_step(
    executor: Executor, parameters: Iterable[nn.Parameter], inputs: Microbatches | None,
    targets: Any, in_place: bool = False,
) -> StepResult:
    """Run one step with the parameters' ``.grad`` cleared, then add the gradients it produced
    (unscaled first under fp16 loss scaling) to those from before; if the step fails, ``.grad``
    is put back as it was. With `in_place` (and no loss scaling, which must unscale the step's
    gradients alone), a parameter with a `.grad` that one stage of this process trains alone
    (`Executor.accumulates_in_place`) keeps it and the step adds into it in place (no second
    copy; see pipeline.execution.grads); if the step fails, the error says how many of those it
    had already added into."""
    params = [p for p in parameters if p.requires_grad]
    scaled = executor.precision.scaler is not None
    alone = executor.accumulates_in_place() if in_place and not scaled else set()
    kept = [p for p in params if p.grad is not None and id(p) in alone]
    versions = [p.grad._version for p in kept if p.grad is not None]
    cleared = [p for p in params if id(p) not in alone or p.grad is None]
    before = [p.grad for p in cleared]
    for p in cleared:
        p.grad = None
    try:
        result = executor.run_step(inputs, targets)
        executor.precision.unscale_([p.grad for p in cleared if p.grad is not None])
    except BaseException as err:
        for p, g in zip(cleared, before, strict=True):
            p.grad = g
        touched = [p for p, v in zip(kept, versions, strict=True)
                   if p.grad is not None and p.grad._version != v]
        if touched:
            err.add_note(
                f"hybridpipe: before failing, the step had added into the existing .grad of "
                f"{len(touched)} parameter(s) in place (grad_accumulation='in_place'); call "
                "zero_grad() and redo the accumulated steps"
            )
        raise
    for p, g in zip(cleared, before, strict=True):
        if g is not None:
            p.grad = g if p.grad is None else g.add_(p.grad)
    return result
