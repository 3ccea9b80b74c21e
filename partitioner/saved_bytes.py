"""Measuring what a stage keeps for its backward: `SavedBytes` counts the bytes of the
tensors autograd saves while its hooks are active (``torch.autograd.graph.saved_tensors_hooks``;
each storage once, however many views or ops hold it; parameters and their views not
counted), holds them until autograd lets them go, and records the peak. Under a recompute
policy it sees what the checkpoints keep (block inputs, and the ops' outputs "selective"
saves), not the tensors recomputed in the backward; under "offload" on CUDA it sees nothing,
as nothing stays on the device."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor


def storage_key(t: Tensor) -> tuple[Any, ...]:
    """Which storage `t` views, for counting it once: its device and storage object (not its
    data pointer, which a fake tensor does not have) and the storage's size."""
    storage = t.untyped_storage()
    return (t.device, storage._cdata, storage.nbytes())


class _Held:
    """A saved tensor, counted while autograd holds it."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: Tensor, key: tuple[Any, ...], meter: SavedBytes) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedBytes:
    """Bytes of saved tensors live now (`held`) and at most since the last `reset` (`peak`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: dict[tuple[Any, ...], tuple[int, int]] = {}  # storage -> (holders, bytes)
        self.held = 0
        self.peak = 0

    def ignore(self, tensors: Sequence[Tensor]) -> None:
        """Take the storages of `tensors` as counted elsewhere: saving them adds nothing."""
        with self._lock:
            for t in tensors:
                key = storage_key(t)
                holders, size = self._count.get(key, (0, key[2]))
                self._count[key] = (holders + 1, size)

    def reset(self) -> None:
        """Start a new peak from what is held now."""
        with self._lock:
            self.peak = self.held

    def _pack(self, tensor: Tensor) -> Any:
        base = tensor if tensor._base is None else tensor._base
        if base.is_leaf and base.requires_grad:  # a parameter or a view of one (a weight's .t())
            return tensor
        key = storage_key(tensor)
        with self._lock:
            holders, size = self._count.get(key, (0, key[2]))
            if holders == 0:
                self.held += size
                self.peak = max(self.peak, self.held)
            self._count[key] = (holders + 1, size)
        return _Held(tensor, key, self)

    def _release(self, key: tuple[Any, ...]) -> None:
        with self._lock:
            holders, size = self._count[key]
            if holders == 1:
                del self._count[key]
                self.held -= size
            else:
                self._count[key] = (holders - 1, size)

    @staticmethod
    def _unpack(packed: Any) -> Tensor:
        return packed.tensor if isinstance(packed, _Held) else packed

    @contextmanager
    def counting(self) -> Iterator[None]:
        """Count the tensors saved inside the block (this thread)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield
