"""A memoizing stand-in for `pipeline.planning.planner.capture`, for tests that build many
Pipelines on one model object: torch.export takes seconds a call (resnet18 ~2 s, GPT-2 more
under four processes), so the first call per (model object, input structure, options, leaf
shapes and dtypes, autocast dtype) captures for real and every later one gets that record
(frozen: profiling returns costs and makes a new record, so nothing leaks from one Pipeline
into the next). The capture reads the model's own parameters, which is why the key is the model
object, not its class."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_structure

import partitioner
from partitioner import Captured

Capture = Callable[..., Captured]


def memo_capture() -> Capture:
    captured: dict[tuple[Any, ...], Captured] = {}

    def capture(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                **options: Any) -> Captured:
        leaves = tree_leaves((args, kwargs))
        key = (id(model), str(tree_structure((args, kwargs))), repr(sorted(options.items())),
               tuple((t.shape, t.dtype) if isinstance(t, torch.Tensor) else t for t in leaves),
               torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"))
        if key not in captured:
            captured[key] = partitioner.capture(model, args, kwargs, **options)
        return captured[key]  # a frozen record: costing it makes another

    return capture
