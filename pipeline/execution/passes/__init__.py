"""The one ordered place where a stage is made ready to run, as torchtitan's ``parallelize``:
each pass is a function of the stage, the Pipeline's settings and where the stage runs (a
`StageContext`: its device, the process groups, the executor's precision and compile
options), lives in its own module, and knows nothing of the others. In this order:

1. split              the planned stage module, on its device (split.py)
2. tensor parallel    its width sharded over the "tp" mesh dim; nothing at tp=1
                      (tensor_parallel.py)
3. activation policy  what its training forward keeps for the backward (activation_policy.py)
4. compile            what runs it: compiled regions under compile= (compile.py)
5. precision          the autocast each block is entered under (precision.py)
6. data parallel      what its replicas average or shard (data_parallel.py)

A new way to shard or wrap a stage is one more pass in its own module, listed here in its
place. Each stage's applied passes are logged once at INFO and shown by ``pipe.describe()``."""

from __future__ import annotations

from partitioner import StageModule
from pipeline.execution.passes.activation_policy import activation_policy
from pipeline.execution.passes.compile import compile_stage
from pipeline.execution.passes.data_parallel import data_parallel
from pipeline.execution.passes.precision import precision
from pipeline.execution.passes.split import split
from pipeline.execution.passes.stage import PreparedStage, StageContext, StagePass
from pipeline.execution.passes.tensor_parallel import tensor_parallel
from pipeline.planning.settings import PipelineSettings

PASSES: tuple[StagePass, ...] = (
    split,
    tensor_parallel,
    activation_policy,
    compile_stage,
    precision,
    data_parallel,
)


def prepare(module: StageModule, settings: PipelineSettings, context: StageContext
            ) -> PreparedStage:
    """`module` made ready to run by every pass, in order."""
    stage = PreparedStage.of(module)
    for apply in PASSES:
        stage = apply(stage, settings, context)
    return stage


__all__ = ["PASSES", "PreparedStage", "StageContext", "StagePass", "prepare"]
