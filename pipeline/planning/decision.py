"""What planning decides, as frozen records: the `Decision` an executor runs (schedule, plan,
stage modules, costs, the capture and what the auto-planner chose), how the model was
captured (`CaptureInputs`), and what the planning leader sends every process at the two
agreements of planning (`FirstBatch`, `Partition`); with `Coordination`, how the processes of
a job decide together. A later decision (a re-capture, a rebalance, a new schedule) is a new
record: nothing here changes once made."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils._pytree import TreeSpec

from partitioner import Captured, Plan, StageModule, split_model
from pipeline.planning.autoplan import AutoPlan
from pipeline.planning.calibration import Rebalance
from pipeline.planning.costs import StageCosts
from pipeline.planning.settings import Settings
from pipeline.planning.synthesis import Resynthesis
from scheduler import Schedule

Pairs = frozenset[tuple[int, int]]  # (flat input index, dim)


class Agree(Protocol):
    """The leader's `value` on every process, once every process's `settings` match; `what`
    names the point of setup in messages."""

    def __call__(self, what: str, value: Any = None, settings: Settings | None = None) -> Any: ...


def decide_alone(what: str, value: Any = None, settings: Settings | None = None) -> Any:
    """`Agree` for one process: its own value."""
    return value


def _no_phase(what: str) -> AbstractContextManager[None]:
    return nullcontext()


@dataclass(frozen=True)
class Coordination:
    """How the processes of a job make one decision. `leads`: this process decides (always in
    one process; global rank 0 under torch.distributed). `agree`: see `Agree`. `device`: where
    profiling runs. `keeps_whole_model`: False when the executor frees the stages other
    processes hold (then costs cannot be profiled later). `phase(what)`: the context a piece
    of planning runs in (under torch.distributed its failure reaches the other processes)."""

    leads: bool
    agree: Agree
    device: torch.device
    keeps_whole_model: bool
    phase: Callable[[str], AbstractContextManager[None]] = _no_phase


@dataclass(frozen=True)
class CaptureInputs:
    """What the model was captured on: `call_spec`, the pytree structure of the call's
    (args, kwargs) whose leaves are the flat inputs; `rows`, the flat inputs captured on (the
    model is known to run on them); `changed`, (input, dim) pairs a later batch changed, captured
    dynamic since; `fixed`, pairs the model's code keeps static (not tried again)."""

    call_spec: TreeSpec
    rows: tuple[Any, ...]
    changed: Pairs = frozenset()
    fixed: Pairs = frozenset()


@dataclass(frozen=True)
class AutoChoice:
    """What the auto-planner chose for the settings left to "auto": the schedule's name, the
    microbatches and chunks per rank, the schedule itself when it was synthesised (else None),
    and the ranked candidates it came from."""

    schedule: str
    microbatches: int
    virtual_stages: int
    built: Schedule | None
    ranking: AutoPlan


@dataclass(frozen=True)
class FirstBatch:
    """The leader's decision on the first batch, which every process follows: the microbatch
    count, the flat inputs to capture on (`rows`), the example microbatch planning profiles
    (the first of the batch), the call's structure, and the auto-planner's choice (None when
    nothing was "auto")."""

    microbatches: int
    rows: tuple[Any, ...]
    example: tuple[Any, ...]
    call_spec: TreeSpec
    auto: AutoChoice | None


@dataclass(frozen=True)
class Partition:
    """The leader's partition, which every process splits the model by, and the per-stage
    costs it profiled (None unless balance="profile")."""

    plan: Plan
    costs: StageCosts | None


@dataclass(frozen=True)
class Decision:
    """What planning decided, and the executor runs: the model, the schedule (its microbatch
    count is how every batch is split), the partition, the captured model (profiled once
    costs are known) with what it was captured on, the example microbatch that was profiled
    (flat inputs), every stage's module in stage order (sharing the model's parameters), the
    per-stage costs (None until profiled), what the auto-planner chose (None when no
    setting was "auto") and, for a decision a re-plan made, its report (`Rebalance` or
    `Resynthesis`, applied or not; `Planner.replan`)."""

    model: torch.nn.Module
    schedule: Schedule
    plan: Plan
    captured: Captured
    capture: CaptureInputs
    example: tuple[Any, ...]
    modules: tuple[StageModule, ...]
    costs: StageCosts | None = None
    auto: AutoChoice | None = None
    replanned: Rebalance | Resynthesis | None = None

    @property
    def microbatches(self) -> int:
        return self.schedule.num_microbatches

    def repartitioned(self, plan: Plan) -> Decision:
        """This decision with another partition (its stages split anew; costs unknown; the
        activation policies chosen per stage, if any, kept)."""
        plan = with_activations_of(plan, self.plan)
        return dataclasses.replace(
            self, plan=plan, modules=tuple(split_model(self.captured, plan)), costs=None
        )

    def rescheduled(self, schedule: Schedule) -> Decision:
        """This decision running another schedule of the same stages and microbatches."""
        return dataclasses.replace(self, schedule=schedule)


def with_activations_of(plan: Plan, earlier: Plan) -> Plan:
    """`plan` with the activation policies ``checkpoint_activations="auto"`` chose for
    `earlier` (the same stages, moved boundaries), when it chose them."""
    if earlier.activations is None or plan.activations is not None:
        return plan
    return dataclasses.replace(plan, activations=earlier.activations,
                               activation_peaks=earlier.activation_peaks)


@dataclass(frozen=True)
class Surveyed:
    """A capture profiled on one example microbatch before the layout was known
    (stages="auto"): what it was captured on, and the example (flat inputs) it was profiled
    on. The planner reuses it when its own first microbatch has the same structure and
    shapes."""

    captured: Captured
    inputs: CaptureInputs
    example: tuple[Any, ...]
