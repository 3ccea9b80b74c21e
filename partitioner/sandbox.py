"""A sandbox for running a model to measure it: afterwards its parameters and buffers hold
their old values, every module's .training flag is what it was, and torch's RNG state (CPU and
CUDA) is restored, so capturing or profiling a model never changes what training it does next.

It keeps no second copy of the model: buffers (small: running statistics, rotary tables) are
copied up front, parameters only when an op is about to write into one (copy on write, seen by
a dispatch mode from the op's schema). A forward that writes its own weights is rare, so
normally nothing of the parameters is copied. The watch can be paused around timed runs
(`Sandbox.paused`): a timed repeat of a node writes only what its watched first run wrote."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _CopyOnWrite(TorchDispatchMode):
    """Before an op writes into a watched tensor's storage (an argument its schema marks
    `(a!)`, out= included), keep a copy of that tensor, once."""

    def __init__(self, watched: dict[int, Tensor]) -> None:
        super().__init__()
        self.watched = watched  # storage data_ptr -> tensor
        self.saved: dict[int, tuple[Tensor, Tensor]] = {}  # id -> (tensor, copy)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                for t in tree_leaves(value):
                    if isinstance(t, Tensor) and not t.is_meta:
                        self._save(t)
        return func(*args, **kwargs)

    def _save(self, t: Tensor) -> None:
        owner = self.watched.get(t.untyped_storage().data_ptr())
        if owner is not None and id(owner) not in self.saved:
            self.saved[id(owner)] = (owner, owner.detach().clone())


class Sandbox:
    """What the `sandbox` context yields: `paused()` stops watching parameter writes for a
    block (for timing; see the module docstring)."""

    def __init__(self, mode: _CopyOnWrite) -> None:
        self.mode = mode

    @property
    def copied(self) -> int:
        """How many parameters were copied (written by the body) so far."""
        return len(self.mode.saved)

    @contextmanager
    def paused(self) -> Iterator[None]:
        self.mode.__exit__(None, None, None)
        try:
            yield
        finally:
            self.mode.__enter__()


@contextmanager
def sandbox(model: nn.Module) -> Iterator[Sandbox]:
    """Run the body, then put the model's state, training flags and the RNG back."""
    buffers = [b for b in model.buffers() if not b.is_meta]
    saved_buffers = [b.detach().clone() for b in buffers]
    params = [p for p in model.parameters() if not p.is_meta]
    versions = [p._version for p in params]
    mode = _CopyOnWrite({p.untyped_storage().data_ptr(): p for p in params})
    modes = [(m, m.training) for m in model.modules()]
    grads = {id(p): p.grad for p in model.parameters()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        with mode:
            yield Sandbox(mode)
    finally:
        with torch.no_grad():
            for b, value in zip(buffers, saved_buffers, strict=True):
                b.copy_(value)
            for p, copy in mode.saved.values():
                p.copy_(copy)
        for m, training in modes:
            m.training = training
        for p in model.parameters():
            p.grad = grads.get(id(p))
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        written = [p for p, v in zip(params, versions, strict=True)
                   if p._version != v and id(p) not in mode.saved]
    if written:  # only when the body succeeded: its own error says more
        names = {id(p): n for n, p in model.named_parameters()}
        raise RuntimeError(
            "measuring the model changed parameter(s) "
            f"{', '.join(names.get(id(p), '?') for p in written)} in place where the "
            "sandbox could not see it (a write outside torch's ops?); build the model so "
            "its forward does not write its own weights"
        )
