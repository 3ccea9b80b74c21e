"""The precision pass (``Pipeline(mixed_precision=...)``): each block of a stage, and so its
recomputation, entered under the executor's autocast (pipeline.execution.precision);
parameters and their gradients keep their own dtype."""

from __future__ import annotations

import functools

from pipeline.execution.passes.stage import PreparedStage, StageContext
from pipeline.planning.settings import PipelineSettings


def precision(
    stage: PreparedStage, settings: PipelineSettings, context: StageContext
) -> PreparedStage:
    """The stage whose blocks are entered under `context.precision`'s autocast."""
    policy = context.precision
    enter = functools.partial(policy.stage, device=context.device)
    if not policy.enabled:
        return stage.then("precision: the parameters' own dtype (no autocast)", enter=enter)
    return stage.then(f"precision: autocast to {policy.dtype} on {context.device.type}, "
                      "parameters and gradients in their own dtype", enter=enter)
