"""A stage's training forward under a recompute policy ("full" or "selective"): its blocks
(partitioner.blocks) run one by one, each under non-reentrant
``torch.utils.checkpoint``, so the backward recomputes one block at a time. "selective" adds
torch's op-level selective checkpointing: the outputs of the `Selective.save` ops that
partitioner.selective_keep plans for the block (decided at the block's first forward, from a
probing forward under the same guards as a recomputation) are kept, and only the other ops
are recomputed.

Recomputation replays each block with the RNG state its forward started from (dropout draws
the same numbers; checkpoint's ``preserve_rng_state``), under the autocast the block's own
forward enters, with `restoring()` around it (the runtime puts running statistics back, so a
BatchNorm updates them once per microbatch)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from partitioner.blocks import BlockChain
from partitioner.selective_keep import KeepPlan, keep_plan
from pipeline.planning.activation_policies import Selective


@contextmanager
def _both(
    first: AbstractContextManager[Any], second: AbstractContextManager[Any]
) -> Iterator[None]:
    with first, second:
        yield


def recomputed(
    stage: nn.Module,
    policy: str | Selective,
    wrap: Callable[[nn.Module], Callable[..., Any]],
    restoring: Callable[[], AbstractContextManager[Any]],
) -> Callable[..., Any]:
    """`stage`'s forward recomputed per block under `policy` ("full" or a `Selective`);
    `wrap(block)` is how one block is called (e.g. under autocast)."""
    chain = BlockChain(stage)  # type: ignore[arg-type]  # a StageModule is an fx.GraphModule
    runs = {id(b.module): wrap(b.module) for b in chain.blocks}
    plans: dict[int, KeepPlan] = {}  # per block, once

    def contexts_of(plan: KeepPlan | None) -> Callable[[], Any]:
        def contexts() -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
            if plan is None:
                return nullcontext(), restoring()
            keep, replay = plan.contexts()
            return keep, _both(replay, restoring())
        return contexts

    def run_block(block: nn.Module, *values: Any) -> Any:
        run = runs[id(block)]
        plan = None
        if isinstance(policy, Selective):
            plan = plans.get(id(block))
            if plan is None:
                with restoring():  # the probe leaves running statistics as they were
                    plan = plans[id(block)] = keep_plan(run, values, policy.save,
                                                        policy.budget)
        return checkpoint(
            run, *values, use_reentrant=False, context_fn=contexts_of(plan),
            respect_saved_tensors_hooks=True,
        )

    def forward(*args: Any) -> Any:
        return chain(*args, run=run_block)

    return forward
