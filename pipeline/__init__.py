"""pipeline: the `Pipeline` API and its executors (local threads + CUDA streams; the shared
action runtime used by the torch.distributed executor too), and `Checkpointer` (resume and
periodic checkpoints; pipeline.elastic), and `meta_init` (build a model with parameters on meta
and buffers real)."""

from pipeline.api import Pipeline
from pipeline.elastic import Checkpointer
from pipeline.facade.meta_init import meta_init
from pipeline.planning.activation_policies import Selective

__all__ = ["Checkpointer", "Pipeline", "Selective", "meta_init"]
