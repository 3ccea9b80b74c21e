"""Replace tensors by identity in module trees. Where torch allows it (`swap_in`), the old
tensor object takes the new one's contents in place, so whatever holds it (the model, the
stage modules, the captured graph modules, an optimizer built from the parameters) sees them;
where it does not, the new tensor is put wherever a module holds the old one (`rebind`): the
model, its stage modules and the captured graph modules each hold its parameters and buffers
in containers of their own."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

# The removal callback of torch's weak-id dictionaries (the fake-tensor memos capture leaves
# behind: a real tensor -> its fake stand-in, a cache).
_MEMO_REMOVE = "WeakIdKeyDictionary.__init__.<locals>.remove"


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


def _forget(t: Tensor) -> None:
    """Drop `t` from torch's weak-id memos (as if it had died): swap_tensors refuses a
    tensor anything refers to weakly."""
    for ref in weakref.getweakrefs(t):
        callback = ref.__callback__
        if callback is not None and callback.__qualname__ == _MEMO_REMOVE:
            callback(ref)


def swap_in(old: Tensor, new: Tensor) -> bool:
    """Give the `old` object `new`'s contents (class, storage, attributes) in place, and
    `new` the old ones (``torch.utils.swap_tensors``); False, both left as they were, where
    torch refuses (something else refers to one of them weakly, or holds it in C++)."""
    if type(old) is not type(new):
        return False
    _forget(old)
    _forget(new)
    try:
        torch.utils.swap_tensors(old, new)
    except RuntimeError:
        return False
    return True
