"""The activation policy pass: what a stage's training forward keeps for its backward
(pipeline.planning.activation_policies): everything ("none"), each block's inputs with the
block recomputed in the backward ("full", "selective": at graph level,
pipeline.execution.activations.graph; under ``torch.utils.checkpoint`` where what runs the
stage is compiled regions, which are autograd nodes of their own), or everything in host
memory ("offload")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import fx, nn

from pipeline.execution.activations.graph import graph_recomputed
from pipeline.execution.activations.offload import offloaded
from pipeline.execution.activations.recompute import recomputed
from pipeline.execution.compiled.runner import RegionRunner
from pipeline.execution.passes.stage import Enter, PreparedStage, Restoring, StageContext
from pipeline.planning.activation_policies import OFFLOAD, recomputes
from pipeline.planning.settings import PipelineSettings


def _traceable(runs: nn.Module) -> fx.GraphModule | None:
    """`runs` when it is a graph of the stage's own ops, None when it calls compiled regions
    (or is no graph at all)."""
    if not isinstance(runs, fx.GraphModule) or any(
            isinstance(n.target, RegionRunner) for n in runs.graph.nodes):
        return None
    return runs


def activation_policy(
    stage: PreparedStage, settings: PipelineSettings, context: StageContext
) -> PreparedStage:
    """The stage whose training forward keeps what `context.policy` says."""
    policy, device, splits = context.policy, context.device, context.splits
    where = f"stage {stage.index}"
    if recomputes(policy):
        def keeps(runs: nn.Module, enter: Enter, restoring: Restoring) -> Callable[..., Any]:
            graph = _traceable(runs)
            if graph is None:  # checkpointed block by block
                return recomputed(runs, policy, enter, restoring)
            return graph_recomputed(graph, policy, enter, restoring, splits, where)

        return stage.then(f"activation policy: {policy} (each block recomputed in the "
                          "backward from its inputs)", keeps=keeps)
    if policy == OFFLOAD:
        def offload(runs: nn.Module, enter: Enter, restoring: Restoring) -> Callable[..., Any]:
            return offloaded(enter(runs), device)

        where_kept = "host memory" if device.type != "cpu" else "host memory: the device's own"
        return stage.then(f"activation policy: offload (saved tensors in {where_kept})",
                          keeps=offload)
    return stage.then("activation policy: none (every tensor the backward needs kept)")
