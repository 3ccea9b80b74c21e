"""The local executor: one worker thread per pipeline rank in this process, each running its
rank's `RankRuntime` on its device, with tensors crossing ranks through in-memory mailboxes
(plus CUDA copy streams and events between devices). The first worker error is re-raised in the
caller with its original traceback; the other workers are cancelled (`CancelToken`: they stop
at their next action boundary and write no gradient after the caller returns) and joined
briefly. A worker stuck in compute cannot be interrupted: the caller raises without it, and
the next step runs on fresh worker state."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from partitioner import StageModule
from pipeline.execution import streams
from pipeline.execution.cancel import CancelToken, PipelineAborted
from pipeline.execution.compiled import compiling
from pipeline.execution.executor import Executor
from pipeline.execution.grads import running_statistics
from pipeline.execution.program import RankResult, StepResult
from pipeline.execution.runtime import RankRuntime
from pipeline.execution.timeouts import DEFAULT_COMPILE_TIMEOUT
from pipeline.planning.decision import Coordination, decide_alone
from pipeline.planning.settings import PipelineSettings
from scheduler import MessageKey, Recv, Send, Timeline, describe_message

_POLL = 0.02  # seconds between abort checks while a worker waits for a tensor
_GRACE = 0.4  # seconds a failed step waits for its cancelled workers to stop


@dataclass
class _Message:
    tensors: tuple[Tensor, ...]
    ready: torch.cuda.Event | None  # marks the stream work that produced `tensors`
    copy_stream: streams.AnyStream  # the stream `tensors` were written on


class _Mailbox:
    """Messages for one rank keyed by their message key; waits are timed."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.items: dict[MessageKey, _Message] = {}

    def put(self, key: MessageKey, message: _Message) -> None:
        with self.cond:
            if key in self.items:
                raise RuntimeError(f"duplicate message {key}: the schedule sends it twice")
            self.items[key] = message
            self.cond.notify_all()

    def take(
        self, recv: Recv, timeout: float, abort: CancelToken, rank: int, allowance: float
    ) -> _Message:
        """The message `recv` waits for, within `timeout`, or while a stage compiles within the
        compile `allowance`."""
        key = recv.key
        with self.cond:
            message = self.items.pop(key, None)
            if message is not None:
                return message
            start = time.monotonic()
            deadline = start + timeout
            while key not in self.items:
                if abort.is_set():
                    raise PipelineAborted(
                        f"pipeline rank {rank} cancelled while waiting for "
                        f"{describe_message(key)}: another rank failed"
                    )
                now = time.monotonic()
                left = deadline - now
                if left <= 0 and compiling():  # a peer compiling its stage is not stuck
                    left = min(timeout, start + allowance - now)
                    deadline = now + left
                if left <= 0:
                    raise TimeoutError(
                        f"pipeline rank {rank} waited {max(timeout, deadline - start):.1f} s for "
                        f"{describe_message(key)} from pipeline rank {recv.peer} and nothing "
                        "arrived; raise Pipeline(timeout=...) if a step legitimately takes "
                        "this long (or compile_timeout=..., if a stage compiled all along)"
                    )
                self.cond.wait(min(_POLL, left))
            return self.items.pop(key)


class LocalTransport:
    """Transport between threads of one process; one per rank, sharing the mailboxes.

    Same device: the tensors are handed over as they are; the receiver's compute stream waits
    on an event recorded on the sender's stream. Different devices: the copy is ordered after
    the sender's queued work and completes on the receiver's copy stream, and the receiver's
    compute stream waits for it; `record_stream` marks received tensors as used on the
    receiver's stream. No host synchronisation (all no-ops on CPU).
    """

    def __init__(
        self,
        rank: int,
        devices: Sequence[torch.device],
        mailboxes: Sequence[_Mailbox],
        copy_streams: Sequence[streams.AnyStream],
        abort: CancelToken,
        timeout: float,
        allowance: float = DEFAULT_COMPILE_TIMEOUT,
    ) -> None:
        self.rank = rank
        self.devices = devices
        self.mailboxes = mailboxes
        self.copy_streams = copy_streams
        self.abort = abort
        self.timeout = timeout
        self.allowance = allowance  # the compile allowance (Pipeline(compile_timeout=...))

    def send(self, send: Send, tensors: tuple[Tensor, ...]) -> None:
        dst = send.peer
        src_device, dst_device = self.devices[self.rank], self.devices[dst]
        producer = streams.current_stream(src_device)
        if src_device == dst_device:
            message = _Message(tensors, streams.record_event(producer), producer)
        else:
            copy_stream = self.copy_streams[dst]
            streams.wait_stream(copy_stream, producer)
            with streams.use_stream(copy_stream):
                # torch runs a device-to-device copy on the source device's current stream
                # (the producer, where `tensors` live) and makes the destination's current
                # stream (the copy stream) wait for it; `copied` is allocated on the copy stream.
                copied = tuple(t.to(dst_device, non_blocking=True) for t in tensors)
            message = _Message(copied, streams.record_event(copy_stream), copy_stream)
        self.mailboxes[dst].put(send.key, message)

    def recv(self, recv: Recv) -> tuple[Tensor, ...]:
        message = self.mailboxes[self.rank].take(
            recv, self.timeout, self.abort, self.rank, self.allowance
        )
        consumer = streams.current_stream(self.devices[self.rank])
        streams.wait_event(consumer, message.ready)
        if consumer is not message.copy_stream:
            for t in message.tensors:
                streams.record_stream(t, consumer)
        return message.tensors


def resolve_devices(devices: Sequence[str | torch.device] | None, ranks: int) -> list[torch.device]:
    """One device per pipeline rank: the given list (repeats allowed), else cuda:0..p-1 when
    there are at least `ranks` CUDA devices, else CPU for every rank."""
    if devices is None:
        if torch.cuda.is_available() and torch.cuda.device_count() >= ranks:
            return [torch.device("cuda", i) for i in range(ranks)]
        return [torch.device("cpu")] * ranks
    if isinstance(devices, (str, torch.device)):
        raise TypeError(f"devices must be a list of devices (one per stage), got {devices!r}")
    listed = list(devices)
    if len(listed) < ranks:
        raise ValueError(
            f"devices lists {len(listed)} device(s) {listed} for stages={ranks}; give one device "
            "per stage (repeating a device is allowed, e.g. ['cpu'] * stages)"
        )
    if len(listed) > ranks:
        raise ValueError(
            f"devices lists {len(listed)} devices {listed} but stages={ranks}; give exactly one "
            f"device per stage, or raise stages to {len(listed)}"
        )
    resolved = []
    for d in listed:
        try:
            device = torch.device(d)
        except (RuntimeError, TypeError) as err:
            raise ValueError(
                f"device {d!r} is not a device name ({err}); use e.g. 'cpu' or 'cuda:0'"
            ) from None
        if device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            index = torch.cuda.current_device() if device.index is None and count else device.index
            if index is None or index >= count:
                raise ValueError(
                    f"device {d!r} does not exist: this machine has {count} CUDA device(s); "
                    "name one of " + (", ".join(f"'cuda:{i}'" for i in range(count)) or "'cpu'")
                )
            device = torch.device("cuda", index)
        elif device.type != "cpu":
            raise ValueError(f"device {d!r} is not supported; use 'cpu' or 'cuda:<index>'")
        resolved.append(device)
    return resolved


class LocalExecutor(Executor):
    """Runs a Schedule with one thread per pipeline rank; stage s runs on
    `devices[schedule.placement[s]]`. The settings' `timeout` bounds every wait for a tensor
    and every single action (a step in which no rank starts an action for `timeout` s fails
    as stuck)."""

    def __init__(self, devices: Sequence[torch.device], settings: PipelineSettings) -> None:
        self.devices = list(devices)
        super().__init__(settings)
        self.timeout = settings.timeout
        self.coordination = Coordination(
            leads=True, agree=decide_alone, device=self.devices[0], keeps_whole_model=True
        )
        self.abort = CancelToken()
        self.mailboxes = [_Mailbox() for _ in self.devices]
        self.compute_streams = [streams.new_stream(d) for d in self.devices]
        self.copy_streams = [streams.new_stream(d) for d in self.devices]
        self.runtimes: list[RankRuntime] = []

    @property
    def threads_on_cpu(self) -> bool:
        return len(self.devices) > 1 and all(d.type == "cpu" for d in self.devices)

    def held(self) -> dict[int, StageModule]:
        return {} if self.planned is None else dict(enumerate(self.planned.modules))

    @property
    def holds_first_stage(self) -> bool:
        return True

    @property
    def holds_last_stage(self) -> bool:
        return True

    def describe(self) -> str:
        return "this process (it runs every stage)"

    def reload(self) -> None:
        planned = self.planned
        if planned is None:
            return
        schedule = planned.schedule
        if schedule.num_ranks != len(self.devices):
            raise ValueError(
                f"got {len(self.devices)} devices for {schedule.num_ranks} ranks; give one per "
                "rank"
            )
        self.weights_checked = False
        self._build_runtimes()

    def _runtimes(self) -> list[RankRuntime]:
        return list(self.runtimes)

    def _build_runtimes(self) -> None:
        """Runtimes, mailboxes and cancel token for the next step: after a cancelled step
        they are new, since its stuck workers may still hold the old ones."""
        planned = self.planned
        if planned is None:
            return
        schedule = planned.schedule
        if self.abort.is_set():
            self.abort = CancelToken()
            self.mailboxes = [_Mailbox() for _ in self.devices]
        statistics = running_statistics(planned.model)
        self.runtimes = [
            RankRuntime(
                rank,
                schedule,
                {s: self.prepare_stage(planned.modules[s]) for s in schedule.stages_of(rank)},
                LocalTransport(
                    rank, self.devices, self.mailboxes, self.copy_streams, self.abort,
                    self.timeout, self.compile_timeout,
                ),
                device=self.devices[rank],
                loss_fn=self.loss_fn,
                precision=self.precision,
                abort=self.abort,
                statistics=statistics,
                saved=self.saved_bytes.get(rank),
            )
            for rank in range(schedule.num_ranks)
        ]

    def _run_step(
        self,
        inputs: Sequence[tuple[Tensor, ...]] | None,
        targets: Sequence[Any] | None,
        loss_weights: Sequence[float],
    ) -> StepResult:
        results = self._run(lambda rt: rt.run_step(inputs, targets, loss_weights), train=True)
        events = sorted((e for r in results for e in r.events), key=lambda e: e.start)
        losses = [loss for r in results for loss in r.losses.values()]
        total = torch.stack(losses).sum() if losses else None
        schedule = self._schedule
        trace = Timeline(
            tuple(events), schedule.num_ranks, schedule.splits_backward, name=schedule.name
        )
        input_grads = {m: g for r in results for m, g in r.input_grads.items()}
        return StepResult(total, trace, input_grads)

    def _run_forward(self, inputs: Sequence[tuple[Tensor, ...]] | None) -> list[Any]:
        grad = torch.is_grad_enabled()
        count = len(inputs or ())
        results = self._run(lambda rt: rt.run_forward(inputs, count, grad=grad), train=False)
        outputs = {m: out for r in results for m, out in r.outputs.items()}
        return [outputs[m] for m in range(count)]

    def _run(self, job: Callable[[RankRuntime], RankResult], *, train: bool) -> list[RankResult]:
        """Run `job` on every rank's runtime in its own thread (fresh runtimes after a
        cancelled step; a training step inside every runtime's `step_leaves`, entered here in
        the caller's thread); return per-rank results or re-raise the first (earliest) worker
        error with its traceback."""
        if self.abort.is_set():
            self._build_runtimes()
        with ExitStack() as leaves:
            if train:
                for runtime in self.runtimes:
                    leaves.enter_context(runtime.step_leaves())
            return self._run_workers(job)

    def _run_workers(self, job: Callable[[RankRuntime], RankResult]) -> list[RankResult]:
        """Returns as soon as a worker fails, no worker started an action for `timeout` s, or
        the caller is interrupted: the workers are cancelled first."""
        cancel = self.abort
        for box in self.mailboxes:
            box.items.clear()
        # Worker streams start after what the caller queued (input copies, optimizer step).
        for rank, device in enumerate(self.devices):
            streams.wait_stream(self.compute_streams[rank], streams.current_stream(device))
        n = len(self.runtimes)
        results: list[RankResult | None] = [None] * n
        errors: list[tuple[float, int, BaseException]] = []
        lock = threading.Lock()
        left = [n]
        wake = threading.Event()
        # The caller's intra-op thread count, given to each worker: torch keeps it per thread
        # (OpenMP's and MKL's settings), and a new thread's first matrix product would start
        # an OpenMP team of every core, whose spinning workers compete with the other ranks.
        intra_op = torch.get_num_threads()

        def worker(rank: int) -> None:
            runtime = self.runtimes[rank]
            try:
                torch.set_num_threads(intra_op)
                with (
                    streams.use_device(runtime.device),
                    streams.use_stream(self.compute_streams[rank]),
                ):
                    results[rank] = job(runtime)
            except BaseException as err:  # noqa: B036 - every failure must reach the caller
                with lock:
                    errors.append((time.monotonic(), rank, err))
                wake.set()
            finally:
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        wake.set()

        threads = [
            threading.Thread(target=worker, args=(r,), name=f"hybridpipe-rank{r}", daemon=True)
            for r in range(n)
        ]
        cancel.beat = time.monotonic()
        for t in threads:
            t.start()
        try:
            self._watch(cancel, wake)
        except BaseException:  # e.g. KeyboardInterrupt in the caller: stop the workers too
            self._cancel(cancel, threads)
            raise
        if errors or left[0]:
            own = [e for e in errors if not isinstance(e[2], PipelineAborted)]
            stuck = self._cancel(cancel, threads)
            if own:
                _, rank, err = min(own, key=lambda e: e[0])
                err.add_note(f"raised by pipeline rank {rank} on {self.devices[rank]}")
            else:
                err = TimeoutError(
                    f"no pipeline rank started an action for timeout={self.timeout:g} s; "
                    "a stage may be stuck in compute (or compiling: compile_timeout="
                    f"{self.compile_timeout:g} s). Raise Pipeline(timeout=...) (or "
                    "compile_timeout=...) if a single action legitimately takes this long"
                )
            if stuck:
                err.add_note(
                    "still running when the step was cancelled (they stop at their next action "
                    "boundary and write no gradients): " + ", ".join(stuck)
                )
            raise err
        # The caller's stream sees everything the workers queued (grads, loss, outputs).
        for rank, device in enumerate(self.devices):
            streams.wait_stream(streams.current_stream(device), self.compute_streams[rank])
        return [r for r in results if r is not None]

    def _watch(self, cancel: CancelToken, wake: threading.Event) -> None:
        """Wait for `wake` (the workers ended or one failed), or until no stage started an
        action for `timeout` s. A waiting peer times out after `timeout`; this catches stages
        stuck with none waiting on them, a little later so that the peer's own error comes
        first. A stage compiling is busy, not stuck, for up to the compile allowance."""
        since: float | None = None  # when the compiling going on now began
        while not wake.wait(_POLL):
            now = time.monotonic()
            since = (since or now) if compiling() else None
            if since is not None and now - since <= self.compile_timeout:
                cancel.beat = now
            elif now - cancel.beat > self.timeout + _GRACE:
                return

    def _cancel(self, cancel: CancelToken, threads: Sequence[threading.Thread]) -> list[str]:
        """Cancel the step and give its workers `_GRACE` s to stop; those still running."""
        cancel.set()
        deadline = time.monotonic() + _GRACE
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return [
            f"pipeline rank {rank} in {runtime.running or 'its step'}"
            for rank, (t, runtime) in enumerate(zip(threads, self.runtimes, strict=True))
            if t.is_alive()
        ]
