"""One rank's per-step state in `RankRuntime` (the step's arguments, its result, stashed
activations, pending weight grads, undelivered messages), cleared after every step and checked
empty at the end of a successful one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from pipeline.execution.program import RankResult
from pipeline.execution.split_backward import WeightWork
from scheduler import MessageKey


@dataclass
class StepState:
    """`stash[(stage, mb)]`: a forward's (inputs, outputs) kept for its backward;
    `pending_w[(stage, mb)]`: what a split B left for its W; `mail`: messages by key."""

    inputs: Sequence[tuple[Tensor, ...]] = ()
    targets: Sequence[Any] = ()
    weights: Sequence[float] = ()
    result: RankResult = field(default_factory=RankResult)
    stash: dict[tuple[int, int], tuple[tuple[Tensor, ...], tuple[Tensor, ...]]] = field(
        default_factory=dict
    )
    pending_w: dict[tuple[int, int], WeightWork] = field(default_factory=dict)
    mail: dict[MessageKey, tuple[Tensor, ...]] = field(default_factory=dict)

    def begin(
        self,
        inputs: Sequence[tuple[Tensor, ...]],
        targets: Sequence[Any],
        weights: Sequence[float],
    ) -> None:
        self.inputs, self.targets, self.weights = inputs, targets, weights
        self.result = RankResult()

    def clear(self) -> None:
        """Drop everything a failed step may have left, so the next step starts clean."""
        self.stash.clear()
        self.pending_w.clear()
        self.mail.clear()
        self.inputs, self.targets, self.weights = (), (), ()

    def deliver_input_grads(
        self,
        writes: MessageKey | None,
        mb: int,
        floats: Sequence[Tensor],
        grads: Sequence[Tensor | None],
    ) -> None:
        """A B's grads of its stage's inputs `floats`: the message `writes` for the stage
        before (the inputs a gradient crosses; zeros for a missing grad), or on stage 0
        (`writes` None; every floating input) those of the caller's inputs that require grad,
        applied once the step succeeded."""
        if writes is None:
            if any(t.requires_grad for t in floats):
                self.result.input_grads[mb] = tuple(
                    g for t, g in zip(floats, grads, strict=True) if t.requires_grad
                )
            return
        self.mail[writes] = tuple(
            torch.zeros_like(t) if g is None else g for t, g in zip(floats, grads, strict=True)
        )

    def check_empty(self, rank: int, schedule: str) -> None:
        """Raise naming what a step left behind (the schedule misses its consumers)."""
        left = {
            "stashed activations": sorted(self.stash),
            "pending weight grads": sorted(self.pending_w),
            "undelivered messages": sorted(self.mail),
        }
        left = {k: v for k, v in left.items() if v}
        if left:
            raise RuntimeError(
                f"rank {rank} ended the step of schedule {schedule!r} with "
                f"leftovers {left}: the schedule is missing the actions that consume them"
            )
