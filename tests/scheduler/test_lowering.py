"""Lowering: send/recv derived from placement and dependencies, on literal schedules."""

from __future__ import annotations

from collections import Counter

import pytest

from scheduler import (
    SCHEDULES,
    Action,
    Compute,
    Op,
    Recv,
    Schedule,
    Send,
    build_schedule,
    lower,
    receive_order,
)
from scheduler.lowering import to_text


def test_1f1b_two_ranks_literal() -> None:
    program = lower(build_schedule("1f1b", 2, 2))
    assert program[1][:4] == [
        Recv(Op.F, 0, 0, peer=0),
        Compute(Action(1, Op.F, 0)),
        Compute(Action(1, Op.B, 0)),
        Send(Op.B, 1, 0, peer=0),
    ]
    assert to_text(program) == (
        "0F0 | send 0F0->1 | 0F1 | send 0F1->1 | recv 1B0<-1 | 0B0 | recv 1B1<-1 | 0B1\n"
        "recv 0F0<-0 | 1F0 | 1B0 | send 1B0->0 | recv 0F1<-0 | 1F1 | 1B1 | send 1B1->0"
    )


def test_zbv_same_rank_handoffs_need_no_messages() -> None:
    # Rank 1 holds stages 1 and 2: 1F0 -> 2F0 and 2B0 -> 1B0 stay local; W never communicates.
    s = Schedule.from_text("0F0 3F0 3B0 3W0 0B0 0W0\n1F0 2F0 2B0 2W0 1B0 1W0")
    assert to_text(lower(s)) == (
        "0F0 | send 0F0->1 | recv 2F0<-1 | 3F0 | 3B0 | send 3B0->1 | 3W0 | recv 1B0<-1 | 0B0 | "
        "0W0\n"
        "recv 0F0<-0 | 1F0 | 2F0 | send 2F0->0 | recv 3B0<-0 | 2B0 | 2W0 | 1B0 | send 1B0->0 | 1W0"
    )


def test_receive_order_is_the_order_needed() -> None:
    s = build_schedule("interleaved-1f1b", 2, 2, 2)
    assert receive_order(s)[0] == [
        Recv(Op.F, 1, 0, 1),
        Recv(Op.F, 1, 1, 1),
        Recv(Op.B, 3, 0, 1),
        Recv(Op.B, 3, 1, 1),
        Recv(Op.B, 1, 0, 1),
        Recv(Op.B, 1, 1, 1),
    ]


def test_single_rank_has_no_messages() -> None:
    program = lower(build_schedule("zbv", 1, 2))
    assert all(isinstance(i, Compute) for i in program[0])


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_send_pairs_with_one_recv_placed_before_its_compute(name: str) -> None:
    v = 3 if name == "interleaved-1f1b" else 2 if name in ("zbv", "dualpipev") else 1
    s = build_schedule(name, 4, 8, v)
    program = lower(s)
    sends = Counter(
        (i.op, i.stage, i.microbatch, rank, i.peer)
        for rank, prog in enumerate(program)
        for i in prog
        if isinstance(i, Send)
    )
    recvs = Counter(
        (i.op, i.stage, i.microbatch, i.peer, rank)
        for rank, prog in enumerate(program)
        for i in prog
        if isinstance(i, Recv)
    )
    assert sends == recvs and all(c == 1 for c in sends.values())
    cross = sum(s.placement[a] != s.placement[a + 1] for a in range(s.num_stages - 1))
    assert len(sends) == 2 * cross * s.num_microbatches
    for rank, prog in enumerate(program):
        computes = [i.action for i in prog if isinstance(i, Compute)]
        for k, instr in enumerate(prog):
            if isinstance(instr, Recv):
                nxt = prog[k + 1]
                assert isinstance(nxt, Compute) and nxt.action.op == instr.op
            if isinstance(instr, Send):
                prev = prog[k - 1]
                assert isinstance(prev, Compute)
                assert (prev.action.op, prev.action.stage) == (instr.op, instr.stage)
        assert tuple(computes) == s.actions[rank]
