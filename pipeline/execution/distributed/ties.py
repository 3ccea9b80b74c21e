"""Parameters tied across pipeline ranks (a GPT-2 embedding read again by the LM head): every
rank holding a copy keeps it equal to the others and, after each step's data-parallel gradient
average, sums its gradient over one process group per tie and replica (as Megatron-LM's
embedding group), so each copy gets the whole model's gradient and steps identically.

One process holds one copy (its stage modules share the Parameter object), so a tie between
stages of the same rank needs nothing here; the optimizer sees each parameter once. Under
``shard="full"`` each copy is a DTensor sharded alike over its replicas (same shape, same
dp size), so the copies' local shards are kept equal and summed shard by shard."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline.execution.distributed.context import DistContext
from pipeline.execution.distributed.dtensors import local


@dataclass(frozen=True)
class Tie:
    """A parameter (by the model's name) whose copies live on these pipeline ranks."""

    name: str
    pp_ranks: tuple[int, ...]


def find_ties(
    model: nn.Module, stage_modules: Sequence[nn.Module], placement: Sequence[int]
) -> list[Tie]:
    """The parameters that stages on more than one pipeline rank read (`placement[s]`: the
    rank of stage s), in the model's parameter order (the same on every process)."""
    ranks: dict[int, set[int]] = {}
    for stage, module in enumerate(stage_modules):
        for p in module.parameters():
            ranks.setdefault(id(p), set()).add(placement[stage])
    return [
        Tie(name, tuple(sorted(ranks[id(p)])))
        for name, p in model.named_parameters()
        if len(ranks.get(id(p), ())) > 1
    ]


class TieSync:
    """The process groups of `ties` (every process creates all of them, in the same order, as
    torch.distributed requires) and this process's share: `start` makes the copies equal
    (the lowest pipeline rank's value wins), `finish` sums the gradients of the copies."""

    def __init__(self, ctx: DistContext, model: nn.Module, ties: Sequence[Tie]) -> None:
        self.ctx = ctx
        params = dict(model.named_parameters())
        layout = ctx.layout
        self.mine: list[tuple[nn.Parameter, Any, int]] = []  # (parameter, group, source)
        self.names: list[str] = []
        for tie in ties:
            for replica in range(layout.data_parallel):
                for tp in range(layout.tensor_parallel):  # each tp rank's part on its own
                    members = [layout.cube[replica][pp][tp] for pp in tie.pp_ranks]
                    group = dist.new_group(members, timeout=ctx.wait)
                    if layout.rank in members:
                        self.mine.append((params[tie.name], group, members[0]))
                        self.names.append(tie.name)

    def rebind(self, model: nn.Module) -> None:
        """Take the model's current Parameter objects (a meta model's were replaced when its
        stages were loaded or initialised; shard="full" replaces them by sharded ones)."""
        params = dict(model.named_parameters())
        self.mine = [(params[name], group, src)
                     for name, (_, group, src) in zip(self.names, self.mine, strict=True)]

    def copies(self) -> set[int]:
        """ids of the tied parameters whose copy on this process is not the lowest pipeline
        rank's (counted once, there, in a norm over the model)."""
        return {id(p) for p, _, src in self.mine if src != self.ctx.layout.rank}

    def start(self) -> None:
        """Copy the tied parameters from the lowest pipeline rank holding them."""
        with self.ctx.guard("tied-parameter sync"), torch.no_grad():
            for p, group, src in self.mine:
                if p.is_meta:
                    continue
                work = dist.broadcast(local(p.data), src=src, group=group, async_op=True)
                self.ctx.wait_work(work, None, "a tied parameter's value")

    def finish(self) -> None:
        """Sum each tied parameter's gradient over its copies (after the replica average)."""
        if not self.mine:
            return
        with self.ctx.guard("tied-gradient sum"):
            pending = []
            for p, group, _ in self.mine:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                pending.append(dist.all_reduce(local(p.grad), group=group, async_op=True))
            for work in pending:
                self.ctx.wait_work(work, None, "a tied parameter's gradient")
