"""The data-parallel pass: how a stage's replicas share its gradients and state
(``Pipeline(data_parallel=..., shard=...)``, pipeline.execution.distributed): its gradients
averaged over the replicas (`PreparedStage.averaged`, which the executor's GradSync
all-reduces, bucketed), the optimizer state sharded over them too (shard="optimizer",
ZeRO-1), or parameters, gradients and state sharded by FSDP2 (shard="full", applied with the
rank's other stages once the replicas hold the same weights: Sharding.attach)."""

from __future__ import annotations

from pipeline.execution.passes.stage import PreparedStage, StageContext
from pipeline.planning.settings import PipelineSettings


def data_parallel(
    stage: PreparedStage, settings: PipelineSettings, context: StageContext
) -> PreparedStage:
    """The stage with what its replicas average; nothing in one process."""
    dist = context.dist
    if dist is None:
        return stage.then("data parallel: none (one process)")
    count = dist.layout.data_parallel
    replicas = f"{count} replica{'s' if count != 1 else ''}"
    if settings.shard == "full":
        return stage.then(f"data parallel: FSDP2 over {replicas} (parameters, gradients and "
                          "optimizer state sharded)", averaged=())
    params = tuple(stage.module.parameters())
    what = ("gradients averaged, optimizer state sharded (ZeRO-1)"
            if settings.shard == "optimizer" else "gradients averaged")
    return stage.then(f"data parallel: {replicas}, {what}", averaged=params)
