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
with `restoring()` around it (the runtime puts running statistics back, so a BatchNorm updates
them once per microbatch)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from typing import Any

from torch import nn
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


class Checkpointed:
    """`run` (one block) under ``torch.utils.checkpoint`` for `policy`; under "selective"
    its keep plan is made at its first call. The first `attrs` values it is called with are
    its parameters and buffers: read as they are, not kept as inputs (a buffer the block
    updates in place must not be a saved tensor)."""

    def __init__(self, run: Callable[..., Any], policy: Policy,
                 restoring: Callable[[], AbstractContextManager[Any]], attrs: int = 0) -> None:
        self.run = run
        self.policy = policy
        self.restoring = restoring
        self.attrs = attrs
        self.plan: KeepPlan | None = None

    def _contexts(self) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        if self.plan is None:
            return nullcontext(), self.restoring()
        keep, replay = self.plan.contexts()
        return keep, _both(replay, self.restoring())

    def __call__(self, *values: Any) -> Any:
        attrs, values = values[: self.attrs], values[self.attrs:]
        run = self.run if not attrs else partial(self.run, *attrs)
        policy = self.policy
        if isinstance(policy, Selective) and self.plan is None:
            with self.restoring():  # the probe leaves running statistics as they were
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
    restoring: Callable[[], AbstractContextManager[Any]],
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
