"""Microbatches: a batch split once along dim 0 (`Microbatches`: the parts, their sizes and loss
weights, which the shape checks and the executor share), merging outputs back, moving batches
to a device, all over `torch.utils._pytree` (tensors, tuples, lists, dicts, namedtuples and
any other registered pytree, nested)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
import torch.utils._pytree as pytree
from torch import Tensor

Batch: TypeAlias = Any
"""A tensor, or a pytree (tuple/list/dict, possibly nested) whose leaves are tensors."""


def tensor_leaves(batch: Batch, what: str) -> list[tuple[str, Tensor]]:
    """(name, tensor) for every leaf of `batch`, e.g. ``("inputs['k'][1]", t)``; TypeError
    naming the first leaf that is not a tensor."""
    leaves, _ = pytree.tree_flatten_with_path(batch)
    out = []
    for path, leaf in leaves:
        name = what + pytree.keystr(path)
        if not isinstance(leaf, Tensor):
            raise TypeError(f"{name} is a {type(leaf).__name__}, not a tensor")
        out.append((name, leaf))
    return out


def batch_size(batch: Batch, what: str = "inputs") -> int:
    """The common dim-0 size of every tensor in `batch`; ValueError if they differ."""
    try:
        leaves = tensor_leaves(batch, what)
    except TypeError as err:
        raise TypeError(
            f"{err}; {what} must be a tensor or a tuple/list/dict of tensors (split along dim 0)"
        ) from None
    if not leaves:
        raise ValueError(f"{what} holds no tensors; give at least one tensor with a batch dim")
    sizes = {}
    for name, t in leaves:
        if t.dim() == 0:
            raise ValueError(f"{name} is a 0-dim tensor; every tensor needs a batch dim (dim 0)")
        sizes[name] = t.shape[0]
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"{what} tensors have different batch sizes {sizes}; give every tensor the same dim 0"
        )
    return next(iter(sizes.values()))


def split_microbatches(batch: Batch, chunks: int, what: str = "inputs") -> list[Batch]:
    """Split `batch` along dim 0 into `chunks` microbatches (sizes differ by at most one, larger
    first, as `torch.tensor_split`). Every microbatch keeps the batch's structure."""
    if chunks < 1:
        raise ValueError(f"microbatches must be >= 1, got {chunks}")
    size = batch_size(batch, what)
    if size < chunks:
        raise ValueError(
            f"{what} batch size {size} is smaller than the microbatch count {chunks}; "
            f"give a batch of at least {chunks} samples or use microbatches <= {size}"
        )
    leaves, spec = pytree.tree_flatten(batch)
    columns = [torch.tensor_split(t, chunks, dim=0) for t in leaves]
    return [pytree.tree_unflatten([col[i] for col in columns], spec) for i in range(chunks)]


def microbatch_sizes(total: int, chunks: int) -> list[int]:
    """The sizes `split_microbatches` produces for a batch of `total` samples."""
    base, extra = divmod(total, chunks)
    return [base + 1 if i < extra else base for i in range(chunks)]


@dataclass(frozen=True)
class Microbatches:
    """A batch split along dim 0: `parts[i]` keeps the batch's structure, `sizes[i]` is its
    row count (larger first, as `torch.tensor_split`)."""

    parts: tuple[Batch, ...]
    sizes: tuple[int, ...]

    @classmethod
    def split(cls, batch: Batch, chunks: int, what: str = "inputs") -> Microbatches:
        """`batch` in `chunks` microbatches (`split_microbatches`; ValueError naming the fix
        if it has fewer rows)."""
        parts = split_microbatches(batch, chunks, what)
        return cls(tuple(parts), tuple(microbatch_sizes(batch_size(batch, what), chunks)))

    @property
    def count(self) -> int:
        return len(self.parts)

    @property
    def rows(self) -> int:
        """The batch's row count."""
        return sum(self.sizes)

    def loss_weights(self) -> list[float]:
        """Each microbatch's share of the batch: its loss's weight in the step's loss."""
        return [k / self.rows for k in self.sizes]

    def on(self, device: torch.device) -> list[Batch]:
        """The parts with every tensor on `device`."""
        return [to_device(part, device) for part in self.parts]


def merge_microbatches(parts: Sequence[Batch], weights: Sequence[float] | None = None) -> Batch:
    """Combine per-microbatch outputs into the whole batch's, keeping their structure:

    - a leaf with a batch dim is concatenated along dim 0;
    - a 0-dim floating-point leaf (a router's auxiliary loss, a mean) is combined as the step
      combines losses: the sum of each microbatch's value times its share of the batch
      (`weights`, default equal), which is the whole batch's value for a mean over rows;
    - any other 0-dim leaf (a count, a flag) is stacked into a (microbatches,) tensor.

    A leaf whose other dims differ between microbatches (rows of one microbatch scored against
    each other, as CLIP's logits_per_image) cannot be concatenated: ValueError naming it."""
    flat = [pytree.tree_flatten_with_path(p) for p in parts]
    spec = flat[0][1]
    for _, other in flat[1:]:
        if other != spec:
            raise TypeError(f"microbatch outputs differ in structure: {spec} vs {other}")
    shares = list(weights) if weights is not None else [1.0 / len(parts)] * len(parts)
    merged = []
    for column in zip(*(f[0] for f in flat), strict=True):
        name = "output" + pytree.keystr(column[0][0])
        values = [value for _, value in column]
        if not all(isinstance(v, Tensor) for v in values):
            raise TypeError(f"cannot merge {name} of type {type(values[0]).__name__}")
        if values[0].dim() == 0:
            if values[0].is_floating_point():
                merged.append(sum((v * w for v, w in zip(values, shares, strict=True)),
                                  torch.zeros_like(values[0])))
            else:
                merged.append(torch.stack(values))
            continue
        shapes = {tuple(v.shape[1:]) for v in values}
        if len(shapes) > 1:
            raise ValueError(
                f"{name} has per-microbatch shapes {[tuple(v.shape) for v in values]}: its "
                "rows depend on the other rows of their microbatch (e.g. CLIP's "
                "logits_per_image), so microbatches cannot be concatenated; call the pipeline "
                "with microbatches dividing the batch evenly, or compute it from outputs made "
                "row by row (CLIP's image_embeds and text_embeds)"
            )
        merged.append(torch.cat(values, dim=0))
    return pytree.tree_unflatten(merged, spec)


def to_device(batch: Batch, device: torch.device) -> Batch:
    """`batch` with every tensor on `device` (non-blocking copies; other leaves as they are)."""
    return pytree.tree_map_only(Tensor, lambda t: t.to(device, non_blocking=True), batch)


def check_output(value: Any, stage: int) -> None:
    """TypeError unless `value` is a tensor or a (nested) tuple/list/dict of tensors."""
    try:
        tensor_leaves(value, f"stage {stage} output")
    except TypeError as err:
        raise TypeError(
            f"{err}; stage {stage} is the last stage: make the model return a tensor or a "
            "tuple/dict of tensors (compute other values outside the model)"
        ) from None
