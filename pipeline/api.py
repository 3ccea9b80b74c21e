"""`Pipeline`: the user-facing call. It captures and partitions the model (partitioner), builds
or validates the schedule (scheduler), places stages on devices, splits batches into
microbatches and hands each step to an executor (local threads, or one process
per rank under torchrun)."""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import networkx as nx
import torch
import torch.distributed as dist
from torch import Tensor, nn

from partitioner import Plan, StageModule, capture, partition, profile, split_model
from pipeline import checkpoint
from pipeline.costs import StageCosts, costs_for_stages, predict, stage_costs
from pipeline.distributed import DistContext, DistributedExecutor, agree, resolve_timeout
from pipeline.local import LocalExecutor
from pipeline.runtime import (
    Batch,
    Executor,
    LossFn,
    StepResult,
    batch_size,
    merge_microbatches,
    microbatch_sizes,
    split_microbatches,
)
from scheduler import SCHEDULES, Schedule, Timeline, build_schedule, validate

log = logging.getLogger("hybridpipe")


def _check_int(value: object, what: str, minimum: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}; {fix}")
    return value


def resolve_devices(devices: Sequence[str | torch.device] | None, ranks: int) -> list[torch.device]:
    """One device per pipeline rank: the given list (repeats allowed), else cuda:0..p-1 when
    there are at least `ranks` CUDA devices, else CPU for every rank."""
    if devices is None:
        if torch.cuda.is_available() and torch.cuda.device_count() >= ranks:
            return [torch.device("cuda", i) for i in range(ranks)]
        return [torch.device("cpu")] * ranks
    if isinstance(devices, (str, torch.device)):
        raise TypeError(f"devices must be a list of devices (one per stage), got {devices!r}")
    listed = list(devices)
    if len(listed) < ranks:
        raise ValueError(
            f"devices lists {len(listed)} device(s) {listed} for stages={ranks}; give one device "
            "per stage (repeating a device is allowed, e.g. ['cpu'] * stages)"
        )
    if len(listed) > ranks:
        raise ValueError(
            f"devices lists {len(listed)} devices {listed} but stages={ranks}; give exactly one "
            f"device per stage, or raise stages to {len(listed)}"
        )
    resolved = []
    for d in listed:
        try:
            device = torch.device(d)
        except (RuntimeError, TypeError) as err:
            raise ValueError(
                f"device {d!r} is not a device name ({err}); use e.g. 'cpu' or 'cuda:0'"
            ) from None
        if device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            index = torch.cuda.current_device() if device.index is None and count else device.index
            if index is None or index >= count:
                raise ValueError(
                    f"device {d!r} does not exist: this machine has {count} CUDA device(s); "
                    "name one of " + (", ".join(f"'cuda:{i}'" for i in range(count)) or "'cpu'")
                )
            device = torch.device("cuda", index)
        elif device.type != "cpu":
            raise ValueError(f"device {d!r} is not supported; use 'cpu' or 'cuda:<index>'")
        resolved.append(device)
    return resolved


def _to_device(batch: Batch, device: torch.device) -> Batch:
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


class Pipeline:
    """A model split into pipeline stages that trains exactly as the unsplit model.

    ``Pipeline(model, stages=4)`` captures the model (torch.fx), partitions it into
    ``stages x virtual_stages`` contiguous stages (``balance``: "profile" = measured time,
    "parameters", "uniform", or node counts per stage), builds the schedule and runs each step
    with one worker thread per pipeline rank, each on its device (``devices``; by default CUDA
    devices when there are at least ``stages``, else CPU).

    - ``schedule``: a name from ``scheduler.SCHEDULES`` ("gpipe", "1f1b", "interleaved-1f1b",
      "zb-h1", "zb-h2", "zbv", "dualpipev"), a ``scheduler.Schedule`` or the path of a
      schedule text file
      (``Schedule.to_text`` form); custom schedules are validated before anything runs.
    - ``virtual_stages``: model chunks per rank (default 2 for interleaved-1f1b, zbv and
      dualpipev, else 1).
    - ``microbatches``: default ``min(2 x stages, batch size)`` of the first batch (logged on the
      "hybridpipe" logger). Batches are split along dim 0 as ``torch.tensor_split`` does.
    - ``example_input``: when given, the plan is made now; otherwise from the first batch
      (capture and profiling run on one microbatch of it).
    - ``checkpoint_activations``: recompute each stage's forward in its backward
      (``torch.utils.checkpoint``, non-reentrant) instead of keeping its activations. With a
      split-backward (zero-bubble) schedule, every stage but the first recomputes twice, once
      for B and once for W (torch's checkpoint recomputes once per backward call), and W
      re-walks the input-grad path (see pipeline.runtime).
    - ``timeout``: seconds any wait for a tensor may take before the step fails (default
      $HYBRIDPIPE_TIMEOUT, else 120).
    - ``leaf_modules``: module classes fx keeps whole when capturing (see partitioner.capture).
    - ``data_parallel``: replicas of the pipeline; needs the distributed executor (torchrun).

    Under torchrun (torch.distributed initialised) the same call runs one pipeline rank per
    process with ``data_parallel`` (default world_size // stages) replicas; see
    pipeline.distributed for the rank layout, the timeout and multi-node launch. Every process
    makes the same calls; each passes its replica's batch to ``step`` (a process that holds
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
    any microbatched pipeline); in eval mode the pipeline is exact. Dropout draws different
    random numbers than a single-device run (each rank's thread has its own RNG stream use).
    """

    def __init__(
        self,
        model: nn.Module,
        stages: int = 4,
        *,
        schedule: str | os.PathLike[str] | Schedule = "1f1b",
        microbatches: int | None = None,
        loss_fn: LossFn | None = None,
        balance: str | Sequence[int] = "profile",
        devices: Sequence[str | torch.device] | None = None,
        example_input: Batch | None = None,
        virtual_stages: int | None = None,
        checkpoint_activations: bool = False,
        data_parallel: int | None = None,
        timeout: float | None = None,
        leaf_modules: tuple[type, ...] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.module = model
        self.stages = _check_int(stages, "stages", 1, "give the number of pipeline ranks")
        if microbatches is not None:
            _check_int(microbatches, "microbatches", 1, "split each batch into at least 1")
        if virtual_stages is not None:
            _check_int(virtual_stages, "virtual_stages", 1, "give model chunks per rank")
        if data_parallel not in (None, 1) and not dist.is_initialized():
            raise ValueError(
                f"data_parallel={data_parallel} needs the distributed executor: launch with "
                "torchrun (torch.distributed initialised), or drop data_parallel"
            )
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
        ):
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.loss_fn = loss_fn
        self.balance = balance
        self.checkpoint_activations = checkpoint_activations
        self.timeout = resolve_timeout(timeout)
        self.leaf_modules = leaf_modules
        self._dist: DistContext | None = None
        if dist.is_initialized():
            if devices is not None:
                raise ValueError(
                    f"devices={devices!r} cannot be used under torch.distributed: each process "
                    "runs on one device (cuda:LOCAL_RANK with NCCL, else cpu); drop devices"
                )
            self._dist = DistContext(self.stages, data_parallel, timeout=self.timeout)
            self.devices = [self._dist.device] * self.stages
        else:
            self.devices = resolve_devices(devices, self.stages)
        self._spec = checkpoint.model_spec(model)
        self._dist_executor: DistributedExecutor | None = None
        self.microbatches: int | None = microbatches
        self._schedule_spec = schedule
        self._virtual_stages = virtual_stages
        self._schedule: Schedule | None = None
        self._custom = self._load_custom(schedule)
        if self._custom is not None:
            self._schedule = self._adopt(self._custom)
        elif self.microbatches is not None:
            self._schedule = self._build_schedule(self.microbatches)
        self._plan: Plan | None = None
        self._captured: tuple[nx.DiGraph, tuple[Any, ...]] | None = None
        self._stage_modules: list[StageModule] = []
        self._costs: StageCosts | None = None
        self._executor: Executor | None = None
        self._trace: Timeline | None = None
        if example_input is not None:
            self._setup(self._as_args(example_input))

    # -- schedule -------------------------------------------------------------------------------

    def _load_custom(self, spec: object) -> Schedule | None:
        if isinstance(spec, Schedule):
            return spec
        if isinstance(spec, str) and spec in SCHEDULES:
            return None
        if isinstance(spec, (str, os.PathLike)):
            path = Path(spec)
            if path.is_file():
                return Schedule.from_text(path.read_text(), name=path.stem)
            raise ValueError(
                f"schedule {str(spec)!r} is neither a known schedule nor a file; choose one of "
                f"{sorted(SCHEDULES)}, pass a scheduler.Schedule, or a schedule text file's path"
            )
        raise TypeError(
            f"schedule must be a name, a path or a scheduler.Schedule, got {type(spec).__name__}"
        )

    def _adopt(self, schedule: Schedule) -> Schedule:
        """Check a custom schedule against the Pipeline's settings and validate it."""
        if schedule.num_ranks != self.stages:
            raise ValueError(
                f"schedule {schedule.name!r} has {schedule.num_ranks} ranks but stages="
                f"{self.stages}; make them equal"
            )
        if self.microbatches not in (None, schedule.num_microbatches):
            raise ValueError(
                f"schedule {schedule.name!r} runs {schedule.num_microbatches} microbatches but "
                f"microbatches={self.microbatches}; drop microbatches or make them equal"
            )
        if self._virtual_stages not in (None, schedule.virtual_stages):
            raise ValueError(
                f"schedule {schedule.name!r} has {schedule.virtual_stages} stages per rank but "
                f"virtual_stages={self._virtual_stages}; drop virtual_stages or make them equal"
            )
        if schedule.num_stages % schedule.num_ranks:
            raise ValueError(
                f"schedule {schedule.name!r} has {schedule.num_stages} stages on "
                f"{schedule.num_ranks} ranks; give every rank the same number of stages"
            )
        validate(schedule)
        self.microbatches = schedule.num_microbatches
        return schedule

    def _build_schedule(self, microbatches: int) -> Schedule:
        name = str(self._schedule_spec)
        return build_schedule(name, self.stages, microbatches, self._virtual_stages)

    # -- setup ------------------------------------------------------------------------------------

    def _as_args(self, x: Batch) -> tuple[Any, ...]:
        """The model's positional forward arguments from a tensor, tuple/list or dict batch."""
        if isinstance(x, Tensor):
            return (x,)
        if isinstance(x, (tuple, list)):
            return tuple(x)
        if isinstance(x, dict):
            names = [
                p.name
                for p in inspect.signature(self.module.forward).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
            unknown = sorted(set(x) - set(names))
            if unknown:
                raise ValueError(
                    f"input keys {unknown} are not arguments of {type(self.module).__name__}"
                    f".forward {names}; use its argument names as keys"
                )
            used = [n for n in names if n in x]
            if names[: len(used)] != used:
                raise ValueError(
                    f"input keys {sorted(x)} skip arguments of forward {names}; give the leading "
                    "arguments without gaps"
                )
            return tuple(x[n] for n in used)
        raise TypeError(
            f"inputs must be a tensor or a tuple/dict of tensors, got {type(x).__name__}"
        )

    def _setup(self, args: tuple[Any, ...] | None) -> Executor:
        """Make the plan, stage modules and executor from one batch of inputs."""
        if self._dist is not None:
            return self._setup_distributed(self._dist, args)
        if args is None:
            raise ValueError("the first step/forward needs a batch of inputs; got None")
        size = batch_size(args, "inputs")
        if self.microbatches is None:
            self.microbatches = min(2 * self.stages, size)
            log.info(
                "hybridpipe: using microbatches=%d (2 x stages, capped by batch size %d)",
                self.microbatches,
                size,
            )
        if self._schedule is None:
            self._schedule = self._build_schedule(self.microbatches)
        schedule = self._schedule
        example = tuple(split_microbatches(args, self.microbatches, "inputs")[0])
        graph = capture(self.module, example, leaf_modules=self.leaf_modules)
        if self.balance == "profile":
            profile(graph, self.module, example, device=self.devices[0])
        plan = partition(graph, schedule.num_stages, self.balance)
        modules = split_model(graph, plan)
        for s, module in enumerate(modules):
            module.to(self.devices[schedule.placement[s]])
        self._plan, self._captured = plan, (graph, example)
        self._stage_modules = modules
        self._executor = self._make_executor(schedule, modules)
        return self._executor

    def _make_executor(self, schedule: Schedule, modules: Sequence[nn.Module]) -> Executor:
        # The distributed executor (one process per rank under torchrun) is chosen here.
        return LocalExecutor(
            schedule,
            modules,
            self.devices,
            loss_fn=self.loss_fn,
            checkpoint_activations=self.checkpoint_activations,
            timeout=self.timeout,
        )

    def _setup_distributed(
        self, ctx: DistContext, args: tuple[Any, ...] | None
    ) -> DistributedExecutor:
        """Global rank 0 picks the microbatch count and the plan from its batch; every process
        captures the same example, keeps its own stages and empties the others' tensors."""
        with ctx.guard("setup"):
            return self._setup_distributed_guarded(ctx, args)

    def _setup_distributed_guarded(
        self, ctx: DistContext, args: tuple[Any, ...] | None
    ) -> DistributedExecutor:
        offer = None
        if dist.get_rank() == 0:
            if args is None:
                raise ValueError(
                    "global rank 0 holds stage 0 and makes the plan: pass it this replica's "
                    "inputs (or example_input=...)"
                )
            size = batch_size(args, "inputs")
            m = self.microbatches if self.microbatches is not None else min(2 * self.stages, size)
            first = split_microbatches(args, m, "inputs")[0]
            offer = (m, tuple(
                a if isinstance(a, Tensor) and a.is_meta else _to_device(a, torch.device("cpu"))
                for a in first
            ))
        m, example = agree(offer)
        if self.microbatches is None:
            self.microbatches = m
            log.info("hybridpipe: using microbatches=%d", m)
        if self._schedule is None:
            self._schedule = self._build_schedule(self.microbatches)
        schedule = self._schedule
        graph = capture(self.module, example, leaf_modules=self.leaf_modules)
        plan = None
        if dist.get_rank() == 0:
            if self.balance == "profile":
                profile(graph, self.module, example, device=ctx.device)
            plan = partition(graph, schedule.num_stages, self.balance)
        plan = agree(plan)
        # The costs are measured on rank 0 while it still holds the whole model.
        profiled = dist.get_rank() == 0 and self.balance == "profile"
        self._costs = agree(stage_costs(graph, plan) if profiled else None)
        modules = split_model(graph, plan)
        mine = {s: modules[s] for s in schedule.stages_of(ctx.layout.pp_rank)}
        kept = {id(t) for mod in mine.values() for t in (*mod.parameters(), *mod.buffers())}
        with torch.no_grad():
            for t in (*self.module.parameters(), *self.module.buffers()):
                if id(t) not in kept:  # another process's stage: free its memory
                    t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self._plan, self._captured = plan, (graph, example)
        self._stage_modules = [mine[s] for s in sorted(mine)]
        return self._make_distributed_executor(ctx)

    def _make_distributed_executor(self, ctx: DistContext) -> DistributedExecutor:
        """(Re)build this process's executor over its stage modules; meta stages (a model
        built on the meta device) stay there until load_state_dict gives them weights."""
        mine = self._held()
        for module in mine.values():
            if not any(t.is_meta for t in (*module.parameters(), *module.buffers())):
                module.to(ctx.device)
        executor = DistributedExecutor(
            self.schedule, mine, ctx, loss_fn=self.loss_fn,
            checkpoint_activations=self.checkpoint_activations,
        )
        self._executor = self._dist_executor = executor
        return executor

    def _ready_distributed(self, ctx: DistContext, args: tuple[Any, ...] | None
                           ) -> DistributedExecutor:
        if self._dist_executor is None:
            return self._setup_distributed(ctx, args)
        return self._dist_executor

    def _distributed_step(self, ctx: DistContext, x: Batch | None, y: Batch | None
                          ) -> Callable[[], StepResult]:
        """This process's share of a step: inputs if it holds stage 0, targets and loss weights
        if it holds the last stage (the others may be None)."""
        args = None if x is None else self._as_args(x)
        executor = self._ready_distributed(ctx, args)
        schedule = self.schedule
        m = schedule.num_microbatches
        first, last = self.holds_first_stage, self.holds_last_stage
        if first and args is None:
            raise ValueError(
                f"{ctx.layout.describe()} holds stage 0: pass its replica's inputs "
                "to step"
            )
        if last and y is None:
            raise ValueError(
                f"{ctx.layout.describe()} holds the last stage: pass its replica's "
                "targets to step"
            )
        n = batch_size(args, "inputs") if args is not None else None
        if y is not None:
            n_targets = batch_size(y, "targets")
            if n is not None and n_targets != n:
                raise ValueError(
                    f"targets have batch size {n_targets} but inputs have {n}; give one target "
                    "per input sample (dim 0 of both must match)"
                )
            n = n_targets
        device = self.devices[0]
        inputs = (
            [tuple(_to_device(a, device)) for a in split_microbatches(args, m, "inputs")]
            if first and args is not None else None
        )
        targets = (
            [_to_device(t, device) for t in split_microbatches(y, m, "targets")]
            if last and y is not None else None
        )
        weights = [k / n for k in microbatch_sizes(n, m)] if last and n is not None else []
        return lambda: executor.run_step(inputs, targets, weights)

    def _ready(self, args: tuple[Any, ...] | None) -> Executor:
        if self._executor is None:
            return self._setup(args)
        return self._executor

    # -- running ----------------------------------------------------------------------------------

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
        run: Callable[[], StepResult]
        if self._dist is not None:
            run = self._distributed_step(self._dist, x, y)
        else:
            if x is None or y is None:
                raise ValueError("step needs inputs and targets; got None")
            args = self._as_args(x)
            n = batch_size(args, "inputs")
            n_targets = batch_size(y, "targets")
            if n_targets != n:
                raise ValueError(
                    f"targets have batch size {n_targets} but inputs have {n}; give one target "
                    "per input sample (dim 0 of both must match)"
                )
            executor = self._ready(args)
            schedule = self.schedule
            m = schedule.num_microbatches
            xs = split_microbatches(args, m, "inputs")
            ys = split_microbatches(y, m, "targets")
            first = self.devices[schedule.placement[0]]
            last = self.devices[schedule.placement[-1]]
            inputs = [tuple(_to_device(a, first)) for a in xs]
            targets = [_to_device(t, last) for t in ys]
            weights = [k / n for k in microbatch_sizes(n, m)]
            local = executor

            def run() -> StepResult:
                return local.run_step(inputs, targets, weights)

        params = [p for p in self.parameters() if p.requires_grad]
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            result = run()
        except BaseException:
            for p, g in zip(params, before, strict=True):
                p.grad = g
            raise
        for p, g in zip(params, before, strict=True):
            if g is not None:
                p.grad = g if p.grad is None else g.add_(p.grad)
        self._trace = result.trace
        if result.loss is None:
            raise RuntimeError("the executor returned no loss from the last stage")
        return result.loss

    def forward(self, x: Batch | None) -> Any:
        """Forward only, microbatched like `step` (fewer microbatches if the batch is smaller);
        equals ``model(x)``. Under ``torch.no_grad()`` no graph is kept; otherwise the output
        stays connected to the parameters (a backward through it runs unpipelined)."""
        if self._dist is not None:
            dargs = None if x is None else self._as_args(x)
            dexec = self._ready_distributed(self._dist, dargs)
            xs_d = None
            if self.holds_first_stage:
                if dargs is None:
                    raise ValueError("this process holds stage 0: pass its replica's inputs")
                m = min(self.schedule.num_microbatches, batch_size(dargs, "inputs"))
                xs_d = [
                    tuple(_to_device(a, self.devices[0]))
                    for a in split_microbatches(dargs, m, "inputs")
                ]
            outputs = dexec.forward(xs_d)
            return merge_microbatches(outputs) if self.holds_last_stage else None
        if x is None:
            raise ValueError("forward needs inputs; got None")
        args = self._as_args(x)
        n = batch_size(args, "inputs")
        executor = self._ready(args)
        m = min(self.schedule.num_microbatches, n)
        first = self.devices[self.schedule.placement[0]]
        xs = [tuple(_to_device(a, first)) for a in split_microbatches(args, m, "inputs")]
        return merge_microbatches(executor.forward(xs))

    __call__ = forward

    # -- inspection -------------------------------------------------------------------------------

    @property
    def schedule(self) -> Schedule:
        """The Schedule being run (built from the first batch if microbatches was not given)."""
        if self._schedule is None:
            raise RuntimeError(
                "the schedule is built from the first batch because microbatches was not given; "
                "pass microbatches=... or example_input=..., or run step/forward first"
            )
        return self._schedule

    @property
    def plan(self) -> Plan:
        """The partition (stages, nodes, predicted costs, imbalance)."""
        if self._plan is None:
            raise RuntimeError(
                "the plan is made from the first batch; pass example_input=... or run "
                "step/forward first"
            )
        return self._plan

    @property
    def stage_modules(self) -> list[StageModule]:
        """The stage modules, in stage order (they share the model's parameters)."""
        self.plan  # noqa: B018 - raises the explanatory error before the first batch
        return list(self._stage_modules)

    @property
    def trace(self) -> Timeline | None:
        """The measured Timeline of the last successful step (None before the first step).
        Times are host perf_counter seconds; on CUDA they time kernel launches, not kernels."""
        return self._trace

    @property
    def graph(self) -> nx.DiGraph:
        """The captured (and, once profiled, annotated) graph the plan partitions."""
        self.plan  # noqa: B018 - raises the explanatory error before the first batch
        if self._captured is None:
            raise RuntimeError("the plan has no captured graph")
        return self._captured[0]

    def profiled_costs(self) -> StageCosts:
        """Per-stage profiled seconds for one microbatch (profiling now, on one microbatch of
        the first batch, if the plan was not balanced by profile). Under torch.distributed the
        costs are those global rank 0 measured before the model was split."""
        plan = self.plan
        if self._costs is not None:
            return self._costs
        if self._dist_executor is not None:
            raise RuntimeError(
                "under torch.distributed the stage costs are measured on global rank 0 before "
                "the model is split; build the Pipeline with balance='profile' to simulate it"
            )
        if self._captured is None:
            raise RuntimeError("the plan has no captured graph to profile")
        graph, example = self._captured
        if not all("forward_time" in graph.nodes[v] for v in graph.graph["order"]):
            profile(graph, self.module, example, device=self.devices[0])
        self._costs = stage_costs(graph, plan)
        return self._costs

    def simulate(self, schedule: Schedule | str | None = None, comm: float = 0.0) -> Timeline:
        """The predicted Timeline of one step (pipeline.costs.predict on `profiled_costs()`).
        `schedule`: another Schedule or schedule name to predict on this model (default: the
        one being run); for a different stage count the profiled graph is re-partitioned as
        ``balance`` says. `comm`: latency added to each cross-rank transfer (seconds)."""
        costs = self.profiled_costs()
        if schedule is None:
            schedule = self.schedule
        elif isinstance(schedule, str):
            schedule = build_schedule(schedule, self.stages, self.schedule.num_microbatches)
        if schedule.num_stages != costs.num_stages:
            if self._captured is None or self._dist_executor is not None:
                raise ValueError(
                    f"schedule {schedule.name!r} has {schedule.num_stages} stages and this "
                    f"plan {costs.num_stages}; under torch.distributed only the plan's stage "
                    "count can be simulated"
                )
            balance = self.balance if isinstance(self.balance, str) else "profile"
            costs = costs_for_stages(self.graph, schedule.num_stages, balance)
        return predict(schedule, costs, latency=comm)

    # -- module-like helpers ----------------------------------------------------------------------

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The model's parameters (the stages share them); under torch.distributed, once set
        up, only this process's stages' parameters."""
        return (p for _, p in self.named_parameters(recurse=recurse))

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[
        tuple[str, nn.Parameter]
    ]:
        """The model's parameters under their original names (this process's, as above)."""
        if self._dist is None or not self._stage_modules:
            return self.module.named_parameters(prefix, recurse)
        own = {k: p for m in self._stage_modules for k, p in m.named_parameters()}
        return ((prefix + k, p) for k, p in own.items())

    @property
    def distributed(self) -> DistContext | None:
        """The process groups and rank layout under torch.distributed, else None."""
        return self._dist

    @property
    def holds_first_stage(self) -> bool:
        """Whether this process runs stage 0 (always, in one process)."""
        if self._dist is None:
            return True
        return self.schedule.placement[0] == self._dist.layout.pp_rank

    @property
    def holds_last_stage(self) -> bool:
        """Whether this process runs the last stage (always, in one process)."""
        if self._dist is None:
            return True
        return self.schedule.placement[-1] == self._dist.layout.pp_rank

    def _held(self) -> dict[int, nn.Module]:
        """The modules whose state this process holds: its stages, or the whole model before
        the plan is made."""
        if not self._stage_modules:
            return {0: self.module}
        if self._dist is None:
            return dict(enumerate(self._stage_modules))
        return dict(zip(self.schedule.stages_of(self._dist.layout.pp_rank),
                        self._stage_modules, strict=True))

    def state_dict(self) -> dict[str, Tensor] | None:
        """The whole model's state dict under its original keys (CPU copies). Under
        torch.distributed every process must call it; global rank 0 gets it, others None."""
        return checkpoint.gather_state_dict(self._held(), self._spec, self._dist)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load a whole-model state dict (e.g. ``model.state_dict()``, or ``torch.load(path,
        mmap=True)``) into the stages this process holds. Missing or unexpected keys (when
        `strict`) and shape mismatches raise ValueError listing them."""
        checkpoint.load_state_dict(self._held(), state_dict, self._spec, strict=strict)
        self._reload()

    def _reload(self) -> None:
        """After loading under torch.distributed: move the stages to this process's device and
        rebuild the executor (loading into meta stages replaces their parameters). Every
        process loads, so every process rebuilds."""
        if self._dist is not None and self._dist_executor is not None:
            self._make_distributed_executor(self._dist)

    def save_checkpoint(
        self, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None,
        extra: Any = None,
    ) -> None:
        """Write model and optimizer state (keyed by parameter name) and `extra` to one file,
        atomically (temp file + fsync + rename). Under torch.distributed every process calls
        it and global rank 0 writes; loadable at any (stages, data_parallel) layout."""
        checkpoint.save_checkpoint(
            path, self._held(), self._spec, self._dist, optimizer=optimizer,
            named_params=dict(self.module.named_parameters()), extra=extra,
        )

    def load_checkpoint(
        self, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        """Load a checkpoint from `save_checkpoint` (any layout) into this process's stages
        and `optimizer` (build it over ``pipe.parameters()`` first); returns the saved extra."""
        extra = checkpoint.load_checkpoint(
            path, self._held(), self._spec, optimizer=optimizer,
            named_params=dict(self.module.named_parameters()),
        )
        self._reload()
        return extra

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none)

    def train(self, mode: bool = True) -> Pipeline:
        self.module.train(mode)
        return self

    def eval(self) -> Pipeline:
        return self.train(False)

    def __repr__(self) -> str:
        name = self._schedule.name if self._schedule is not None else self._schedule_spec
        return (
            f"Pipeline({type(self.module).__name__}, stages={self.stages}, schedule={name!r}, "
            f"microbatches={self.microbatches}, devices={[str(d) for d in self.devices]})"
        )
