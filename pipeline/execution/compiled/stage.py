"""`compiled_stage`: a stage module whose forward and backward run compiled. The stage graph is
cut into regions (pipeline.execution.compiled.regions), each run by a `RegionRunner`
(pipeline.execution.compiled.runner) from a driver graph that holds the stage's own modules,
parameters and buffers, so everything that reads or swaps the stage's parameters (the step's
private leaves, state dicts, optimizers) sees the same tensors."""

from __future__ import annotations

from torch import fx

from partitioner import StageModule
from pipeline.execution.compiled.options import CompileOptions
from pipeline.execution.compiled.regions import outline, regions_of
from pipeline.execution.compiled.runner import CompileStats, RegionRunner


def compiled_stage(
    stage: StageModule, options: CompileOptions, stats: CompileStats, *, splits: bool = False
) -> fx.GraphModule:
    """A module that runs `stage` (same inputs, outputs, parameters and their names) through
    compiled regions. `splits`: the schedule splits the backward into B (input grads) and W
    (weight grads), so each region's backward asks which of them a call wants."""
    regions = regions_of(stage)
    where = f"stage {stage.index}"
    runners = [RegionRunner(region, stage, options, stats, where, splits) for region in regions]
    driver = outline(stage, regions, runners)
    driver.input_names = list(stage.input_names)  # type: ignore[assignment]
    driver.output_names = list(stage.output_names)  # type: ignore[assignment]
    driver.index = stage.index  # type: ignore[assignment]
    driver.input_needs_grad = stage.input_needs_grad  # type: ignore[assignment]
    driver.output_needs_grad = stage.output_needs_grad  # type: ignore[assignment]
    return driver


def compiled_unit(
    unit: fx.GraphModule, options: CompileOptions, stats: CompileStats, *, splits: bool = True
) -> fx.GraphModule:
    """A captured unit (a graph over its own parameters) run through compiled regions, as the
    profiler times it; its regions' artefacts are those the stages later reuse (same code,
    same shapes). `splits`: the backward is split-ready, so B and W are timed apart (else a
    backward call always runs the whole backward graph: no input-grad graph is compiled). A
    region that cannot be traced here (e.g. a Python number crossing between torch.fx units)
    is timed eager with a log line: the stages are cut otherwise and warn for themselves."""
    regions = regions_of(unit)
    runners = [RegionRunner(region, unit, options, stats, "profiled unit", splits, quiet=True)
               for region in regions]
    return outline(unit, regions, runners)
