"""Parameters the Pipeline had to replace by new objects (a model built on meta whose
parameters torch would not swap in place: see partitioner.rebind.swap_in), and the check that
makes an optimizer step over one of them an error instead of a silent no-op: such an optimizer
was built before the replacement and would update the old (meta) tensors, never the weights
that train."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

_LOCK = threading.Lock()
_REPLACED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # old tensor -> True
_HOOK: list[Any] = []  # the global optimizer hook, once registered


def replaced(olds: Iterable[Tensor]) -> None:
    """Record `olds` as replaced; from now on an optimizer step over any of them raises."""
    olds = list(olds)
    if not olds:
        return
    with _LOCK:
        for t in olds:
            _REPLACED[t] = True
        if not _HOOK:
            _HOOK.append(register_optimizer_step_pre_hook(_check))


def _check(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    stale = sum(1 for group in optimizer.param_groups for p in group["params"]
                if p in _REPLACED)
    if stale:
        raise RuntimeError(
            f"{type(optimizer).__name__} holds {stale} parameter(s) the Pipeline replaced when "
            "it gave the model built on meta its weights (torch could not swap them in place: "
            "something holds a weak reference to them); it would never update the weights "
            "that train. Build the optimizer after the weights exist: after the first "
            "pipe.step(...), or pass example_input=... to Pipeline so they exist at "
            "construction, e.g. torch.optim.AdamW(pipe.parameters())"
        )
