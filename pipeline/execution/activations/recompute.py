"""A block run under ``torch.utils.checkpoint`` for a recompute policy ("full" or
"selective"), and a compiled stage's forward recomputed that way block by block.

Most stages recompute at graph level (pipeline.execution.activations.graph); this is the path
for what cannot: a block that does not trace (a BatchNorm's running statistics, data-dependent
control flow) and compiled stages (their regions are already autograd nodes of their own).
Each such block runs under non-reentrant ``torch.utils.checkpoint``, so the backward
recomputes one block at a time. "selective" adds torch's op-level selective checkpointing:
the outputs of the `Selective.save` ops that partitioner.selective_keep plans for the block
(decided at the block's first forward, from a probing forward under the same guards as a
recomputation) are kept, and only the other ops are recomputed.

Recomputation replays each block with the RNG state its forward started from (dropout draws
the same numbers; checkpoint's ``preserve_rng_state``), under the autocast its forward ran in,
and with the buffers the block updates in place (a BatchNorm's running statistics, a counter,
an average a module keeps) as its forward found them, put back after (`UpdatedBuffers`,
`Replayed`): the recomputation reads what the forward read, and each update counts once per
microbatch, as without activation checkpointing."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from partitioner.blocks import BlockChain
from partitioner.selective_keep import KeepPlan, keep_plan
from pipeline.planning.activation_policies import Policy, Selective


@contextmanager
def _both(
    first: AbstractContextManager[Any], second: AbstractContextManager[Any]
) -> Iterator[None]:
    with first, second:
        yield


class Replayed:
    """Made as one checkpointed forward starts: the values `buffers` had then. Around each
    recomputation of that forward (entered again: a split backward recomputes in B, then in
    W), those values are put in, so the recomputation reads and updates them as the forward
    did, and the values the buffers had on entry are put back after, so the update counts
    once. On its first exit it tells `owner` which buffers the replay changed."""

    def __init__(self, owner: UpdatedBuffers, buffers: dict[str, Tensor]) -> None:
        self.owner = owner
        self.buffers = buffers
        self.before = {n: b.detach().clone() for n, b in buffers.items()}
        self.current: dict[str, Tensor] = {}
        self.versions: dict[str, int] = {}

    def __enter__(self) -> None:
        with torch.no_grad():
            self.current = {n: b.detach().clone() for n, b in self.buffers.items()}
            for n, b in self.buffers.items():
                b.copy_(self.before[n])
        self.versions = {n: b._version for n, b in self.buffers.items()}

    def __exit__(self, *exc: object) -> None:
        if self.owner.updated is None and exc[0] is None:
            self.owner.updated = frozenset(
                n for n, b in self.buffers.items()
                if b._version != self.versions[n] or not torch.equal(b, self.before[n]))
        with torch.no_grad():
            for n, b in self.buffers.items():
                b.copy_(self.current[n])
        self.current = {}


class UpdatedBuffers:
    """The buffers of `module` (a stage) that one checkpointed block updates in place: the
    running statistics named in `statistics` (updated inside kernels, where version counters
    do not see it), and those its first replay changed. Until that replay every buffer of the
    stage is kept for it, after it only those. `replay()`: one forward's `Replayed`."""

    def __init__(self, module: nn.Module | None, statistics: Collection[str] = ()) -> None:
        self.module = module
        self.statistics = frozenset(statistics)
        self.updated: frozenset[str] | None = None

    def replay(self) -> Replayed:
        buffers = {} if self.module is None else dict(self.module.named_buffers())
        if self.updated is not None:
            buffers = {n: b for n, b in buffers.items()
                       if n in self.statistics or n in self.updated}
        return Replayed(self, buffers)


Restoring = Callable[[], UpdatedBuffers]  # one block's UpdatedBuffers (a fresh one per call)


class Checkpointed:
    """`run` (one block) under ``torch.utils.checkpoint`` for `policy`; under "selective"
    its keep plan is made at its first call. The first `attrs` values it is called with are
    its parameters and buffers: read as they are, not kept as inputs (a buffer the block
    updates in place must not be a saved tensor). `restoring()`: the buffers it updates."""

    def __init__(self, run: Callable[..., Any], policy: Policy, restoring: Restoring,
                 attrs: int = 0) -> None:
        self.run = run
        self.policy = policy
        self.buffers = restoring()
        self.attrs = attrs
        self.plan: KeepPlan | None = None

    def _contexts(self) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        if self.plan is None:
            return nullcontext(), self.buffers.replay()
        keep, replay = self.plan.contexts()
        # The buffers are put in and back outside the selective replay: those copies are ops
        # the forward's caching mode never saw.
        return keep, _both(self.buffers.replay(), replay)

    def __call__(self, *values: Any) -> Any:
        attrs, values = values[: self.attrs], values[self.attrs:]
        run = self.run if not attrs else partial(self.run, *attrs)
        policy = self.policy
        if isinstance(policy, Selective) and self.plan is None:
            with self.buffers.replay():  # the probe leaves the buffers as they were
                self.plan = keep_plan(run, values, policy.save, policy.budget)
        return checkpoint(run, *values, use_reentrant=False, context_fn=self._contexts,
                          respect_saved_tensors_hooks=True)


class Recomputed:
    """A stage's training forward under a recompute policy. `checkpoints`: whether some block
    of it runs under ``torch.utils.checkpoint``, whose recomputation runs again for each
    backward call (a split-backward schedule then takes the stage's weight grads in B)."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward

    def __call__(self, *args: Any) -> Any:
        return self.forward(*args)

    @property
    def checkpoints(self) -> bool:
        return True


def recomputed(
    stage: nn.Module,
    policy: Policy,
    wrap: Callable[[nn.Module], Callable[..., Any]],
    restoring: Restoring,
) -> Recomputed:
    """`stage`'s forward with every block (partitioner.blocks) under
    ``torch.utils.checkpoint`` for `policy` ("full" or a `Selective`); `wrap(block)` is how
    one block is called (e.g. under autocast)."""
    chain = BlockChain(stage)  # type: ignore[arg-type]  # a StageModule is an fx.GraphModule
    runs = {id(b.module): Checkpointed(wrap(b.module), policy, restoring)
            for b in chain.blocks}

    def forward(*args: Any) -> Any:
        return chain(*args, run=lambda block, *values: runs[id(block)](*values))

    return Recomputed(forward)
