"""The "offload" policy: a stage's saved tensors kept in host memory between its forward and
its backward (``torch.autograd.graph.save_on_cpu``; pinned memory on CUDA so the copies can
run asynchronously)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def offloaded(run: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """`run` with every tensor its backward saves moved to host memory and back."""
    pin = device.type == "cuda"

    def forward(*args: Any) -> Any:
        with torch.autograd.graph.save_on_cpu(pin_memory=pin):
            return run(*args)

    return forward
