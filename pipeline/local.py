"""The local executor: one worker thread per pipeline rank in this process, each running its
rank's `RankRuntime` on its device, with tensors crossing ranks through in-memory mailboxes
(plus CUDA copy streams and events between devices). The first worker error is re-raised in the
caller with its original traceback; the other workers are cancelled and joined."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pipeline import streams
from pipeline.runtime import (
    LossFn,
    PipelineAborted,
    RankResult,
    RankRuntime,
    StepResult,
)
from scheduler import Op, Schedule, Timeline

_POLL = 0.02  # seconds between abort checks while a worker waits for a tensor


@dataclass
class _Message:
    tensors: tuple[Tensor, ...]
    ready: torch.cuda.Event | None  # marks the stream work that produced `tensors`
    copy_stream: streams.AnyStream  # the stream `tensors` were written on


class _Mailbox:
    """Messages for one rank keyed by (op, receiving stage, microbatch); waits are timed."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.items: dict[tuple[Op, int, int], _Message] = {}

    def put(self, key: tuple[Op, int, int], message: _Message) -> None:
        with self.cond:
            if key in self.items:
                raise RuntimeError(f"duplicate message {key}: the schedule sends it twice")
            self.items[key] = message
            self.cond.notify_all()

    def take(
        self, key: tuple[Op, int, int], timeout: float, abort: threading.Event, rank: int
    ) -> _Message:
        deadline = time.monotonic() + timeout
        with self.cond:
            while key not in self.items:
                if abort.is_set():
                    raise PipelineAborted(
                        f"rank {rank} cancelled while waiting for {key[0].value} of stage "
                        f"{key[1]} microbatch {key[2]}: another rank failed"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"rank {rank} waited {timeout:.1f} s for op {key[0].value} of stage "
                        f"{key[1]} microbatch {key[2]} and nothing arrived; raise "
                        "Pipeline(timeout=...) if a step legitimately takes this long"
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
        schedule: Schedule,
        devices: Sequence[torch.device],
        mailboxes: Sequence[_Mailbox],
        copy_streams: Sequence[streams.AnyStream],
        abort: threading.Event,
        timeout: float,
    ) -> None:
        self.rank = rank
        self.schedule = schedule
        self.devices = devices
        self.mailboxes = mailboxes
        self.copy_streams = copy_streams
        self.abort = abort
        self.timeout = timeout

    def send(self, op: Op, stage: int, microbatch: int, tensors: tuple[Tensor, ...]) -> None:
        peer_stage = stage + 1 if op is Op.F else stage - 1
        dst = self.schedule.placement[peer_stage]
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
        self.mailboxes[dst].put((op, peer_stage, microbatch), message)

    def recv(self, op: Op, stage: int, microbatch: int) -> tuple[Tensor, ...]:
        message = self.mailboxes[self.rank].take(
            (op, stage, microbatch), self.timeout, self.abort, self.rank
        )
        consumer = streams.current_stream(self.devices[self.rank])
        streams.wait_event(consumer, message.ready)
        if consumer is not message.copy_stream:
            for t in message.tensors:
                streams.record_stream(t, consumer)
        return message.tensors


class LocalExecutor:
    """Runs a Schedule with one thread per rank. `stage_modules[s]` runs on
    `devices[schedule.placement[s]]` (the caller has moved it there). `timeout` bounds every
    wait for a tensor and the whole step's join."""

    def __init__(
        self,
        schedule: Schedule,
        stage_modules: Sequence[nn.Module],
        devices: Sequence[torch.device],
        *,
        loss_fn: LossFn | None = None,
        checkpoint_activations: bool = False,
        timeout: float = 120.0,
    ) -> None:
        if len(devices) != schedule.num_ranks:
            raise ValueError(
                f"got {len(devices)} devices for {schedule.num_ranks} ranks; give one per rank"
            )
        self.schedule = schedule
        self.devices = list(devices)
        self.timeout = timeout
        self.abort = threading.Event()
        self.mailboxes = [_Mailbox() for _ in devices]
        self.compute_streams = [streams.new_stream(d) for d in devices]
        copy_streams = [streams.new_stream(d) for d in devices]
        self.runtimes = []
        for rank in range(schedule.num_ranks):
            transport = LocalTransport(
                rank, schedule, self.devices, self.mailboxes, copy_streams, self.abort, timeout
            )
            self.runtimes.append(
                RankRuntime(
                    rank,
                    schedule,
                    {s: stage_modules[s] for s in schedule.stages_of(rank)},
                    transport,
                    device=self.devices[rank],
                    loss_fn=loss_fn,
                    checkpoint_activations=checkpoint_activations,
                    abort=self.abort,
                )
            )

    def run_step(
        self,
        inputs: Sequence[tuple[Tensor, ...]],
        targets: Sequence[Any],
        loss_weights: Sequence[float],
    ) -> StepResult:
        results = self._run(lambda rt: rt.run_step(inputs, targets, loss_weights))
        events = sorted((e for r in results for e in r.events), key=lambda e: e.start)
        losses = [loss for r in results for loss in r.losses.values()]
        total = torch.stack(losses).sum() if losses else None
        trace = Timeline(
            tuple(events),
            self.schedule.num_ranks,
            self.schedule.splits_backward,
            name=self.schedule.name,
        )
        return StepResult(total, trace)

    def forward(self, inputs: Sequence[tuple[Tensor, ...]]) -> list[Any]:
        grad = torch.is_grad_enabled()
        count = len(inputs)
        results = self._run(lambda rt: rt.run_forward(inputs, count, grad=grad))
        outputs = {m: out for r in results for m, out in r.outputs.items()}
        return [outputs[m] for m in range(count)]

    def close(self) -> None:
        """Nothing persistent to release: workers live for one call."""
        self.abort.set()

    def _run(self, job: Callable[[RankRuntime], RankResult]) -> list[RankResult]:
        """Run `job` on every rank's runtime in its own thread; return per-rank results or
        re-raise the first (earliest) worker error with its traceback."""
        self.abort.clear()
        for box in self.mailboxes:
            box.items.clear()
        # Worker streams start after what the caller queued (input copies, optimizer step).
        for rank, device in enumerate(self.devices):
            streams.wait_stream(self.compute_streams[rank], streams.current_stream(device))
        n = len(self.runtimes)
        results: list[RankResult | None] = [None] * n
        errors: list[tuple[float, int, BaseException]] = []
        lock = threading.Lock()

        def worker(rank: int) -> None:
            runtime = self.runtimes[rank]
            try:
                with (
                    streams.use_device(runtime.device),
                    streams.use_stream(self.compute_streams[rank]),
                ):
                    results[rank] = job(runtime)
            except BaseException as err:  # noqa: B036 - every failure must reach the caller
                with lock:
                    errors.append((time.monotonic(), rank, err))
                self.abort.set()

        threads = [
            threading.Thread(target=worker, args=(r,), name=f"hybridpipe-rank{r}", daemon=True)
            for r in range(n)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.timeout + 5.0
        try:
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
        except BaseException:  # e.g. KeyboardInterrupt in the caller: stop the workers too
            self.abort.set()
            for t in threads:
                t.join(5.0)
            raise
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            self.abort.set()
            for t in threads:
                t.join(5.0)
            raise TimeoutError(
                f"pipeline workers {stuck} did not finish within timeout={self.timeout} s; "
                "a stage may be stuck in compute. Raise Pipeline(timeout=...) if the step is "
                "legitimately this slow"
            )
        if errors:
            errors.sort(key=lambda e: (isinstance(e[2], PipelineAborted), e[0]))
            _, rank, err = errors[0]
            err.add_note(f"raised by pipeline rank {rank} on {self.devices[rank]}")
            raise err
        # The caller's stream sees everything the workers queued (grads, loss, outputs).
        for rank, device in enumerate(self.devices):
            streams.wait_stream(streams.current_stream(device), self.compute_streams[rank])
        return [r for r in results if r is not None]
