"""The end of a distributed step (`StepEnd`): the loss reaches every rank of the pipeline (an
all-reduce over replicas, or sends from the last stage's rank), and replica 0's ranks send
their measured events to global rank 0, which merges its pipeline's trace."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pipeline.execution.distributed.context import DistContext
from pipeline.execution.distributed.p2p import LOSS_TAG, TRACE_TAG
from scheduler import Event, Op, Schedule, Timeline


@dataclass
class _Pending:
    """A started end-of-step transfer: its Work, the peer (None for a collective), what it
    carries (for error messages) and the receive buffer, if any."""

    work: Any
    peer: int | None
    what: str
    buffer: Tensor | None = None

class StepEnd:
    """This process's part in the end of each step: `receives` and `sends` post the transfers,
    `finish` waits for them and returns the step's Timeline. `holds_last`: this rank holds the
    last stage; `gathers_trace`: replica 0 of a pipeline of several ranks gathers its trace."""

    def __init__(self, context: DistContext, *, gathers_trace: bool) -> None:
        self.context = context
        self.layout = context.layout
        self.gathers_trace = gathers_trace

    def receives(
        self, schedule: Schedule, total: Tensor, *, holds_last: bool
    ) -> list[_Pending]:
        """The step's last messages for this rank: with data parallelism every rank but the
        last stage's joins the loss all-reduce (adding 0); otherwise those ranks receive the
        loss from the last stage's rank. Global rank 0 receives its pipeline's traces (one
        row per action). With gloo (tags match messages) these are posted when the step
        starts, so they are complete when waited on; in-order backends post them at the end."""
        pending: list[_Pending] = []
        if not holds_last:
            if self.layout.data_parallel > 1:
                pending.append(_Pending(dist.all_reduce(total, async_op=True), None, "the loss"))
            else:
                last = self.layout.global_rank(schedule.placement[-1])
                work = dist.irecv(total, src=last, tag=LOSS_TAG)
                pending.append(_Pending(work, last, "the loss"))
        if self.gathers_trace and self.layout.rank == 0:
            for peer in range(1, self.layout.stages):
                n = len(schedule.actions[peer])
                buf = torch.empty(n * 5, dtype=torch.float64, device=self.context.device)
                src = self.layout.global_rank(peer)
                work = dist.irecv(buf, src=src, tag=TRACE_TAG)
                pending.append(_Pending(work, src, "the trace", buf))
        return pending

    def sends(
        self, total: Tensor, events: Sequence[Event], *, holds_last: bool
    ) -> list[_Pending]:
        """The last stage's rank shares the loss; replica 0's other ranks send their trace."""
        pending: list[_Pending] = []
        if holds_last:
            if self.layout.data_parallel > 1:
                pending.append(_Pending(dist.all_reduce(total, async_op=True), None, "the loss"))
            else:
                for r in self.layout.pipeline_ranks():
                    if r != self.layout.rank:
                        work = dist.isend(total, dst=r, tag=LOSS_TAG)
                        pending.append(_Pending(work, r, "the delivery of the loss"))
        if self.gathers_trace and self.layout.rank != 0:
            rows = [[e.stage, "FBW".index(e.op.value), e.microbatch, e.start, e.end]
                    for e in events]
            packed = torch.tensor(rows, dtype=torch.float64, device=self.context.device)
            work = dist.isend(packed.reshape(-1), dst=0, tag=TRACE_TAG)
            pending.append(_Pending(work, 0, "the delivery of the trace", packed))
        return pending

    def finish(
        self, schedule: Schedule, pending: Sequence[_Pending], events: Sequence[Event]
    ) -> Timeline:
        every = list(events)
        for item in pending:
            self.context.wait_work(item.work, item.peer, item.what)
            if item.what == "the trace" and item.buffer is not None and item.peer is not None:
                pp_rank = self.layout.coordinate(item.peer)[1]
                for stage, op, mb, start, end in item.buffer.reshape(-1, 5).tolist():
                    every.append(
                        Event(pp_rank, int(stage), Op("FBW"[int(op)]), int(mb), start, end)
                    )
        every.sort(key=lambda e: e.start)
        return Timeline(tuple(every), self.layout.stages, schedule.splits_backward,
                        name=schedule.name)
