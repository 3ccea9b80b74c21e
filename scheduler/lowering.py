"""Lowering: derive each rank's communication from a Schedule's placement and data dependencies,
turning its compute order into an instruction list (Compute, Send, Recv). Generators never
write communication; this is the only place it comes from.

A transfer is named by what produced it: (op, stage, microbatch) of the producing action. F of
stage s produces activations for stage s+1; B of stage s produces the input gradient for stage
s-1. A Send and the Recv it pairs with carry the same (op, stage, microbatch), each naming the
other side as `peer`.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.ir import Action, Op, Schedule


@dataclass(frozen=True)
class Compute:
    """Roughly: ``outputs = stage[action.stage].run(action.op, action.microbatch, inputs)``."""

    action: Action

    def __str__(self) -> str:
        return str(self.action)


@dataclass(frozen=True)
class Send:
    """Roughly: ``isend(output of op(stage, microbatch), dst=peer)``; buffered, never blocks.
    Pairs with the Recv on rank `peer` that has the same (op, stage, microbatch)."""

    op: Op
    stage: int
    microbatch: int
    peer: int

    def __str__(self) -> str:
        return f"send {self.stage}{self.op.value}{self.microbatch}->{self.peer}"


@dataclass(frozen=True)
class Recv:
    """Roughly: ``wait(irecv(output of op(stage, microbatch), src=peer))``; blocks until it
    arrives. Pairs with the Send on rank `peer` that has the same (op, stage, microbatch)."""

    op: Op
    stage: int
    microbatch: int
    peer: int

    def __str__(self) -> str:
        return f"recv {self.stage}{self.op.value}{self.microbatch}<-{self.peer}"


Instruction = Compute | Send | Recv


def _consumer_stage(op: Op, stage: int, num_stages: int) -> int | None:
    """The stage that consumes op(stage)'s cross-stage output, or None when there is none."""
    if op is Op.F and stage < num_stages - 1:
        return stage + 1
    if op is Op.B and stage > 0:
        return stage - 1
    return None


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
            # Cross-stage inputs: F(s) reads F(s-1)'s activations, B(s) reads B(s+1)'s grads.
            if a.op is Op.F and a.stage > 0:
                src: int | None = a.stage - 1
            elif a.op is Op.B and a.stage < num_stages - 1:
                src = a.stage + 1
            else:
                src = None
            if src is not None and placement[src] != rank:
                out.append(Recv(a.op, src, a.microbatch, placement[src]))
            out.append(Compute(a))
            dst = _consumer_stage(a.op, a.stage, num_stages)
            if dst is not None and placement[dst] != rank:
                out.append(Send(a.op, a.stage, a.microbatch, placement[dst]))
        program.append(out)
    return program


def receive_order(schedule: Schedule) -> list[list[Recv]]:
    """Per rank, its receives in the order its computes will need them: the order in which an
    executor should post them early (irecv) and later wait on them."""
    return [[i for i in rank_program if isinstance(i, Recv)] for rank_program in lower(schedule)]


def to_text(program: list[list[Instruction]]) -> str:
    """One line per rank, instructions separated by ' | ' (for error messages and tests)."""
    return "\n".join(" | ".join(str(i) for i in rank_program) for rank_program in program)
