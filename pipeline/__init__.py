"""pipeline: the `Pipeline` API and its executors (local threads + CUDA streams; the shared
action runtime used by the torch.distributed executor too)."""

from pipeline.api import Pipeline

__all__ = ["Pipeline"]
