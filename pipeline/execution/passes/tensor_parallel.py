"""The tensor-parallel pass (``Pipeline(tensor_parallel=..., tp_plan=...)``): a stage's width
sharded over the "tp" dim of the job's DeviceMesh. The executor derives the plan from the
captured graph and shards the held parameters into DTensors once per load
(pipeline.execution.tensor_parallel `parallelize`: tied weights stay one object across the
stages); this pass edits each stage's graph for them and runs it on the tp mesh
(`tensor_parallel`), once per graph. At ``tensor_parallel=1`` the stage is left as it is."""

from __future__ import annotations

from torch import fx
from torch.distributed.tensor import DTensor

from pipeline.execution.passes.stage import PreparedStage, StageContext
from pipeline.execution.tensor_parallel import TensorParallelStage, boundary
from pipeline.execution.tensor_parallel import tensor_parallel as run_on_mesh
from pipeline.planning.settings import PipelineSettings


def tensor_parallel(
    stage: PreparedStage, settings: PipelineSettings, context: StageContext
) -> PreparedStage:
    """The stage run on `context.dist`'s tp mesh with the parameters `context.tp_plan`
    sharded; whole at tensor_parallel=1."""
    plan, dist, module = context.tp_plan, context.dist, stage.module
    if plan is None or dist is None or settings.tensor_parallel == 1:
        return stage.then("tensor parallel: none (tensor_parallel=1)")
    if not isinstance(module, fx.GraphModule):
        raise TypeError(f"tensor_parallel= shards split stage graphs, got {type(module).__name__}")
    if module.__dict__.get("_tp_graph") is not module.graph:  # new code: edited once
        run_on_mesh(module, plan, dist.tp_mesh, settings.sequence_parallel)
        module.__dict__["_tp_graph"] = module.graph
    loss = plan.loss if context.last else None  # the last stage's logits may stay split
    if isinstance(module.forward, TensorParallelStage):
        module.forward.loss = loss
    params = list(module.parameters())
    sharded = sum(1 for p in params if isinstance(p, DTensor)
                  and not all(q.is_replicate() for q in p.placements))
    sequence = ", sequence parallel" if settings.sequence_parallel else ""
    return stage.then(f"tensor parallel: {sharded} of {len(params)} parameters sharded over "
                      f"{settings.tensor_parallel} ranks ({plan.source} plan{sequence})",
                      boundary=boundary(module, dist.tp_mesh, loss))
