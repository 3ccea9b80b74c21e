"""pipeline: the `Pipeline` API and its executors (local threads + CUDA streams; the shared
action runtime used by the torch.distributed executor too), and `Checkpointer` (resume and
periodic checkpoints; pipeline.elastic), and `meta_init` (build a model with parameters on meta
and buffers real).

The names are imported on first use (PEP 562), so that the `hybridpipe` command, which lives
under this package, answers ``--help`` without importing torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.api import Pipeline
    from pipeline.elastic import Checkpointer
    from pipeline.facade.meta_init import meta_init
    from pipeline.planning.activation_policies import Selective

_WHERE = {
    "Pipeline": "pipeline.api",
    "Checkpointer": "pipeline.elastic",
    "meta_init": "pipeline.facade.meta_init",
    "Selective": "pipeline.planning.activation_policies",
}

__all__ = ["Checkpointer", "Pipeline", "Selective", "meta_init"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
