"""`Pipeline`: the user-facing facade. It checks the settings, then hands planning to a
`Planner` (capture -> profile -> partition -> split -> costs; pipeline.planning.planner) and
running to an `Executor` (pipeline.execution.executor): local threads in one process, or one
process per pipeline rank under torchrun (pipeline.execution.distributed). Every method below is
one code path; the local and distributed difference lives in the executor."""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import networkx as nx
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from partitioner import Plan, StageModule, split_model
from partitioner.capture import call_structure, check_inputs, check_mode
from partitioner.exported import flat_inputs
from pipeline import checkpoint
from pipeline.execution.distributed import DistContext, DistributedExecutor
from pipeline.execution.executor import Executor
from pipeline.execution.local import LocalExecutor, resolve_devices
from pipeline.execution.program import LossFn
from pipeline.execution.timeouts import resolve_timeout
from pipeline.planning.autoplan import AutoPlan
from pipeline.planning.calibration import (
    Calibration,
    Rebalance,
    calibrate,
    calibrated_costs,
    measured_node_costs,
    predict_calibrated,
    propose_rebalance,
)
from pipeline.planning.costs import StageCosts, costs_for_stages, predict
from pipeline.planning.microbatch import Batch, batch_size, split_microbatches, tensor_leaves
from pipeline.planning.planner import Planned, Planner
from pipeline.planning.settings import pipeline_settings
from scheduler import Schedule, Timeline, build_schedule

log = logging.getLogger("hybridpipe")

_F = TypeVar("_F", bound=Callable[..., Any])


def _one_at_a_time(method: _F) -> _F:
    """A Pipeline runs one step or forward at a time: a second call from another thread while
    one runs is a RuntimeError naming both (it would share the workers and the .grad)."""

    @functools.wraps(method)
    def guarded(self: Pipeline, *args: Any, **kwargs: Any) -> Any:
        me = f"Pipeline.{method.__name__} in thread {threading.current_thread().name!r}"
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"{me} was called while {self._busy_with} is running; a Pipeline runs one "
                "call at a time: call it from one thread, or give each thread its own Pipeline"
            )
        self._busy_with = me
        try:
            return method(self, *args, **kwargs)
        finally:
            self._busy.release()

    return guarded  # type: ignore[return-value]


def _check_int(value: object, what: str, minimum: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}; {fix}")
    return value


class Pipeline:
    """A model split into pipeline stages that trains exactly as the unsplit model.

    ``Pipeline(model, stages=4)`` captures the model (torch.export, or torch.fx), partitions
    it into ``stages x virtual_stages`` contiguous stages (``balance``: "profile" = measured time,
    "parameters", "uniform", or node counts per stage), builds the schedule and runs each step
    with one worker thread per pipeline rank, each on its device (``devices``; by default CUDA
    devices when there are at least ``stages``, else CPU).

    - ``schedule``: a name from ``scheduler.SCHEDULES`` ("gpipe", "1f1b", "1f1b-eager",
      "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev"), a ``scheduler.Schedule`` or
      the path of a schedule text file
      (``Schedule.to_text`` form); custom schedules are validated before anything runs.
    - ``virtual_stages``: model chunks per rank (default 2 for interleaved-1f1b, zbv and
      dualpipev, else 1).
    - ``microbatches``: default ``min(2 x stages, batch size)`` of the first batch (logged on the
      "hybridpipe" logger). Batches are split along dim 0 as ``torch.tensor_split`` does.
    - ``schedule="auto"``, ``microbatches="auto"``, ``virtual_stages="auto"``: chosen on the
      first batch by simulating the candidates on the profiled model (pipeline.planning.autoplan;
      the fastest predicted step), under ``memory_limit`` bytes per device (parameters x 4 for
      weights, grads and Adam, plus the simulated peak of held activations). ``pipe.autoplan``
      holds the ranked candidates.
    - ``example_input``: when given, the plan is made now; otherwise from the first batch
      (capture and profiling run on one microbatch of it).
    - ``checkpoint_activations``: recompute each stage's forward in its backward
      (``torch.utils.checkpoint``, non-reentrant) instead of keeping its activations. With a
      split-backward (zero-bubble) schedule, every stage but the first recomputes twice, once
      for B and once for W (torch's checkpoint recomputes once per backward call), and W
      re-walks the input-grad path (see pipeline.execution.split_backward).
    - ``timeout``: seconds any wait for a tensor may take before the step fails (default
      $HYBRIDPIPE_TIMEOUT, else 120).
    - ``leaf_modules``: module classes kept whole when capturing: one unit of the exported
      graph, or called whole by fx (see partitioner.capture).
    - ``capture_method``: "auto" (torch.export, falling back to torch.fx), "export" or "fx".
    - ``data_parallel``: replicas of the pipeline; needs the distributed executor (torchrun).
    - ``rebalance``: after the third step, re-partition once from the measured stage costs if
      that cuts the predicted step by > 5% (``pipe.rebalanced`` reports it; see `rebalance`).
      Off by default: it changes the stages mid-run on a few noisy measurements, so it is the
      user's call; ``pipe.rebalance()`` does it on demand.

    Under torchrun (torch.distributed initialised) the same call runs one pipeline rank per
    process with ``data_parallel`` (default world_size // stages) replicas; see
    pipeline.execution.distributed for the rank layout, the timeout and multi-node launch. Every
    process makes the same calls; each passes its replica's batch to ``step`` (a process that holds
    neither stage 0 nor the last stage may pass None for both, the first-stage process may pass
    None for targets and the last-stage one None for inputs). Global rank 0 makes the plan and
    the others follow it; each process keeps only its own stages' parameters (the others are
    emptied), and ``parameters()`` / ``named_parameters()`` yield those. ``step`` returns the
    mean loss over replicas on every process; ``pipe(x)`` returns the output on the processes
    holding the last stage and None elsewhere.

    Loss and gradients: ``step(x, y)`` applies ``loss_fn(output_m, y_m) * n_m / n`` to each
    microbatch m (n_m samples of n), so with a mean-reduced loss the summed gradients equal
    those of ``loss_fn(model(x), y)`` on the whole batch, also when the batch does not divide
    evenly. Gradients accumulate into ``.grad`` like ``loss.backward()``; if a step fails, the
    gradients it produced are discarded and ``.grad`` is left as before the step.

    Each executed action is labelled ``hybridpipe <stage><op><microbatch>`` (e.g. "1B3") with
    ``torch.profiler.record_function``; the actions run in worker threads, so profile with
    ``experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)``
    to see them. ``pipe.trace`` holds the same actions as measured ``scheduler.Event``s.

    Thread-local state of the caller (``torch.autocast``, grad mode) does not reach the worker
    threads: put autocast inside the model's forward. Grad mode is handled: ``pipe(x)`` under
    ``torch.no_grad()`` builds no graph.

    BatchNorm in train mode normalises each microbatch with its own statistics and updates
    the running statistics once per microbatch, so it differs from a whole-batch run (as in
    any microbatched pipeline); in eval mode the pipeline is exact. Data-parallel replicas
    take replica 0's running statistics after each step or forward (DDP's broadcast_buffers).
    Dropout draws different random numbers than a single-device run (each rank's thread has
    its own RNG stream use).
    """


    def __init__(
        self,
        model: nn.Module,
        stages: int = 4,
        *,
        schedule: str | os.PathLike[str] | Schedule = "1f1b",
        microbatches: int | str | None = None,
        loss_fn: LossFn | None = None,
        balance: str | Sequence[int] = "profile",
        devices: Sequence[str | torch.device] | None = None,
        example_input: Batch | None = None,
        virtual_stages: int | str | None = None,
        memory_limit: float | None = None,
        checkpoint_activations: bool = False,
        data_parallel: int | None = None,
        timeout: float | None = None,
        leaf_modules: tuple[type, ...] | None = None,
        rebalance: bool = False,
        capture_method: str = "auto",
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.module = model
        self._busy, self._busy_with = threading.Lock(), ""  # see _one_at_a_time
        self.stages = _check_int(stages, "stages", 1, "give the number of pipeline ranks")
        if microbatches not in (None, "auto"):
            _check_int(microbatches, "microbatches", 1, "split each batch into at least 1")
        if virtual_stages not in (None, "auto"):
            _check_int(virtual_stages, "virtual_stages", 1, "give model chunks per rank")
        if memory_limit is not None and (
            isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float))
            or memory_limit <= 0
        ):
            raise ValueError(f"memory_limit must be a number of bytes > 0, got {memory_limit!r}")
        if data_parallel not in (None, 1) and not dist.is_initialized():
            raise ValueError(
                f"data_parallel={data_parallel} needs the distributed executor: launch with "
                "torchrun (torch.distributed initialised), or drop data_parallel"
            )
        self.loss_fn = loss_fn
        self.checkpoint_activations = checkpoint_activations
        self.timeout = resolve_timeout(timeout)
        self._executor = _executor_for(self.stages, devices, data_parallel, self.timeout)
        self.devices = self._executor.devices
        with self._executor.setting_up():
            self._planner = Planner(
                model, self.stages, schedule=schedule, microbatches=microbatches,
                virtual_stages=virtual_stages, balance=balance, leaf_modules=leaf_modules,
                memory_limit=memory_limit, capture_method=capture_method,
            )
        # Every process must build the same Pipeline (checked under torch.distributed).
        ctx = self._executor.context
        self._executor.coordination.agree("the settings check", settings=pipeline_settings(
            stages=self.stages, data_parallel=1 if ctx is None else ctx.layout.data_parallel,
            schedule=schedule, built=self._planner.schedule, microbatches=microbatches,
            virtual_stages=virtual_stages, loss_fn=loss_fn, model=model,
        ))
        self._spec = checkpoint.model_spec(model)
        self._planned: Planned | None = None
        self._checked: set[tuple[Any, ...]] = set()  # batch shapes that passed _check_inputs
        self._trace: Timeline | None = None
        # Measured traces for calibration: the last few steps after the first (warm-up) one.
        self._measured: collections.deque[Timeline] = collections.deque(maxlen=4)
        self._steps = 0
        self._auto_rebalance = rebalance
        self.rebalanced: Rebalance | None = None
        if example_input is not None:
            self._setup(self._as_args(example_input))

    @property
    def microbatches(self) -> int | None:
        """Microbatches per batch (None until the first batch when not given)."""
        return self._planner.microbatches

    @property
    def balance(self) -> str | Sequence[int]:
        return self._planner.balance

    # -- setup ------------------------------------------------------------------------------------

    def _as_args(self, x: Batch) -> tuple[Any, ...]:
        """The flat input tensors stage 0 takes from a tensor or tuple/list batch (positional
        arguments) or a dict batch (keyword arguments), in the captured order."""
        try:
            tensor_leaves(x, "inputs")
        except TypeError as err:
            raise TypeError(
                f"{err}; inputs must be a tensor or a tuple/list/dict of tensors (split along "
                "dim 0); pass a constant argument (a flag such as output_hidden_states=True) "
                "through the model instead: set it in its config, or wrap the model in a module "
                "whose forward passes it"
            ) from None
        args, kwargs = call_structure(x)
        if self._planned is not None:
            signature = inspect.signature(self.module.forward)
            return flat_inputs(self._planned.graph.graph["in_spec"], args, kwargs, signature)
        leaves, self._planner.call_spec = tree_flatten((args, kwargs))
        return tuple(leaves)

    def _setup(self, args: tuple[Any, ...] | None) -> Planned:
        """Make the plan from one batch of inputs and give it to the executor."""
        with self._executor.setting_up():
            planned = self._planner.make(args, self._executor.coordination)
            self._executor.load(
                planned, loss_fn=self.loss_fn, checkpoint_activations=self.checkpoint_activations
            )
        self._planned = planned
        return planned

    def _args(self, x: Batch | None) -> tuple[Any, ...] | None:
        """`x` as positional arguments, planning first if this is the first batch."""
        args = None if x is None else self._as_args(x)
        if self._planned is None:
            self._setup(args)
        elif args is not None:
            self._check_inputs(self._planned, args)
        return args

    def _check_inputs(self, planned: Planned, args: tuple[Any, ...]) -> None:
        """Fail before any tensor moves when a batch cannot run on the captured graph (a
        static dim changed, or the train/eval mode an export baked in). A batch of shapes
        already checked is not checked again (the check costs ~0.2 ms per microbatch)."""
        check_mode(planned.graph)
        shapes = (id(planned), tuple(
            (tuple(t.shape), t.dtype) if isinstance(t, Tensor) else type(t) for t in args
        ))
        if shapes in self._checked:
            return
        m = min(planned.schedule.num_microbatches, batch_size(args, "inputs"))
        for mb in split_microbatches(args, m, "inputs"):
            check_inputs(planned.graph, mb)
        if len(self._checked) >= 64:
            self._checked.clear()
        self._checked.add(shapes)

    # -- running ----------------------------------------------------------------------------------

    @_one_at_a_time
    def step(self, x: Batch | None, y: Batch | None) -> Tensor:
        """Forward and backward over all microbatches of batch `x` with targets `y`.

        Gradients accumulate into the parameters' ``.grad`` (call the optimizer after). Returns
        the whole-batch loss: the sum over microbatches of ``loss_fn(out_m, y_m) * n_m / n``, a
        detached 0-dim tensor on the last stage's device (the mean loss for mean-reduced
        losses). On error nothing is accumulated: ``.grad`` is as it was before the step.
        """
        if self.loss_fn is None:
            raise ValueError(
                "Pipeline.step needs a loss: pass loss_fn=... (e.g. nn.CrossEntropyLoss()) when "
                "building the Pipeline, or call pipe(x) for forward only"
            )
        args = self._args(x)
        params = [p for p in self.parameters() if p.requires_grad]
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            result = self._executor.run_step(args, y)
        except BaseException:
            for p, g in zip(params, before, strict=True):
                p.grad = g
            raise
        for p, g in zip(params, before, strict=True):
            if g is not None:
                p.grad = g if p.grad is None else g.add_(p.grad)
        self._trace = result.trace
        self._record(result.trace)
        if result.loss is None:
            raise RuntimeError("the executor returned no loss from the last stage")
        return result.loss

    @_one_at_a_time
    def forward(self, x: Batch | None) -> Any:
        """Forward only, microbatched like `step` (fewer microbatches if the batch is smaller);
        equals ``model(x)`` (None on processes that do not hold the last stage). Under
        ``torch.no_grad()`` no graph is kept; otherwise the output stays connected to the
        parameters (a backward through it runs unpipelined)."""
        return self._executor.forward(self._args(x))

    __call__ = forward

    # -- inspection -------------------------------------------------------------------------------

    @property
    def schedule(self) -> Schedule:
        """The Schedule being run (built from the first batch if microbatches was not given)."""
        if self._planner.schedule is None:
            raise RuntimeError(
                "the schedule is built from the first batch because microbatches was not given; "
                "pass microbatches=... or example_input=..., or run step/forward first"
            )
        return self._planner.schedule

    @property
    def _plan_made(self) -> Planned:
        if self._planned is None:
            raise RuntimeError(
                "the plan is made from the first batch; pass example_input=... or run "
                "step/forward first"
            )
        return self._planned

    @property
    def plan(self) -> Plan:
        """The partition (stages, nodes, predicted costs, imbalance)."""
        return self._plan_made.plan

    @property
    def stage_modules(self) -> list[StageModule]:
        """The stage modules this process holds, in stage order (they share the model's
        parameters; every stage in one process)."""
        self._plan_made  # noqa: B018 - raises the explanatory error before the first batch
        held = self._executor.held()
        return [held[s] for s in sorted(held)]

    @property
    def autoplan(self) -> AutoPlan | None:
        """The auto-planner's ranked candidates when a setting was "auto" (else None)."""
        self._plan_made  # noqa: B018 - raises the explanatory error before the first batch
        return self._planner.autoplan

    @property
    def trace(self) -> Timeline | None:
        """The measured Timeline of the last successful step (None before the first step).
        Times are host perf_counter seconds; on CUDA they time kernel launches, not kernels."""
        return self._trace

    @property
    def graph(self) -> nx.DiGraph:
        """The captured (and, once profiled, annotated) graph the plan partitions."""
        return self._plan_made.graph

    def profiled_costs(self) -> StageCosts:
        """Per-stage profiled seconds for one microbatch (profiling now, on one microbatch of
        the first batch, if the plan was not balanced by profile). Under torch.distributed the
        costs are those global rank 0 measured before the model was split."""
        return self._planner.costs(self._plan_made, self._executor.coordination)

    def simulate(
        self, schedule: Schedule | str | None = None, comm: float | None = None,
        calibrated: bool = True,
    ) -> Timeline:
        """The predicted Timeline of one step (pipeline.planning.costs.predict). Costs are the
        calibrated ones (`calibration`: measured action times, runtime overhead per action and
        transfer latency; the median of the steps predicted from each measured step, see
        `pipeline.planning.calibration.predict_calibrated`) once steps have been measured and
        `calibrated`, else the profiled ones. `schedule`: another Schedule or schedule name to
        predict on this model (default: the one being run); for a different stage count the
        (calibrated) graph is re-partitioned as ``balance`` says. `comm`: seconds per
        cross-rank transfer (default: the calibrated latency, else 0)."""
        profiled = self.profiled_costs()
        calibration = self.calibration if calibrated else None
        if schedule is None:
            schedule = self.schedule
        elif isinstance(schedule, str):
            schedule = build_schedule(schedule, self.stages, self.schedule.num_microbatches)
        target = schedule
        graph = self._planned.graph if self._planned is not None else None
        if target.num_stages != profiled.num_stages and (
            not self._executor.coordination.keeps_whole_model or graph is None
        ):
            raise ValueError(
                f"schedule {target.name!r} has {target.num_stages} stages and this plan "
                f"{profiled.num_stages}; under torch.distributed only the plan's stage count "
                "can be simulated"
            )
        balance = self.balance if isinstance(self.balance, str) else "profile"

        def costs_of(step: Calibration | None) -> StageCosts:
            costs = profiled if step is None else calibrated_costs(step, profiled)
            if graph is None or target.num_stages == costs.num_stages:
                return costs
            scaled = graph if step is None else measured_node_costs(graph, self.plan, costs)
            return costs_for_stages(scaled, target.num_stages, balance)

        if calibration is None:
            return predict(target, costs_of(None), latency=comm or 0.0)
        return predict_calibrated(target, calibration, costs_of, latency=comm)

    def _record(self, trace: Timeline) -> None:
        """Keep a complete step trace for calibration (not the first, warm-up step's), and
        re-balance once when asked to and two traces are in."""
        self._steps += 1
        schedule = self.schedule
        ops = 3 if schedule.splits_backward else 2
        complete = len(trace.events) == ops * schedule.num_stages * schedule.num_microbatches
        if self._steps > 1 and complete:
            self._measured.append(trace)
        if self._auto_rebalance and self.rebalanced is None and len(self._measured) >= 2:
            self.rebalance()

    @property
    def calibration(self) -> Calibration | None:
        """Measured costs from the recorded step traces (pipeline.planning.calibration), or None
        before the second step (the first is warm-up)."""
        if not self._measured:
            return None
        return calibrate(self.schedule, list(self._measured))

    def rebalance(self, threshold: float = 0.05) -> Rebalance:
        """Re-partition from the measured costs when that cuts the calibrated predicted step
        by more than `threshold` (the stage modules are rebuilt; they share the model's
        parameters, so an optimizer over ``pipe.parameters()`` keeps working). Returns and
        logs the Rebalance report (also kept as ``pipe.rebalanced``). One process only: under
        torch.distributed the other processes no longer hold the weights a new cut needs."""
        calibration = self.calibration
        if calibration is None:
            raise ValueError("rebalance needs measured steps: run at least two steps first")
        if not self._executor.coordination.keeps_whole_model:
            raise ValueError(
                "rebalance works in one process: under torch.distributed each process holds "
                "only its stages' weights; pass balance=[...] with the sizes it reports instead"
            )
        planned = self._plan_made
        report, plan = propose_rebalance(
            planned.graph, planned.plan, planned.schedule, calibration, self.profiled_costs(),
            threshold,
        )
        if report.applied:
            new = Planned(
                planned.model, planned.schedule, plan, planned.graph, planned.example,
                split_model(planned.graph, plan), None,
            )
            self._executor.load(
                new, loss_fn=self.loss_fn, checkpoint_activations=self.checkpoint_activations
            )
            self._planned = new
            self._measured.clear()  # the old traces describe the old stages
        self.rebalanced = report
        log.info("hybridpipe: %s", report)
        return report

    # -- module-like helpers ----------------------------------------------------------------------

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The model's parameters (the stages share them); under torch.distributed, once set
        up, only this process's stages' parameters."""
        return (p for _, p in self.named_parameters(recurse=recurse))

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[
        tuple[str, nn.Parameter]
    ]:
        """The model's parameters under their original names (this process's, as above)."""
        return self._executor.named_parameters(self.module, prefix, recurse)

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

    def _held(self) -> dict[int, nn.Module]:
        """The modules whose state this process holds: its stages, or the whole model before
        the plan is made."""
        held: dict[int, nn.Module] = dict(self._executor.held())
        return held or {0: self.module}

    def state_dict(self) -> dict[str, Tensor] | None:
        """The whole model's state dict under its original keys (CPU copies). Under
        torch.distributed every process must call it; global rank 0 gets it, others None."""
        return checkpoint.gather_state_dict(self._held(), self._spec, self.distributed)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load a whole-model state dict (e.g. ``model.state_dict()``, or ``torch.load(path,
        mmap=True)``) into the stages this process holds. Missing or unexpected keys (when
        `strict`) and shape mismatches raise ValueError listing them."""
        checkpoint.load_state_dict(
            self._held(), state_dict, self._spec, strict=strict, model=self.module
        )
        self._executor.reload()

    def save_checkpoint(
        self, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None,
        extra: Any = None,
    ) -> None:
        """Write model and optimizer state (keyed by parameter name) and `extra` into the
        checkpoint directory `path`, sharded (torch.distributed.checkpoint: every process
        writes its own stages) and atomically (a new version, then an atomic switch; see
        pipeline.checkpoint). Under torch.distributed every process calls it; loadable at any
        (stages, data_parallel) layout. `extra` must be plain data (checked now)."""
        checkpoint.save_checkpoint(
            path, self._held(), self._spec, self.distributed, optimizer=optimizer,
            model=self.module, extra=extra,
        )

    def load_checkpoint(
        self, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        """Load a checkpoint from `save_checkpoint` (any layout) into this process's stages
        and `optimizer` (build it over ``pipe.parameters()`` first); returns the saved extra.
        All or nothing: a checkpoint of another model or optimizer (type, param groups) is a
        ValueError that changes nothing."""
        extra = checkpoint.load_checkpoint(
            path, self._held(), self._spec, optimizer=optimizer, model=self.module,
        )
        self._executor.reload()
        return extra

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none)

    def train(self, mode: bool = True) -> Pipeline:
        self.module.train(mode)
        return self

    def eval(self) -> Pipeline:
        return self.train(False)

    def __repr__(self) -> str:
        schedule = self._planner.schedule
        name = schedule.name if schedule is not None else self._planner.schedule_spec
        return (
            f"Pipeline({type(self.module).__name__}, stages={self.stages}, schedule={name!r}, "
            f"microbatches={self.microbatches}, devices={[str(d) for d in self.devices]})"
        )


def _executor_for(
    stages: int,
    devices: Sequence[str | torch.device] | None,
    data_parallel: int | None,
    timeout: float,
) -> Executor:
    """The distributed executor inside torchrun (torch.distributed initialised), else the
    local one."""
    if dist.is_initialized():
        if devices is not None:
            raise ValueError(
                f"devices={devices!r} cannot be used under torch.distributed: each process "
                "runs on one device (cuda:LOCAL_RANK with NCCL, else cpu); drop devices"
            )
        return DistributedExecutor(stages, data_parallel, timeout=timeout)
    return LocalExecutor(resolve_devices(devices, stages), timeout=timeout)
