"""The activation policies a stage can run under (the activation policy pass,
pipeline.execution.passes.activation_policy, applies them), and the check of the user's
``checkpoint_activations=`` value: a policy name, a `Selective` with its own op list, True /
False, "auto" (the planner chooses per stage under ``memory_limit``,
pipeline.planning.activation_plan), or one policy per stage.

- "none": keep every tensor the backward needs (fastest, most memory).
- "full": keep each block's inputs only (and dropout's masks) and recompute the block in the
  backward, one block at a time (partitioner.blocks; at graph level,
  pipeline.execution.activations.graph, or torch.utils.checkpoint for a block that does not
  trace).
- "selective": keep each block's inputs and some outputs of the ops in `Selective.save`
  (matmuls, convolutions, attention): those with the most recompute FLOPs per byte, within
  `Selective.budget` (half the block's "none" bytes), among the ones its recomputation would
  run (partitioner.selective_keep); recompute the rest (op-level selective recompute, at
  graph level as "full"; ``create_selective_checkpoint_contexts`` where a block does not
  trace).
- "offload": keep every tensor, in pinned host memory (``torch.autograd.graph.save_on_cpu``;
  pipeline.execution.activations.offload); on a CPU device nothing moves ("none").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

NONE, FULL, SELECTIVE, OFFLOAD, AUTO = "none", "full", "selective", "offload", "auto"
POLICIES = (NONE, FULL, SELECTIVE, OFFLOAD)

_aten = torch.ops.aten
SELECTIVE_SAVE_OPS: tuple[torch._ops.OpOverload, ...] = (
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten.convolution.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._flash_attention_forward.default,
    _aten._efficient_attention_forward.default,
    _aten._scaled_mm.default,
)
"""The ops whose outputs "selective" may keep by default: the matmuls, convolutions and fused
attention kernels (the expensive ops); everything else (norms, activations, dropout, adds,
views, softmax of unfused attention) is recomputed."""

SELECTIVE_BUDGET = 0.5
"""What "selective" keeps of a block at most by default, as a fraction of the bytes the block
keeps under "none" (its inputs included)."""


@dataclass(frozen=True)
class Selective:
    """Op-level selective recompute keeping, per block, outputs of the `save` ops (ATen
    overloads such as ``torch.ops.aten.mm.default``): the ones with the most recompute FLOPs
    per byte that the block's recomputation would run, while the block keeps at most
    `budget` x its "none" bytes (its inputs included); ``budget=None`` keeps every such
    output (partitioner.selective_keep states the rule). E.g.
    ``Selective(save=(torch.ops.aten.mm.default,), budget=None)`` keeps every plain matmul
    output. ``checkpoint_activations="selective"`` is ``Selective()``."""

    save: tuple[torch._ops.OpOverload, ...] = SELECTIVE_SAVE_OPS
    budget: float | None = SELECTIVE_BUDGET

    def __post_init__(self) -> None:
        bad = [op for op in self.save if not isinstance(op, torch._ops.OpOverload)]
        if bad:
            raise TypeError(
                f"Selective(save=...) takes ATen op overloads such as "
                f"torch.ops.aten.mm.default; got {bad!r}"
            )
        budget = self.budget
        if budget is not None and (isinstance(budget, bool) or
                                   not isinstance(budget, (int, float)) or not 0 <= budget <= 1):
            raise ValueError(
                f"Selective(budget={budget!r}): give the fraction of a block's \"none\" bytes "
                "it may keep, from 0 to 1, or None to keep every saved op's output"
            )

    def __str__(self) -> str:
        return SELECTIVE


Policy = str | Selective
"""One stage's policy once checked: "none", "full", "offload" or a `Selective`."""

_ACCEPTED = (
    f"one of {[*POLICIES, AUTO]}, True (= 'full'), False (= 'none'), a "
    "pipeline.Selective, or a list with one of those per stage"
)


def _one(value: object) -> Policy:
    if isinstance(value, bool):
        return FULL if value else NONE
    if isinstance(value, Selective):
        return value
    if isinstance(value, str) and value in POLICIES:
        return Selective() if value == SELECTIVE else value
    raise ValueError(f"checkpoint_activations={value!r} is not a policy; give {_ACCEPTED}")


def check_policies(value: object, memory_limit: float | None) -> object:
    """`value` checked as ``checkpoint_activations=`` (stage count not known yet): a
    ValueError naming the accepted values otherwise, or for "auto" without a memory limit.
    Returns it unchanged."""
    if isinstance(value, str) and value == AUTO:
        if memory_limit is None:
            raise ValueError(
                'checkpoint_activations="auto" chooses per stage the cheapest policy that fits '
                "a memory limit: pass memory_limit= (bytes per device), or name a policy"
            )
        return value
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"checkpoint_activations=[] names no policy; give {_ACCEPTED}")
        for v in value:
            _one(v)
        return value
    _one(value)
    return value


def stage_policies(value: object, num_stages: int,
                   chosen: Sequence[str] | None = None) -> tuple[Policy, ...]:
    """One checked policy per stage from a ``checkpoint_activations=`` value; for "auto",
    the planner's choice `chosen` (pipe.plan.activations)."""
    if isinstance(value, str) and value == AUTO:
        if chosen is None:
            raise RuntimeError('checkpoint_activations="auto" but the plan chose no policies')
        value = list(chosen)
    if isinstance(value, (list, tuple)):
        if len(value) != num_stages:
            raise ValueError(
                f"checkpoint_activations has {len(value)} policies for {num_stages} stages; "
                f"give one per stage (stages x virtual_stages = {num_stages}) or one for all"
            )
        return tuple(_one(v) for v in value)
    return (_one(value),) * num_stages


def recomputes(policy: Policy) -> bool:
    """Whether the policy recomputes part of the forward in the backward."""
    return policy == FULL or isinstance(policy, Selective)


def name_of(policy: Policy) -> str:
    return str(policy)
