"""pipeline: the `Pipeline` API and its executors (local threads + CUDA streams; the shared
action runtime used by the torch.distributed executor too), and `Checkpointer` (resume and
periodic checkpoints; pipeline.elastic)."""

from pipeline.api import Pipeline
from pipeline.elastic import Checkpointer
from pipeline.planning.activation_policies import Selective

__all__ = ["Checkpointer", "Pipeline", "Selective"]
