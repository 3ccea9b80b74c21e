"""The compile pass (``Pipeline(compile=...)``): what runs a stage becomes its compiled form
(pipeline.execution.compiled: regions compiled forward and backward, equal blocks sharing one
artefact, B and W kept apart under a split backward)."""

from __future__ import annotations

from partitioner import StageModule
from pipeline.execution.compiled import compiled_stage
from pipeline.execution.passes.stage import PreparedStage, StageContext
from pipeline.planning.settings import PipelineSettings


def compile_stage(
    stage: PreparedStage, settings: PipelineSettings, context: StageContext
) -> PreparedStage:
    """The stage run by compiled regions under ``compile=`` (eager without it, and under
    shard="full", whose FSDP2 hooks on the stage module a compiled stage does not call)."""
    options = context.compile
    if options is None:
        return stage.then("compile: none (eager)")
    if settings.shard == "full":
        context.compile_stats.runs_eager(
            f"stage {stage.index}", "shard='full' gathers parameters in FSDP2 hooks on the "
            "stage module, which the compiled stage does not call; use shard='optimizer' "
            "or None to compile")
        return stage.then("compile: none (eager: shard='full')")
    module = stage.module
    if not isinstance(module, StageModule):
        raise TypeError(f"compile= compiles split stage modules, got {type(module).__name__}")
    runs = compiled_stage(module, options, context.compile_stats, splits=context.splits)
    backend = options.backend if isinstance(options.backend, str) else "a custom backend"
    apart = ", B and W apart" if context.splits else ""
    return stage.then(f"compile: compiled regions ({backend}{apart})", runs=runs)
