"""The torch.nn.Module-like part of the `Pipeline` API: parameters, gradient clipping, the
process's place in the pipeline, train/eval, state dicts and checkpoints (the model's state
through pipeline.facade.state)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from pipeline.execution.distributed import DistContext
from pipeline.execution.executor import Executor
from pipeline.execution.loss_scale import LossScaler, Stepper
from pipeline.facade.state import ModelState

_P = TypeVar("_P", bound="ModuleLike")


class ModuleLike:
    """What a Pipeline offers as its model would (`pipeline.api.Pipeline` sets `module`, the
    executor and the model's state)."""

    module: nn.Module
    _executor: Executor
    _state: ModelState

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The model's parameters (the stages share them); under torch.distributed, once set
        up, only this process's stages' parameters."""
        return (p for _, p in self.named_parameters(recurse=recurse))

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[
        tuple[str, nn.Parameter]
    ]:
        """The model's parameters under their original names (this process's, as above)."""
        return self._executor.named_parameters(self.module, prefix, recurse)

    def optimizer(
        self, optimizer_class: type[torch.optim.Optimizer], **kwargs: Any
    ) -> torch.optim.Optimizer:
        """``optimizer_class(pipe.parameters(), **kwargs)`` as the shard mode needs it: plain
        (shard=None; "full", whose parameters are sharded DTensors, so the state is too) or
        torch's ZeroRedundancyOptimizer of it over the replicas ("optimizer"). With a shard
        mode, call it once the plan is made (example_input=..., or after the first step); a
        plain optimizer instead is an error at its first step where it would be silently
        wrong ("full", built before the plan) and a warning where it would keep the whole
        state ("optimizer"). Checkpoints take it and load across modes and layouts."""
        return self._executor.make_optimizer(list(self.parameters()), optimizer_class, **kwargs)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole model: the gradients' norm over every
        parameter (under torch.distributed combined over the pipeline's ranks, a tied
        parameter counted once) is returned, the same on every process, and every gradient
        is scaled by max_norm / (norm + 1e-6) when that is below 1. Call it after `step`,
        before the optimizer's; clipping each process's own parameters instead would use a
        different norm on every rank."""
        return self._executor.clip_grad_norm_(
            self.module, max_norm, norm_type, error_if_nonfinite
        )

    @property
    def _device_types(self) -> set[str]:
        return {d.type for d in self._executor.devices}

    def optimizer_step(self, optimizer: Stepper, *args: Any, **kwargs: Any) -> bool:
        """``optimizer.step(*args, **kwargs)`` as ``torch.amp.GradScaler.step`` does it (call
        it after `step`, instead of ``optimizer.step()``). Under ``mixed_precision=
        torch.float16`` the step is skipped on every process when any process (any stage, any
        replica) found an inf/NaN gradient since the last call, and the loss scale is updated
        the same way everywhere (`scaler`); otherwise it just steps. Returns whether the
        optimizer stepped. Under torch.distributed every process calls it."""
        return self._executor.precision.optimizer_step(
            optimizer, self._executor.any_rank, *args, **kwargs
        )

    @property
    def scaler(self) -> LossScaler | None:
        """The fp16 loss scaler (``get_scale()``, ``state_dict()``, ``load_state_dict()`` as
        torch.amp.GradScaler's; kept in checkpoints), or None without fp16."""
        return self._executor.precision.scaler

    @property
    def distributed(self) -> DistContext | None:
        """The process groups and rank layout under torch.distributed, else None."""
        return self._executor.context

    @property
    def holds_first_stage(self) -> bool:
        """Whether this process runs stage 0 (always, in one process)."""
        return self._executor.holds_first_stage

    @property
    def holds_last_stage(self) -> bool:
        """Whether this process runs the last stage (always, in one process)."""
        return self._executor.holds_last_stage


    def state_dict(self) -> dict[str, Tensor] | None:
        """The whole model's state dict under its original keys (CPU copies). Under
        torch.distributed every process must call it; global rank 0 gets it, others None."""
        return self._state.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load a whole-model state dict (e.g. ``model.state_dict()``, or ``torch.load(path,
        mmap=True)``) into the stages this process holds. Missing or unexpected keys (when
        `strict`) and shape mismatches raise ValueError listing them."""
        self._state.load_state_dict(state_dict, strict)

    def save_checkpoint(
        self, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None,
        extra: Any = None, *, keep: int = 1, async_save: bool = False,
    ) -> None:
        """Write model and optimizer state (keyed by parameter name) and `extra` into the
        checkpoint directory `path`, sharded (torch.distributed.checkpoint: every process
        writes its own stages) and atomically (a new version, then an atomic switch; see
        pipeline.checkpoint). Under torch.distributed every process calls it; loadable at any
        (stages, data_parallel) layout. `extra` must be plain data (checked now). `keep`:
        versions kept (the newest). `async_save`: return once the tensors are copied; the
        write goes on in the background and the new version goes live when it is done
        (`wait_checkpoint`; the next save or load waits for it first)."""
        self._state.save_checkpoint(path, optimizer, extra, keep, async_save)

    def wait_checkpoint(self, timeout: float | None = None) -> None:
        """Return once the asynchronous save in flight (if any) is live on every process;
        raise its error (the previous version stays live). Bounded by `timeout` seconds
        (default: the Pipeline's timeout). Call it before the process ends."""
        self._state.wait_checkpoint(timeout)

    def load_checkpoint(
        self, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None,
        *, version: str | None = None,
    ) -> Any:
        """Load a checkpoint from `save_checkpoint` (any layout) into this process's stages
        and `optimizer` (build it first, with ``pipe.optimizer(...)``, or over
        ``pipe.parameters()`` without shard=; any shard mode loads any other's); returns the
        saved extra. All or nothing: a checkpoint of another model or optimizer (type, param
        groups) is a ValueError that changes nothing. `version`: a retained older version
        (e.g. "v-000003", kept by ``save_checkpoint(keep=...)``) instead of the live one."""
        return self._state.load_checkpoint(path, optimizer, version)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none)

    def train(self: _P, mode: bool = True) -> _P:
        self.module.train(mode)
        return self

    def eval(self: _P) -> _P:
        return self.train(False)
