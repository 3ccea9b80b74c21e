"""The one ordered place where a stage is made ready for a training forward: each feature
that wraps a stage is one call into its own module, applied in this order:

1. precision: the forward under the Pipeline's autocast (pipeline.execution.precision), per
   block when the stage runs as blocks, so a recomputation enters it too;
2. activation policy (pipeline.execution.activations): "none" calls it as is, "full" and
   "selective" recompute it block by block (at graph level; a compiled stage's blocks under
   ``torch.utils.checkpoint``), "offload" keeps its saved tensors in host memory.

None of the steps knows about the others."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from pipeline.execution.activations.graph import graph_recomputed
from pipeline.execution.activations.offload import offloaded
from pipeline.execution.activations.recompute import Restoring, recomputed
from pipeline.execution.compiled.runner import RegionRunner
from pipeline.execution.precision import Precision
from pipeline.planning.activation_policies import OFFLOAD, Policy, recomputes


def stage_run(
    module: nn.Module,
    *,
    device: torch.device,
    precision: Precision,
    policy: Policy,
    restoring: Restoring,
    splits: bool = False,
) -> Callable[..., Any]:
    """How the runtime calls `module` in a training forward. `restoring()`: one checkpointed
    block's `UpdatedBuffers` (the buffers its recomputation must see as its forward did).
    `splits`: the schedule splits the backward into B and W."""

    def with_precision(m: nn.Module) -> Callable[..., Any]:
        return precision.stage(m, device)

    if recomputes(policy):
        if not isinstance(module, fx.GraphModule) or any(
                isinstance(n.target, RegionRunner) for n in module.graph.nodes):
            # A compiled stage: its regions are autograd nodes already; checkpointed per block.
            return recomputed(module, policy, with_precision, restoring)
        return graph_recomputed(module, policy, with_precision, restoring, splits,
                                f"stage {getattr(module, 'index', '?')}")
    run = with_precision(module)
    if policy == OFFLOAD:
        return offloaded(run, device)
    return run
