"""The model's state behind a Pipeline: the modules this process holds, and the whole-model
state dict and checkpoints read from and written into them (pipeline.checkpoint)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor, nn

from pipeline import checkpoint
from pipeline.execution.executor import Executor


class ModelState:
    """State dicts and checkpoints of `module` as split across `executor`'s stages."""

    def __init__(self, module: nn.Module, executor: Executor) -> None:
        self.module = module
        self.executor = executor
        self.spec = checkpoint.model_spec(module)

    def held(self) -> dict[int, nn.Module]:
        """The modules whose state this process holds: its stages, or the whole model before
        the plan is made."""
        held: dict[int, nn.Module] = dict(self.executor.held())
        return held or {0: self.module}

    def state_dict(self) -> dict[str, Tensor] | None:
        return checkpoint.gather_state_dict(self.held(), self.spec, self.executor.context)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool) -> None:
        checkpoint.load_state_dict(
            self.held(), state_dict, self.spec, strict=strict, model=self.module
        )
        self.executor.reload()

    def save_checkpoint(
        self, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None, extra: Any
    ) -> None:
        checkpoint.save_checkpoint(
            path, self.held(), self.spec, self.executor.context, optimizer=optimizer,
            model=self.module, extra=extra,
        )

    def load_checkpoint(
        self, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None
    ) -> Any:
        extra = checkpoint.load_checkpoint(
            path, self.held(), self.spec, optimizer=optimizer, model=self.module,
        )
        self.executor.reload()
        return extra
