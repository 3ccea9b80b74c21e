"""Training that survives a changing world: resume and periodic (asynchronous) checkpoints
(`Checkpointer`), and ``Pipeline(stages="auto")`` re-planning (stages, data_parallel) for the
world size with a fixed global batch (`replica_share`; the choice itself is planning's:
pipeline.planning.layout)."""

from pipeline.elastic.checkpointer import Checkpointer, Resumed
from pipeline.planning.layout import replica_share

__all__ = ["Checkpointer", "Resumed", "replica_share"]
