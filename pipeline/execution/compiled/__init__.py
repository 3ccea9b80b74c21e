"""Compiled stages (`Pipeline(compile=...)`): options, regions, the joint-graph cut into
forward, input-grad and weight-grad graphs, and the compiled stage module."""

from pipeline.execution.compiled.options import CompileOptions, compile_options
from pipeline.execution.compiled.runner import CompileStats, compiling
from pipeline.execution.compiled.stage import compiled_stage, compiled_unit

__all__ = ["CompileOptions", "CompileStats", "compile_options", "compiled_stage", "compiled_unit",
           "compiling"]
