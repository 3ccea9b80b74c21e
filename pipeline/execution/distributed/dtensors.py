"""DTensor helpers shared by the sharding, tied-parameter, optimizer and checkpoint code: this
process's part of a tensor, and a whole tensor laid out as a (possibly sharded) one. A leaf:
it imports torch only."""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor


def local(t: Tensor) -> Tensor:
    """This process's part of `t` (a DTensor's local shard; `t` itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


def laid_out_as(target: Tensor, value: Tensor) -> Tensor:
    """`value` (a whole tensor) as `target` is laid out: for a DTensor target, this process's
    shard of it (cut locally: every process holds the whole value); otherwise `value`."""
    if isinstance(target, DTensor) and not isinstance(value, DTensor):
        return distribute_tensor(value.to(target.device), target.device_mesh, target.placements,
                                 src_data_rank=None)
    return value
