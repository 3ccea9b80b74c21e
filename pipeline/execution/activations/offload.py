"""The "offload" policy: a stage's saved tensors kept in host memory between its forward and
its backward, the copies on a side stream of their own so that they overlap the compute.

- Forward (`Offloader.hooks`' pack hook): each saved tensor on the stage's device is copied
  into pinned host memory on the side stream, after the compute stream's work so far (it made
  the tensor); ``record_stream`` keeps the caching allocator from reusing the tensor's device
  memory before the copy is done, so it frees as soon as the copy ends, without the compute
  stream ever waiting for it. Parameters (and views of them) stay where they are: moving them
  would free nothing.
- Backward (the unpack hook): the first tensor the backward asks for of one forward's
  brings all of that forward's back on the side stream (prefetch, in the order the backward
  needs them: the last saved first), each with an event; the compute stream waits only for the
  event of the tensor it needs. A tensor brought back stays on the device while autograd
  holds it (a split backward's W reads it again).

On a CPU device the host is the device: `offloaded` moves nothing and the stage runs as under
"none" (the hooks themselves work on CPU too, copying within host memory: the tests use that
to check their bookkeeping)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from pipeline.execution import streams


class _Saved:
    """One offloaded tensor: its host copy and, once brought back, its device copy and the
    event on the side stream it is ready at."""

    __slots__ = ("back", "host", "ready")

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self.back: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None


class _Group:
    """The tensors one forward call offloaded, in the order they were saved."""

    __slots__ = ("fetched", "saved")

    def __init__(self) -> None:
        self.saved: list[_Saved] = []
        self.fetched = False


class Offloader:
    """Saved-tensor hooks moving a stage's saved tensors on `device` to host memory and back on
    a side stream (see the module docstring); one per stage."""

    def __init__(self, device: torch.device) -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.stream = streams.new_stream(device)
        self.lock = threading.Lock()  # unpacks may come from autograd's device thread
        self.copied = 0  # tensors moved to the host so far

    def _pack(self, group: _Group, t: torch.Tensor) -> Any:
        base = t if t._base is None else t._base
        if (t.device != self.device or t.layout != torch.strided
                or (base.is_leaf and base.requires_grad)):
            return t
        host = torch.empty(t.size(), dtype=t.dtype, device="cpu",
                           pin_memory=self.device.type == "cuda")
        streams.wait_stream(self.stream, streams.current_stream(self.device))
        with streams.use_stream(self.stream):
            host.copy_(t, non_blocking=True)
        streams.record_stream(t, self.stream)  # not reused before the copy is done
        saved = _Saved(host)
        group.saved.append(saved)
        self.copied += 1
        return saved

    def _fetch(self, group: _Group) -> None:
        """Bring all of `group` back on the side stream, the last saved first."""
        with streams.use_stream(self.stream):
            for saved in reversed(group.saved):
                saved.back = saved.host.to(self.device, non_blocking=True)
                saved.ready = streams.record_event(self.stream)
        group.fetched = True

    def _unpack(self, group: _Group, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Saved):
            return packed
        with self.lock:
            if not group.fetched:
                self._fetch(group)
        back = packed.back
        assert back is not None
        compute = streams.current_stream(self.device)
        streams.wait_event(compute, packed.ready)
        streams.record_stream(back, compute)  # made on the side stream, used on this one
        return back

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks for one forward call (its saved tensors are prefetched together)."""
        group = _Group()
        return torch.autograd.graph.saved_tensors_hooks(
            lambda t: self._pack(group, t), lambda p: self._unpack(group, p))


def offloaded(run: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """`run` with every tensor its backward saves moved to host memory and back (nothing
    moves on a CPU device)."""
    if device.type == "cpu":
        return run
    offloader = Offloader(device)

    def forward(*args: Any) -> Any:
        with offloader.hooks():
            return run(*args)

    return forward
