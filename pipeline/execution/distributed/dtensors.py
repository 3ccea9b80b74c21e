"""DTensor helpers shared by the sharding, tied-parameter and optimizer code: this process's
part of a tensor (a whole tensor laid out as a sharded one: pipeline.execution.processes). A
leaf: it imports torch only."""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor


def local(t: Tensor) -> Tensor:
    """This process's part of `t` (a DTensor's local shard; `t` itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t
