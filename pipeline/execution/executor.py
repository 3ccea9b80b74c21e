"""The `Executor` interface `Pipeline` runs through, and what both executors share: checking
a batch, splitting it into microbatches (with each microbatch's loss weight) and placing
them on the devices of the first and last stage. An executor places the planned stage modules
on its devices (`load`) and runs steps; the local one with one thread per pipeline rank
(pipeline.execution.local), the distributed one with one process per pipeline rank
(pipeline.execution.distributed)."""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, fx, nn
from torch.utils._pytree import tree_leaves

from partitioner import Captured, StageModule, UnitCosts
from partitioner.saved_bytes import SavedBytes
from partitioner.tp_plan import TPPlan
from pipeline.execution.activations.graph import block_runs
from pipeline.execution.compiled import CompileOptions, CompileStats, compile_options, compiled_unit
from pipeline.execution.grads import apply_input_grads
from pipeline.execution.materialize import InitFn, materialize, meta_tensors
from pipeline.execution.passes import PreparedStage, StageContext, prepare
from pipeline.execution.precision import make_precision
from pipeline.execution.processes import Processes
from pipeline.execution.program import LossFn, StepResult
from pipeline.execution.stage_code import StageCode, take_code
from pipeline.execution.stage_io import weighted_loss
from pipeline.planning.activation_policies import Policy, stage_policies
from pipeline.planning.decision import Coordination, Decision
from pipeline.planning.measure import measure
from pipeline.planning.microbatch import Microbatches, batch_size, merge_microbatches
from pipeline.planning.planner import PlannerHooks
from pipeline.planning.replan import median_stage_times
from pipeline.planning.settings import PipelineSettings
from scheduler import Schedule

if TYPE_CHECKING:
    from pipeline.execution.distributed.context import DistContext
    from pipeline.execution.runtime import RankRuntime


log = logging.getLogger("hybridpipe")


class Executor(ABC):
    """Runs a planned pipeline with the Pipeline's `settings` (pipeline.planning.settings:
    the precision, compile options and allowance, activation policy and sharding come from
    them, at construction). `devices[r]`: the device of pipeline rank r (as this process sees
    it, set by a subclass before this constructor runs); `coordination`: how this executor's
    processes plan together; `context`: the process groups under torch.distributed, else
    None; `shard`: how data-parallel replicas share their state
    (pipeline.execution.distributed.shard; None in one process)."""

    devices: list[torch.device]
    coordination: Coordination
    context: DistContext | None = None
    shard: str | None = None
    tp_plan: TPPlan | None = None  # the tensor-parallel plan applied (distributed, tp > 1)

    def __init__(self, settings: PipelineSettings) -> None:
        self.settings = settings
        self.planned: Decision | None = None  # the running decision (`load`, then `adopt`)
        self.loss_fn: LossFn | None = None
        self.activations: tuple[Policy, ...] = ()  # each stage's policy, once loaded
        self.precision = make_precision(settings.mixed_precision, settings.reduce_dtype,
                                        settings.shard)
        self.weights_checked = False  # no meta tensor held (checked before the first step)
        self.saved_bytes: dict[int, SavedBytes] = {}  # pipeline rank -> its meter, if counting
        options = compile_options(settings.compile)
        if options is not None and self.threads_on_cpu:
            options = options.without_gil()  # the ranks' threads must not queue on the GIL
        self.compile: CompileOptions | None = options
        self.compile_timeout = settings.compile_timeout  # the compile allowance
        self.compile_stats = CompileStats()
        self.prepared: dict[int, PreparedStage] = {}  # the held stages, as last prepared
        self._logged: dict[int, tuple[str, ...]] = {}  # each stage's passes, as last logged

    def prepare_stage(self, module: StageModule) -> PreparedStage:
        """`module` made ready to run by the stage-preparation passes
        (pipeline.execution.passes), which are logged once per stage."""
        planned, s = self.planned, module.index
        if planned is None:
            raise RuntimeError("the executor has no plan yet; call load first")
        schedule = planned.schedule
        context = StageContext(
            device=self.devices[schedule.placement[s]], units=tuple(planned.plan.stages[s]),
            splits=schedule.splits_backward, policy=self.activations[s],
            precision=self.precision, compile=self.compile, compile_stats=self.compile_stats,
            dist=self.context, tp_plan=self.tp_plan, last=s == schedule.num_stages - 1,
        )
        stage = prepare(module, self.settings, context)
        self.prepared[s] = stage
        if self._logged.get(s) != stage.applied:
            self._logged[s] = stage.applied
            log.info("hybridpipe: %s", stage.describe())
        return stage

    @property
    def processes(self) -> Processes:
        """The job's processes as checkpoints, elastic training and metrics see them (here
        this one, running every pipeline rank; pipeline.execution.processes)."""
        return Processes(len(self.devices), self.devices[0])

    @property
    def rank_devices(self) -> dict[int, torch.device]:
        """Pipeline rank -> device, for the pipeline ranks this process runs."""
        return dict(enumerate(self.devices))

    @property
    def threads_on_cpu(self) -> bool:
        """Whether this process runs several pipeline ranks in threads on CPU (they share the
        GIL, so compiled code should not hold it)."""
        return False

    def planner_hooks(self) -> PlannerHooks:
        """What the planner measures with (`planner_hooks`), for this executor's compile
        options (none under shard="full", whose stages run eager) and rank threads."""
        threads = len(self.devices) if self.threads_on_cpu else 1
        options = self.compile if self.shard != "full" else None
        return planner_hooks(options, self.compile_stats, threads)

    # -- set-up -----------------------------------------------------------------------------------

    def load(self, planned: Decision, *, loss_fn: LossFn | None) -> None:
        """Take the plan: place the stages this process holds on their devices (freeing the
        others') and get ready to run, each stage under its activation policy (the settings'
        ``checkpoint_activations``, one for all stages or one per stage, or the plan's)."""
        self.activations = stage_policies(
            self.settings.checkpoint_activations, planned.schedule.num_stages,
            planned.plan.activations,
        )
        self.planned = planned
        self.prepared = {}
        self.loss_fn = loss_fn
        self.reload()

    def adopt(self, decision: Decision, *,
              carrying: Sequence[torch.optim.Optimizer] = ()) -> None:
        """Run `decision` from the next call on: after `load`, the one place the running
        decision changes (a re-plan, costs profiled later, a capture kept or made anew for a
        new input shape). With the same stages and schedule it is taken as it is; otherwise
        the stages are placed anew for it, the units that change hands moving to their new
        holders first (`_relocate`), with their state in `carrying` besides the optimizers
        the executor knows."""
        old = self.planned
        if old is None:
            raise RuntimeError("the executor has no plan yet; call load first")
        if decision.modules is old.modules and decision.schedule is old.schedule:
            self.planned = decision
            return
        self._relocate(old, decision, lambda: self.load(decision, loss_fn=self.loss_fn),
                       carrying)

    def _relocate(self, old: Decision, new: Decision, rebuild: Callable[[], None],
                  carrying: Sequence[torch.optim.Optimizer]) -> None:
        """Move what `new` places elsewhere than `old` (with its state in the optimizers
        `carrying`), then `rebuild` for `new`; here every stage is in this process and its
        optimizers hold every parameter, so nothing moves."""
        rebuild()

    measures_rank_speeds = False
    """Whether each pipeline rank runs on a device of its own whose speed a re-plan measures
    (pipeline.planning.replan: a stage's deviation from its profile is its rank's, not its
    units'); in one process the ranks run alike."""

    def maximum(self, values: Tensor) -> Tensor:
        """The elementwise maximum of `values` over every process of the job (float64, on
        the CPU); here there is one process."""
        return values.to("cpu", torch.float64)

    def stage_times(self, steps: Sequence[list[list[float]]]) -> list[list[float]]:
        """[op][stage] measured seconds of every stage (F, B, W): the median over `steps` of
        the means of the stages each process ran (`own_stage_means`), the slowest replica's."""
        return self.maximum(torch.tensor(median_stage_times(steps))).tolist()

    def measure_units(self, decision: Decision) -> Captured:
        """`decision`'s captured model with every unit's profiled costs, each unit
        measured by the processes that hold it (a process may have freed the others' tensors):
        this process times its held stages' units (partitioner.profile; on the inputs the
        model was captured on, the other units giving zeros of their captured shapes) and the
        figures are gathered (`maximum`: the slowest replica's). Every process calls it."""
        captured = decision.captured
        held = {v for s in self.held() for v in decision.plan.stages[s]}
        whole = held == set(captured.order)
        # B and W timed apart where a schedule may split the backward (an "auto" one may
        # be re-synthesised into one that does), as the planner times them.
        splits = decision.schedule.splits_backward or decision.auto is not None
        unit_runner = self.planner_hooks().unit_runner
        runner = None if unit_runner is None else (lambda unit: unit_runner(unit, splits))
        costs = measure(captured, decision.model,
                        decision.example if whole else decision.capture.rows,
                        self.coordination.device, runner, units=None if whole else held)
        none = UnitCosts()
        table = self.maximum(torch.tensor(
            [[c.forward, c.input_grad, c.weight_grad, c.activation_bytes] if v in held
             else [0.0] * 4 for v in captured.order for c in (costs.get(v, none),)],
            dtype=torch.float64))
        return captured.with_costs({
            v: dataclasses.replace(costs.get(v, none), forward=f, input_grad=i, weight_grad=w,
                                   activation_bytes=a)
            for v, (f, i, w, a) in zip(captured.order, table.tolist(), strict=True)})

    def setting_up(self) -> AbstractContextManager[None]:
        """The context planning and `load` run in (the distributed failure protocol)."""
        return nullcontext()

    @abstractmethod
    def reload(self) -> None:
        """(Re)place the held stage modules on their devices and rebuild what runs them (after
        loading a state dict, which may give meta stages their tensors)."""

    def materialize(self, init_fn: InitFn | str | None, seed: int) -> list[str]:
        """Give the meta tensors of the stages held here storage on their devices and initial
        values (pipeline.meta.materialize; the seed is global rank 0's), then reload. Returns
        their names. Every process calls it."""
        seed = self.coordination.agree("the initialisation seed", seed)
        if self.planned is None:
            raise RuntimeError("the executor has no plan yet; call load first")
        held = sorted(self.held().items())
        devices = [self.devices[self._schedule.placement[s]] for s, _ in held]
        # The capture's modules read the same tensors (re-splits use them).
        captured = self.planned.captured
        names = materialize(
            self.planned.model, [m for _, m in held], devices, init_fn=init_fn, seed=seed,
            holders=[captured.graph_module, captured.unit_module],
        )
        self.reload()
        return names

    def accumulates_in_place(self) -> set[int]:
        """ids of the parameters whose existing `.grad` a step may add into in place: those
        exactly one held stage trains (pipeline.execution.grads)."""
        count: dict[int, int] = {}
        for module in self.held().values():
            for p in module.parameters():
                count[id(p)] = count.get(id(p), 0) + 1
        return {key for key, n in count.items() if n == 1}

    def check_weights(self) -> None:
        """Before the first step or forward after a (re)load: a ValueError naming any held
        parameter or buffer still on the meta device and the fix."""
        if self.weights_checked or self.planned is None:
            return
        names = meta_tensors(self.planned.model, self.held().values())
        if names:
            raise ValueError(meta_message(names, self.describe()))
        self.weights_checked = True

    def count_saved(self) -> dict[int, SavedBytes]:
        """From now on, count the bytes each pipeline rank run here keeps for its backward
        (partitioner.saved_bytes): pipeline rank -> its meter (`held`, `peak`). Once the
        plan is made (example_input= or a first step)."""
        runtimes = self._runtimes()
        if not runtimes:
            raise RuntimeError("nothing runs here yet: count once the plan is made "
                               "(example_input=... or after a first step)")
        self.saved_bytes = {runtime.rank: SavedBytes() for runtime in runtimes}
        for runtime in runtimes:
            runtime.saved = self.saved_bytes.get(runtime.rank)
        return self.saved_bytes

    @abstractmethod
    def _runtimes(self) -> list[RankRuntime]:
        """The rank runtimes this process runs (none before `load`)."""

    def run_code(self, codes: Sequence[StageCode]) -> None:
        """Run the held stages with `codes` (one per stage, in stage order; e.g. captured in
        the other train/eval mode): the same modules, parameters and buffers, other code."""
        held = self.held()
        for s, module in held.items():
            take_code(module, codes[s], self.devices[self._schedule.placement[s]])
        for runtime in self._runtimes():  # a compiled stage is compiled from the new code
            runtime.restage({s: self.prepare_stage(held[s]) for s in runtime.stages})

    @abstractmethod
    def held(self) -> dict[int, StageModule]:
        """Stage index -> module for the stages this process holds (empty before `load`)."""

    @property
    @abstractmethod
    def holds_first_stage(self) -> bool:
        """Whether this process runs stage 0."""

    @property
    @abstractmethod
    def holds_last_stage(self) -> bool:
        """Whether this process runs the last stage."""

    @abstractmethod
    def describe(self) -> str:
        """Who this process is, for error messages."""

    @property
    def input_device(self) -> torch.device:
        """Where stage 0's inputs go."""
        return self.devices[self._schedule.placement[0]]

    @property
    def target_device(self) -> torch.device:
        """Where the last stage's targets go."""
        return self.devices[self._schedule.placement[-1]]

    def named_parameters(
        self, model: nn.Module, prefix: str = "", recurse: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The parameters this process trains, under the model's names."""
        return model.named_parameters(prefix, recurse)

    def make_optimizer(
        self, params: Sequence[nn.Parameter], optimizer_class: type[torch.optim.Optimizer],
        **kwargs: Any,
    ) -> torch.optim.Optimizer:
        """The optimizer of this process's `params` (here a plain one)."""
        check_optimizer_class(optimizer_class)
        return optimizer_class(list(params), **kwargs)

    def clip_grad_norm_(
        self, model: nn.Module, max_norm: float, norm_type: float, error_if_nonfinite: bool
    ) -> Tensor:
        """Scale the gradients so their norm over the whole model is at most `max_norm`;
        return that norm (as torch.nn.utils.clip_grad_norm_ on the unsplit model). Here every
        parameter is in this process."""
        return torch.nn.utils.clip_grad_norm_(
            [p for _, p in self.named_parameters(model)], max_norm, norm_type, error_if_nonfinite
        )

    def any_rank(self, flag: Tensor) -> Tensor:
        """The maximum of `flag` (a 0-dim tensor) over every process of the job (e.g. an
        inf/NaN found in any process's gradients); here there is one process."""
        return flag

    @property
    def _schedule(self) -> Schedule:
        if self.planned is None:
            raise RuntimeError("the executor has no plan yet; call load first")
        return self.planned.schedule

    # -- running ----------------------------------------------------------------------------------

    def run_step(self, inputs: Microbatches | None, targets: Any) -> StepResult:
        """Forward + backward of one batch, split into the schedule's microbatches (`inputs`;
        the targets split alike here), each microbatch's loss weighted by its share of the
        batch, placed and run."""
        self.check_weights()
        m = self._schedule.num_microbatches
        first, last = self.holds_first_stage, self.holds_last_stage
        if first and inputs is None:
            raise ValueError(f"{self.describe()} holds stage 0: pass its inputs to step")
        if last and targets is None:
            raise ValueError(f"{self.describe()} holds the last stage: pass its targets to step")
        if targets is not None:
            n_targets = batch_size(targets, "targets")
            if inputs is not None and n_targets != inputs.rows:
                raise ValueError(
                    f"targets have batch size {n_targets} but inputs have {inputs.rows}; give "
                    "one target per input sample (dim 0 of both must match)"
                )
        placed = (
            [tuple(part) for part in inputs.on(self.input_device)]
            if first and inputs is not None else None
        )
        ys = Microbatches.split(targets, m, "targets") if last and targets is not None else None
        split = ys if ys is not None else inputs
        weights = split.loss_weights() if last and split is not None else []
        result = self._run_step(
            placed, None if ys is None else ys.on(self.target_device), weights
        )
        apply_input_grads(placed, result.input_grads)
        if self.compile is not None:
            self.compile_stats.log_news()
        return result

    def forward(self, inputs: Microbatches | None) -> Any:
        """Forward only, of a batch split into at most the schedule's microbatch count; the
        merged output where the last stage runs, else None."""
        outputs = self.forward_microbatches(inputs)
        return None if outputs is None else merge_outputs(outputs)

    def evaluate(
        self, inputs: Microbatches | None, targets: Any
    ) -> tuple[Tensor, list[Any] | None]:
        """Forward only without autograd, and the loss as `run_step` defines it (the sum of
        ``loss_fn(out_m, y_m) * n_m / n``, in fp32 under mixed precision) on every process,
        the mean over replicas; with the outputs per microbatch where the last stage runs."""
        with torch.no_grad():
            outputs = self.forward_microbatches(inputs)
            loss = None
            if outputs is not None:
                if targets is None:
                    raise ValueError(
                        f"{self.describe()} holds the last stage: pass its targets to evaluate"
                    )
                ys = Microbatches.split(targets, len(outputs), "targets")
                loss = torch.stack([
                    weighted_loss(self.loss_fn, self.precision.loss_input(out), y, w, mb)
                    for mb, (out, y, w) in enumerate(zip(
                        outputs, ys.on(self.target_device), ys.loss_weights(), strict=True))
                ]).sum()
        return self.share_loss(loss), outputs

    def share_loss(self, loss: Tensor | None) -> Tensor:
        """The loss of the last stage's process on every process (mean over replicas); here
        the one process holds it."""
        if loss is None:
            raise RuntimeError("the process that holds the last stage computed no loss")
        return loss

    def forward_microbatches(self, inputs: Microbatches | None) -> list[Any] | None:
        """Forward only, of a batch split into at most the schedule's microbatch count; each
        microbatch's output where the last stage runs, else None."""
        self.check_weights()
        placed = None
        if self.holds_first_stage:
            if inputs is None:
                raise ValueError(f"{self.describe()} holds stage 0: pass its inputs to forward")
            placed = [tuple(part) for part in inputs.on(self.input_device)]
        outputs = self._run_forward(placed)
        return outputs if self.holds_last_stage else None

    @abstractmethod
    def _run_step(
        self,
        inputs: Sequence[tuple[Tensor, ...]] | None,
        targets: Sequence[Any] | None,
        loss_weights: Sequence[float],
    ) -> StepResult:
        """Run the schedule over placed microbatches; grads accumulate on the parameters. On
        failure, raise the first error (partial grads are the caller's to drop)."""

    @abstractmethod
    def _run_forward(self, inputs: Sequence[tuple[Tensor, ...]] | None) -> list[Any]:
        """Forward only; the model output per microbatch where the last stage runs. Keeps an
        autograd graph only when grad mode is enabled in the caller."""


def planner_hooks(options: CompileOptions | None, stats: CompileStats, threads: int = 1
                  ) -> PlannerHooks:
    """What the planner measures with so that it sees what will run: each captured unit
    compiled as the stages will be under `options` (compile=; `stats` counts the graphs; the
    artefacts are those the stages reuse), the activation policies priced on the runtime's
    block runners, timed `threads` at once (the ranks this process runs in threads)."""
    runner = None
    if options is not None:
        def runner(unit: nn.Module, splits: bool) -> nn.Module:
            if not isinstance(unit, fx.GraphModule):
                return unit
            return compiled_unit(unit, options, stats, splits=splits)

    return PlannerHooks(unit_runner=runner, block_runs=block_runs, price_threads=threads)


def merge_outputs(outputs: Sequence[Any]) -> Any:
    """The microbatches' outputs as one batch's. The last stage's process may not hold the
    inputs: the microbatches' row counts come from the outputs' batch dim when they have one
    (else equal shares)."""
    rows = [_rows(out) for out in outputs]
    total = sum(rows)
    weights = [r / total for r in rows] if all(rows) else None
    return merge_microbatches(outputs, weights)


def _rows(output: Any) -> int:
    """The batch dim of an output's first leaf that has one (0 when none has)."""
    return next(
        (int(t.shape[0]) for t in tree_leaves(output) if isinstance(t, Tensor) and t.dim()), 0
    )


def check_optimizer_class(optimizer_class: object) -> None:
    """A TypeError unless `optimizer_class` is a torch.optim.Optimizer subclass."""
    if not (isinstance(optimizer_class, type)
            and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}; "
            "pass the class itself, e.g. pipe.optimizer(torch.optim.AdamW, lr=1e-3)"
        )


def meta_message(names: Sequence[str], who: str) -> str:
    """What a step on meta tensors says: which, and how to give them values."""
    shown = ", ".join(names[:10]) + (f" ... and {len(names) - 10} more" if len(names) > 10 else "")
    return (
        f"{who} holds {len(names)} parameter(s)/buffer(s) still on the meta device: {shown}. "
        "A model built under torch.device('meta') needs values first: "
        "pipe.load_state_dict(torch.load(path, mmap=True)) or pipe.load_checkpoint(path), or "
        "build the Pipeline with init_fn='reset_parameters' (or a function that initialises "
        "a module, e.g. model._init_weights)"
    )
