"""The per-step agreement of a pipeline's ranks on what runs (`StepAgreement`): the first
stage's rank sends the batch-shape key, the microbatch count, the call (step or forward) and its
batch size (four integers) to the other ranks of its pipeline, which check the call and their
targets' batch size against it before any activation moves; and, per call and microbatch count,
the messages each peer sends this rank (for the transport's shape metadata)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pipeline.execution.distributed.context import DistContext
from pipeline.execution.distributed.p2p import SIG_TAG, P2PTransport
from pipeline.planning.microbatch import batch_size
from scheduler import MessageKey, Schedule, forward_only, incoming, lower

_MODES = ("train", "forward")
_CALLS = {"train": "step(x, y)", "forward": "forward (pipe(x))"}


def _shape_key(mode: str, count: int, inputs: Sequence[tuple[Tensor, ...]]) -> int:
    desc = [mode, count] + [
        (tuple(t.shape), str(t.dtype)) for mb in inputs for t in mb if isinstance(t, Tensor)
    ]
    digest = hashlib.blake2b(repr(desc).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class StepAgreement:
    """This process's side of the per-step agreement of its pipeline (see the module)."""

    def __init__(self, context: DistContext, transport: P2PTransport) -> None:
        self.context = context
        self.layout = context.layout
        self.transport = transport
        self._incoming: dict[tuple[str, int], dict[int, list[MessageKey]]] = {}

    def messages(self, schedule: Schedule, mode: str, count: int) -> dict[int, list[MessageKey]]:
        """Per peer pipeline rank, the messages it sends this rank, in its send order."""
        if (mode, count) not in self._incoming:
            if mode != "train":
                schedule = forward_only(schedule, count)
            self._incoming[(mode, count)] = incoming(lower(schedule), self.layout.pp_rank)
        return self._incoming[(mode, count)]

    def forget_messages(self) -> None:
        """Drop the messages derived from the schedule (a new decision was adopted)."""
        self._incoming.clear()

    def agree_key(
        self, schedule: Schedule, mode: str, count: int,
        inputs: Sequence[tuple[Tensor, ...]] | None, targets: Sequence[Any] | None = None,
    ) -> tuple[int, int]:
        """The first stage's rank tells its pipeline the batch-shape key, the microbatch count,
        the call and the batch size; the others check the call and their targets' batch size
        against it (ValueError naming both values)."""
        first = self.layout.global_rank(schedule.placement[0])
        device = self.context.device
        if self.layout.rank == first:
            if inputs is None:
                raise ValueError(
                    f"{self.layout.describe()} runs stage 0 and needs the batch; pass this "
                    "replica's inputs to step()/forward on this process"
                )
            rows = sum(batch_size(mb, "inputs") for mb in inputs)
            sig = torch.tensor([_shape_key(mode, count, inputs), count, _MODES.index(mode), rows],
                               dtype=torch.int64, device=device)
            for p, r in enumerate(self.layout.pipeline_ranks()):
                if r != first:  # completion is awaited with the step's other sends
                    self.transport.track(
                        dist.isend(sig, dst=r, tag=SIG_TAG), p, sig, "the batch-shape key"
                    )
            return int(sig[0]), count
        sig = torch.empty(4, dtype=torch.int64, device=device)
        self.context.wait_work(
            dist.irecv(sig, src=first, tag=SIG_TAG), first, "the batch-shape key"
        )
        key, count, their_mode, rows = sig.tolist()
        here, there = self.layout.describe(), f"{self.layout.describe(first)} (stage 0)"
        if _MODES[their_mode] != mode:
            raise ValueError(
                f"the call differs within replica {self.layout.dp_rank}: {there} called "
                f"{_CALLS[_MODES[their_mode]]} but {here} called {_CALLS[mode]}; every process "
                "of a replica must make the same calls in the same order"
            )
        if targets is not None:
            own = sum(batch_size(t, "targets") for t in targets)
            if own != rows:
                raise ValueError(
                    f"the batch size differs within replica {self.layout.dp_rank}: {there} was "
                    f"given inputs of {rows} samples but {here} (the last stage) targets of "
                    f"{own}; give every process of a replica the same batch (targets row for "
                    "row with the inputs)"
                )
        return key, count
