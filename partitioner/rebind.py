"""Swap tensors by identity in module trees: the model, its stage modules and the captured
graph modules each hold its parameters and buffers in containers of their own, so replacing
one means putting the new tensor wherever the old one is held. (Swapping storage in place is
not possible: capture's fake-tensor memo keeps weak references to the tensors.)"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor, nn


def rebind(holders: Iterable[nn.Module], by_id: dict[int, Tensor]) -> list[Tensor]:
    """Put `by_id[id(old)]` wherever a module under `holders` holds `old` as a parameter or
    buffer; returns the new tensors in `by_id`'s order."""
    for holder in holders:
        for module in holder.modules():
            owned: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
            for slots in owned:
                for field, t in slots.items():
                    if t is not None and id(t) in by_id:
                        slots[field] = by_id[id(t)]
    return list(by_id.values())
