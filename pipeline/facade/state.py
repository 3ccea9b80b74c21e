"""The model's state behind a Pipeline: the modules this process holds, and the whole-model
state dict and checkpoints read from and written into them (pipeline.checkpoint)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor, nn

from pipeline import checkpoint
from pipeline.execution.executor import Executor

# The fp16 loss scaler's state rides in a checkpoint's extra under this key (the same scale on
# every process, so the one copy rank 0 writes is everyone's).
SCALER_KEY = "__hybridpipe_loss_scaler__"


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
        scaler = self.executor.precision.scaler
        if scaler is not None:
            extra = {SCALER_KEY: scaler.state_dict(), "extra": extra}
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
        if isinstance(extra, dict) and SCALER_KEY in extra:
            scaler = self.executor.precision.scaler
            if scaler is not None:
                scaler.load_state_dict(extra[SCALER_KEY])
            return extra["extra"]
        return extra
