"""What a rank runs and what it gives back: `compile_program` lowers a Schedule into one rank's
`Program` (instructions annotated with the message keys each Compute reads and writes, and where
each stage's gradient work is done); the `Transport` interface that moves messages between ranks;
the results of a rank (`RankResult`) and of an executor's step (`StepResult`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

from torch import Tensor

from scheduler import (
    Compute,
    Event,
    Instruction,
    MessageKey,
    Op,
    Recv,
    Schedule,
    Send,
    Timeline,
    consumer_stage,
    lower,
    producer,
)

LossFn: TypeAlias = Callable[[Any, Any], Tensor]


class Transport(Protocol):
    """Moves tensors between pipeline ranks. One instance per rank (it knows its own rank).

    send(send, tensors): deliver `tensors` (the message `send.key`) to pipeline rank
        `send.peer`. Must not block for long (queue it, or post an isend).
    recv(recv) -> tensors: the message `recv.key` from pipeline rank `recv.peer`. Blocks until
        it arrives (on this rank's device, ready for its compute stream) or a timeout passes;
        then raises an error naming rank, message and timeout.

    F messages hold a stage's outputs; B messages one tensor per input of the producing stage
    that a gradient crosses (floating-point and marked so by the plan: the stage module's
    `input_needs_grad`, which is the stage before's `output_needs_grad`), in positional order
    (zeros stand for a missing gradient). No gradient is computed or sent for the others (a
    rotary table made from buffers).
    """

    def send(self, send: Send, tensors: tuple[Tensor, ...]) -> None: ...

    def recv(self, recv: Recv) -> tuple[Tensor, ...]: ...


@dataclass
class RankResult:
    """What one rank's run produced.

    `losses[m]`: the weighted loss of microbatch m (detached; only on the last stage's rank).
    `outputs[m]`: the model output of microbatch m (only on the last stage's rank; only from
    `run_forward`). `events`: the executed actions with measured perf_counter times.
    `input_grads[m]`: the gradients of stage 0's inputs that require grad, in positional
    order (only on stage 0's rank, only when some input requires grad).
    """

    events: list[Event] = field(default_factory=list)
    losses: dict[int, Tensor] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    input_grads: dict[int, tuple[Tensor | None, ...]] = field(default_factory=dict)


@dataclass
class StepResult:
    """What an executor's training step returns: the whole-batch loss (sum of the weighted
    microbatch losses, detached, 0-dim; None on processes that do not hold the last stage)
    and the measured Timeline of the step. `input_grads`: stage 0's input grads (see
    `RankResult`), applied by `Executor.run_step` once the step succeeded."""

    loss: Tensor | None
    trace: Timeline
    input_grads: dict[int, tuple[Tensor | None, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Step:
    """One lowered instruction with what a Compute reads and writes (message keys)."""

    instruction: Instruction
    reads: MessageKey | None  # the message a Compute consumes (None: stage 0's F, last B)
    writes: MessageKey | None  # the message a Compute produces for another stage
    label: str  # profiler label


@dataclass(frozen=True)
class Program:
    """One rank's lowered instructions, and after which step each stage's last backward
    (B, or W when backward is split) and its Sends are done."""

    schedule: Schedule
    steps: tuple[Step, ...]
    stage_done: dict[int, int]  # step index -> stage


def compile_program(schedule: Schedule, rank: int) -> Program:
    """Lower `schedule` and annotate `rank`'s instructions for `RankRuntime`."""
    n = schedule.num_stages
    steps = []
    for ins in lower(schedule)[rank]:
        if isinstance(ins, Compute):
            a = ins.action
            src = producer(a, n)
            dst = consumer_stage(a.op, a.stage, n)
            steps.append(Step(
                ins, None if src is None else (src.op, src.stage, src.microbatch),
                None if dst is None else (a.op, a.stage, a.microbatch), f"hybridpipe {a}",
            ))
        else:
            steps.append(Step(ins, None, None, f"hybridpipe {ins}"))
    final = Op.W if schedule.splits_backward else Op.B
    last: dict[int, int] = {}
    for i, step in enumerate(steps):
        if isinstance(step.instruction, Compute) and step.instruction.action.op is final:
            last[step.instruction.action.stage] = i
    stage_done = {}
    for stage, i in last.items():
        while i + 1 < len(steps) and isinstance(steps[i + 1].instruction, Send):
            i += 1  # let the stage's last sends leave before its gradient work starts
        stage_done[i] = stage
    return Program(schedule, tuple(steps), stage_done)
