"""Lowering: derive each rank's communication from a Schedule's placement and data dependencies,
turning its compute order into an instruction list (Compute, Send, Recv). Generators never
write communication; this is the only place it comes from.

A transfer is named by what produced it: its `MessageKey` is (op, stage, microbatch) of the
producing action. `consumer_stage` holds the one rule of who reads what (F of stage s produces
activations for stage s+1; B of stage s the input gradient for stage s-1); `producer` is its
inverse; the validator, both executors and the transports read these two functions and the
keys, never the rule itself. A Send and the Recv it pairs with carry the same key, each naming
the other side (a pipeline rank) as `peer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from scheduler.ir import Action, Op, Schedule

MessageKey: TypeAlias = tuple[Op, int, int]
"""(op, stage, microbatch) of the action that produced a cross-stage tensor message."""

# The direction each op's output travels along the stages; W's stays on its stage.
_DIRECTION = {Op.F: 1, Op.B: -1}


def consumer_stage(op: Op, stage: int, num_stages: int) -> int | None:
    """The stage that reads what op(stage) produces for another stage: F(s)'s activations go
    to s+1, B(s)'s input gradients to s-1; None for W, the last F and the first B."""
    step = _DIRECTION.get(op)
    if step is None or not 0 <= stage + step < num_stages:
        return None
    return stage + step


def describe_message(key: MessageKey) -> str:
    """E.g. 'activations of stage 0 microbatch 1 (0F1)', for error messages."""
    op, stage, mb = key
    what = "activations" if op is Op.F else "input gradients"
    return f"{what} of stage {stage} microbatch {mb} ({stage}{op.value}{mb})"


def producer(action: Action, num_stages: int) -> Action | None:
    """The action on another stage whose output `action` reads, the inverse of
    `consumer_stage` (the same direction table): F(s-1) for F(s), B(s+1) for B(s); None when
    there is none."""
    step = _DIRECTION.get(action.op)
    if step is None:
        return None
    source = action.stage - step
    if not 0 <= source < num_stages:
        return None
    return Action(source, action.op, action.microbatch)


@dataclass(frozen=True)
class Compute:
    """Roughly: ``outputs = stage[action.stage].run(action.op, action.microbatch, inputs)``."""

    action: Action

    def __str__(self) -> str:
        return str(self.action)


@dataclass(frozen=True)
class _Message:
    """One tensor between two ranks: the output of op(stage, microbatch), to or from `peer`."""

    op: Op
    stage: int
    microbatch: int
    peer: int

    @property
    def key(self) -> MessageKey:
        return (self.op, self.stage, self.microbatch)


@dataclass(frozen=True)
class Send(_Message):
    """Roughly: ``isend(output of op(stage, microbatch), dst=peer)``; buffered, never blocks.
    Pairs with the Recv on rank `peer` that has the same (op, stage, microbatch)."""

    def __str__(self) -> str:
        return f"send {self.stage}{self.op.value}{self.microbatch}->{self.peer}"


@dataclass(frozen=True)
class Recv(_Message):
    """Roughly: ``wait(irecv(output of op(stage, microbatch), src=peer))``; blocks until it
    arrives. Pairs with the Send on rank `peer` that has the same (op, stage, microbatch)."""

    def __str__(self) -> str:
        return f"recv {self.stage}{self.op.value}{self.microbatch}<-{self.peer}"


Instruction = Compute | Send | Recv


def lower(schedule: Schedule) -> list[list[Instruction]]:
    """Per rank, the ordered instructions: a Recv right before each compute for every input
    produced on another rank, the Compute, then a Send right after it for every output that
    another rank consumes. Same-rank handoffs (e.g. zbv's two chunks meeting on the last rank)
    need no instruction. Validate the schedule first; lowering does not check it."""
    placement, num_stages = schedule.placement, schedule.num_stages
    program: list[list[Instruction]] = []
    for rank, acts in enumerate(schedule.actions):
        out: list[Instruction] = []
        for a in acts:
            src = producer(a, num_stages)
            if src is not None and placement[src.stage] != rank:
                out.append(Recv(a.op, src.stage, a.microbatch, placement[src.stage]))
            out.append(Compute(a))
            dst = consumer_stage(a.op, a.stage, num_stages)
            if dst is not None and placement[dst] != rank:
                out.append(Send(a.op, a.stage, a.microbatch, placement[dst]))
        program.append(out)
    return program


def forward_only(schedule: Schedule, microbatches: int) -> Schedule:
    """The forward half of `schedule` for `microbatches` microbatches (inference): each rank
    runs its stages' F actions in (stage, microbatch) order, a projection of one global
    topological order, so it cannot deadlock."""
    actions = tuple(
        tuple(Action(s, Op.F, m) for s in schedule.stages_of(rank) for m in range(microbatches))
        for rank in range(schedule.num_ranks)
    )
    return Schedule(
        schedule.num_ranks, schedule.num_stages, microbatches, schedule.placement, actions,
        splits_backward=False, name=f"{schedule.name} (forward)",
    )


def receive_order(schedule: Schedule) -> list[list[Recv]]:
    """Per rank, its receives in the order its computes will need them: the order in which an
    executor should post them early (irecv) and later wait on them."""
    return [[i for i in rank_program if isinstance(i, Recv)] for rank_program in lower(schedule)]


def incoming(program: list[list[Instruction]], rank: int) -> dict[int, list[MessageKey]]:
    """For `rank`: per sending rank, the keys of the messages it sends to `rank`, in its send
    order (the order an in-order transport such as NCCL must post the matching receives)."""
    out: dict[int, list[MessageKey]] = {}
    for peer, rank_program in enumerate(program):
        for i in rank_program:
            if isinstance(i, Send) and i.peer == rank:
                out.setdefault(peer, []).append(i.key)
    return out


def to_text(program: list[list[Instruction]]) -> str:
    """One line per rank, instructions separated by ' | ' (for error messages and tests)."""
    return "\n".join(" | ".join(str(i) for i in rank_program) for rank_program in program)
