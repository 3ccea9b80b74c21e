"""The model's state behind a Pipeline: the modules this process holds, the whole-model state
dict and checkpoints read from and written into them (pipeline.checkpoint; a checkpoint also
keeps the running plan's unit costs, which an elastic restart re-plans from), and for a model
built on the meta device, the initial values of the tensors this process holds
(pipeline.execution.materialize): all of them from `init_fn`, or those a state dict or
checkpoint lacks (non-persistent buffers) from the modules' own initialisation."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor, nn

from partitioner.unit_costs import costs_as_data
from pipeline import checkpoint
from pipeline.checkpoint.background import AsyncWriter
from pipeline.execution.executor import Executor
from pipeline.execution.materialize import InitFn, materialize, resolve_init
from pipeline.planning.measure import on_meta

# The fp16 loss scaler's state rides in a checkpoint's extra under this key (the same scale on
# every process, so the one copy rank 0 writes is everyone's).
SCALER_KEY = "__hybridpipe_loss_scaler__"


class ModelState:
    """State dicts and checkpoints of `module` as split across `executor`'s stages, and the
    initialisation of a model built on meta (`init_fn`: see pipeline.execution.materialize)."""

    def __init__(
        self, module: nn.Module, executor: Executor, timeout: float,
        init_fn: InitFn | str | None = None,
    ) -> None:
        self.module = module
        self.executor = executor
        self.timeout = timeout
        self.writer: AsyncWriter | None = None  # made at the first asynchronous save
        self.spec = checkpoint.model_spec(module)
        self.built_on_meta = on_meta(module)
        if init_fn is not None:
            resolve_init(module, init_fn)  # a bad init_fn fails now, not at the first batch
            if not self.built_on_meta:
                raise ValueError(
                    f"init_fn={init_fn!r} initialises a model built on the meta device, but "
                    f"this {type(module).__name__} has real tensors; initialise it before "
                    "building the Pipeline, or build it under torch.device('meta')"
                )
        self.init_fn = init_fn

    def initialise(self) -> None:
        """Once the executor holds its stages: a model built on meta with an `init_fn` gets
        this process's stages initialised (every process calls it)."""
        if self.built_on_meta and self.init_fn is not None:
            self.executor.materialize(self.init_fn, torch.initial_seed())

    def _fill(self) -> None:
        """After loading into a model built on meta: what is still on meta (the non-persistent
        buffers no state dict holds) from the modules' own init; then place the stages."""
        if not self.built_on_meta:
            self.executor.reload()
        elif self.executor.planned is None:
            materialize(self.module, [self.module], self.executor.devices[0],
                        init_fn=self.init_fn, seed=torch.initial_seed())
        else:
            self.executor.materialize(self.init_fn, torch.initial_seed())

    def held(self) -> dict[int, nn.Module]:
        """The modules whose state this process holds: its stages, or the whole model before
        the plan is made."""
        held: dict[int, nn.Module] = dict(self.executor.held())
        return held or {0: self.module}

    def state_dict(self) -> dict[str, Tensor] | None:
        return checkpoint.gather_state_dict(self.held(), self.spec, self.executor.processes)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool) -> None:
        checkpoint.load_state_dict(
            self.held(), state_dict, self.spec, strict=strict, model=self.module
        )
        self._fill()

    def save_checkpoint(
        self, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None, extra: Any,
        keep: int, async_save: bool,
    ) -> None:
        scaler = self.executor.precision.scaler
        if scaler is not None:
            extra = {SCALER_KEY: scaler.state_dict(), "extra": extra}
        if async_save and self.writer is None:
            self.writer = AsyncWriter(self.executor.processes, self.timeout)
        if not async_save:
            self.wait_checkpoint(None)
        planned = self.executor.planned
        checkpoint.save_checkpoint(
            path, self.held(), self.spec, self.executor.processes, optimizer=optimizer,
            model=self.module, extra=extra, keep=keep,
            writer=self.writer if async_save else None,
            unit_costs=costs_as_data(planned.captured.costs) if planned is not None else None,
        )

    def wait_checkpoint(self, timeout: float | None) -> None:
        if self.writer is not None:
            self.writer.wait(timeout)

    def load_checkpoint(
        self, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None,
        version: str | None = None,
    ) -> Any:
        self.wait_checkpoint(None)
        extra = checkpoint.load_checkpoint(
            path, self.held(), self.spec, optimizer=optimizer, model=self.module,
            version_name=version,
        )
        self._fill()
        if isinstance(extra, dict) and SCALER_KEY in extra:
            scaler = self.executor.precision.scaler
            if scaler is not None:
                scaler.load_state_dict(extra[SCALER_KEY])
            return extra["extra"]
        return extra
