"""Which input dims a capture makes dynamic, and capturing again when a batch changes one that
was captured static. torch.export capture marks only the batch dim (and the dims the user
names in ``dynamic_dims``) dynamic: marking every dim costs minutes on models that reshape by
their sizes (window partitioning in Swin and MaxViT). A later batch whose size differs in a
static dim (another sequence length) is captured again with that dim dynamic too; the units
are the same, so the plan and the profiled costs carry over."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any

import torch

from partitioner import Captured

Pairs = set[tuple[int, int]]  # (flat input index, dim)

def check_dims(dims: object) -> tuple[int, ...]:
    """`dynamic_dims` as given to Pipeline: a sequence of dims >= 1 (dim 0, the batch, is
    always dynamic) made dynamic in every input that has them."""
    if isinstance(dims, int) or not isinstance(dims, Sequence) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims
    ):
        raise ValueError(
            f"dynamic_dims must be a tuple of dims >= 1 (e.g. (1,) for the sequence length of "
            f"(batch, sequence) inputs; dim 0, the batch, is always dynamic), got {dims!r}"
        )
    return tuple(dims)


def pairs_for(leaves: Sequence[Any], dims: Collection[int]) -> Pairs:
    """(flat input index, dim) for every dim in `dims` that an input tensor has."""
    return {
        (i, d)
        for i, leaf in enumerate(leaves)
        if isinstance(leaf, torch.Tensor)
        for d in dims
        if d < leaf.dim()
    }


def changed_static_dims(captured: Captured, microbatches: Sequence[Sequence[Any]]) -> Pairs:
    """(flat input index, dim) of every dim the capture made static in which a microbatch
    differs (inputs of another rank or count are left to `check_inputs` to report)."""
    if captured.method != "export":
        return set()
    want = captured.input_dims
    changed: Pairs = set()
    for leaves in microbatches:
        if len(leaves) != len(want):
            return set()
        for i, (dims, t) in enumerate(zip(want, leaves, strict=True)):
            if dims is None or not isinstance(t, torch.Tensor) or t.dim() != len(dims):
                continue
            changed |= {
                (i, d) for d, (w, got) in enumerate(zip(dims, t.shape, strict=True))
                if isinstance(w, int) and w != got
            }
    return changed


def still_static(captured: Captured, pairs: Pairs) -> Pairs:
    """The pairs a capture kept static although asked to make them dynamic (the model's code
    fixes those sizes)."""
    return {(i, d) for i, d in pairs if _static(captured.input_dims[i], d)}


def _static(dims: tuple[Any, ...] | None, d: int) -> bool:
    return dims is not None and isinstance(dims[d], int)


def carry_over(old: Captured, new: Captured) -> Captured | None:
    """`new` with `old`'s unit costs when both have the same units in the same order (a
    re-capture with more dims dynamic; `new` as it is when `old` has none); None when they
    differ."""
    if old.order != new.order:
        return None
    return new.with_costs(old.costs) if old.costs else new


def with_dims(plan: Any, captured: Captured) -> Any:
    """`plan` naming the capture's dynamic dims."""
    return dataclasses.replace(plan, dynamic_dims=captured.dynamic_dim_names)


def dims_of(pairs: Pairs) -> tuple[int, ...]:
    """The dims of `pairs`, as `dynamic_dims` takes them."""
    return tuple(sorted({d for _, d in pairs}))


def describe(captured: Captured, pairs: Pairs) -> str:
    names = captured.inputs
    return ", ".join(f"{names[i]}[{d}]" for i, d in sorted(pairs))
