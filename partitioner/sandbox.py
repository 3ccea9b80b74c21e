"""A sandbox for running a model to measure it: afterwards its parameters and buffers hold
their old values, every module's .training flag is what it was, and torch's RNG state (CPU and
CUDA) is restored, so capturing or profiling a model never changes what training it does next."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def sandbox(model: nn.Module) -> Iterator[None]:
    """Run the body, then put the model's state, training flags and the RNG back."""
    saved = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    modes = [(m, m.training) for m in model.modules()]
    grads = {id(p): p.grad for p in model.parameters()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for key, value in model.state_dict(keep_vars=True).items():
                value.copy_(saved[key])
        for m, mode in modes:
            m.training = mode
        for p in model.parameters():
            p.grad = grads.get(id(p))
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
