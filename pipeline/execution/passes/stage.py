"""What the stage-preparation passes read and return: `StageContext`, where a stage runs and
what its executor prepares it with besides the settings, and `PreparedStage`, a stage as the
passes left it (what owns its parameters, what runs it, how a training forward calls that,
what its replicas average, and one line per pass applied)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from partitioner.tp_plan import TPPlan
from pipeline.execution.activations.recompute import Restoring
from pipeline.execution.compiled import CompileOptions, CompileStats
from pipeline.execution.precision import Precision
from pipeline.planning.activation_policies import Policy
from pipeline.planning.settings import PipelineSettings

if TYPE_CHECKING:
    from pipeline.execution.distributed.context import DistContext

Enter = Callable[[nn.Module], Callable[..., Any]]
"""How a block (or a whole stage) is called, e.g. under autocast."""
Keeps = Callable[[nn.Module, Enter, Restoring], Callable[..., Any]]
"""A training forward of what runs a stage, given how a block is entered and the context of
a recomputation: what the forward keeps for the backward."""


@dataclass(frozen=True)
class StageContext:
    """Where a stage runs and what its executor prepares it with besides the settings:
    `device`; `units`, the captured units the plan gave it; `splits`, whether the schedule
    splits the backward into B and W; `policy`, its activation policy (the settings' or the
    one checkpoint_activations="auto" planned); the executor's `precision` (its fp16 loss
    scaler is shared) and `compile` options (GIL-free for rank threads on CPU) with their
    `compile_stats`; `dist`, the process groups and DeviceMesh under torchrun (None in one
    process); `tp_plan`, the tensor-parallel plan the executor sharded the held parameters
    by (None at tensor_parallel=1); `last`, whether it is the last stage (it computes the loss)."""

    device: torch.device
    units: tuple[str, ...]
    splits: bool
    policy: Policy
    precision: Precision
    compile: CompileOptions | None
    compile_stats: CompileStats
    dist: DistContext | None = None
    tp_plan: TPPlan | None = None
    last: bool = False


def _as_is(runs: nn.Module, enter: Enter, restoring: Restoring) -> Callable[..., Any]:
    return enter(runs)


def _called(module: nn.Module) -> Callable[..., Any]:
    return module


def _unchanged(forward: Callable[..., Any]) -> Callable[..., Any]:
    return forward


@dataclass(frozen=True)
class PreparedStage:
    """A stage as the passes left it: `module`, the split stage module that owns its
    parameters; `runs`, what runs it (the module, or its compiled form); `keeps`, how a
    training forward calls `runs` (the activation policy); `enter`, how a block is called
    (the precision); `boundary`, how a whole forward (training or not) takes and returns the
    stage's values (tensor parallel: plain tensors in and out, DTensors inside); `averaged`,
    the parameters whose gradients its data-parallel replicas average; `applied`, one line
    per pass, in order."""

    module: nn.Module
    runs: nn.Module
    keeps: Keeps = _as_is
    enter: Enter = _called
    boundary: Callable[[Callable[..., Any]], Callable[..., Any]] = _unchanged
    averaged: tuple[nn.Parameter, ...] = ()
    applied: tuple[str, ...] = ()

    @classmethod
    def of(cls, module: nn.Module) -> PreparedStage:
        """`module` (a `StageModule`, or any module taking and returning a stage's values)
        before any pass: run as it is."""
        return cls(module, module)

    @property
    def index(self) -> int:
        index: int = getattr(self.module, "index", 0)
        return index

    def then(self, line: str, **changes: Any) -> PreparedStage:
        """This stage with a pass's `changes` and its line."""
        return dataclasses.replace(self, applied=(*self.applied, line), **changes)

    def training_forward(self, restoring: Restoring) -> Callable[..., Any]:
        """How the runtime calls the stage in a training forward."""
        return self.boundary(self.keeps(self.runs, self.enter, restoring))

    def forward(self) -> Callable[..., Any]:
        """How the runtime calls the stage in a forward without a backward (evaluation)."""
        return self.boundary(self.enter(self.runs))

    def describe(self) -> str:
        """The passes applied, one per line."""
        return f"stage {self.index}:\n" + "\n".join(f"  {line}" for line in self.applied)


StagePass = Callable[[PreparedStage, PipelineSettings, StageContext], PreparedStage]
"""A pass: the stage, the Pipeline's settings and where it runs -> the stage it makes."""
