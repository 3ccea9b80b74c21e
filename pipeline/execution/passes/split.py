"""The first pass: the stage module the plan split from the captured model
(partitioner.split), placed on its device."""

from __future__ import annotations

import torch
from torch import nn

from pipeline.execution.passes.stage import PreparedStage, StageContext
from pipeline.planning.settings import PipelineSettings


def place(module: nn.Module, device: torch.device) -> None:
    """Move a stage module to its device; one still holding meta tensors (a model built on the
    meta device) stays until its weights are loaded or initialised."""
    if not any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        module.to(device)


def split(stage: PreparedStage, settings: PipelineSettings, context: StageContext) -> PreparedStage:
    """The split stage on `context.device` (on meta until its weights are given)."""
    place(stage.module, context.device)
    units = context.units
    span = f"{units[0]} .. {units[-1]}" if len(units) > 1 else "".join(units)
    count = sum(p.numel() for p in stage.module.parameters())
    return stage.then(f"split: {len(units)} units ({span}), {count:,} parameter values, "
                      f"on {context.device}")
