"""The "offload" policy: a stage's saved tensors kept in host memory between its forward and
its backward (``torch.autograd.graph.save_on_cpu``, into pinned memory, copied back without
blocking the host). On a CPU device the host is the device: there is nothing to move, and the
stage runs as under "none"."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def offloaded(run: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """`run` with every tensor its backward saves moved to host memory and back."""
    if device.type == "cpu":
        return run

    def forward(*args: Any) -> Any:
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return run(*args)

    return forward
