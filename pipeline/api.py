"""`Pipeline`: the user-facing facade. It checks the settings, then hands planning to a
`Planner` (capture -> profile -> partition -> split -> costs; pipeline.planning.planner) and
running to an `Executor` (pipeline.execution.executor): local threads in one process, or one
process per pipeline rank under torchrun (pipeline.execution.distributed). Every method below is
one code path; the local and distributed difference lives in the executor. The facade's own
collaborators (settings checks, setup from the first batch, running, state, measurement) are in
pipeline.facade."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import networkx as nx
import torch
from torch import Tensor, nn

from partitioner import Plan, StageModule
from pipeline.elastic.layout import choose_layout
from pipeline.execution.materialize import InitFn
from pipeline.execution.precision import make_precision, warn_low_precision_parameters
from pipeline.execution.program import LossFn
from pipeline.execution.timeouts import resolve_timeout
from pipeline.facade.measured import Measured
from pipeline.facade.measurement import Measurement
from pipeline.facade.module_like import ModuleLike
from pipeline.facade.running import (
    CallGuard,
    check_grad_accumulation,
    one_at_a_time,
    run_step,
)
from pipeline.facade.settings import check_settings, executor_for
from pipeline.facade.setup import Setup
from pipeline.facade.state import ModelState
from pipeline.planning.autoplan import AutoPlan
from pipeline.planning.microbatch import Batch
from pipeline.planning.planner import Planned
from scheduler import Schedule


class Pipeline(ModuleLike, Measured):
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
      holds the ranked candidates. "auto" schedules include one synthesised for the profiled
      costs (``scheduler.synthesize``), and in one process, once two steps are measured, one
      synthesised from the measured costs replaces the running schedule if it is predicted
      > 5% faster (``pipe.resynthesized``; see `resynthesize`).
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
    - ``dynamic_dims``: dims (besides dim 0, the batch) that torch.export keeps dynamic in
      every input having them, e.g. ``(1,)`` for the sequence length; the others are captured
      static, and a later batch that changes one is captured again with it dynamic (one
      process only; under torchrun name the dims here). ``pipe.plan`` lists the dynamic dims.
    - ``data_parallel``: replicas of the pipeline; needs the distributed executor (torchrun).
    - ``stages="auto"``: under torchrun, (stages, data_parallel, ...) chosen for the world
      size from the global batch ``example_input`` (pipeline.elastic.layout).
    - ``shard``: how the replicas of each stage share their state (torchrun): None (each keeps
      everything), "optimizer" (ZeRO-1: each keeps the optimizer state of about
      1/data_parallel of the parameters) or "full" (FSDP2: parameters, gradients and optimizer
      state sharded); see pipeline.execution.distributed.shard. Build the optimizer with
      ``pipe.optimizer(optimizer_class, **kwargs)``.
    - ``rebalance``: after the third step, re-partition once from the measured stage costs if
      that cuts the predicted step by > 5% (``pipe.rebalanced`` reports it; see `rebalance`).
      Off by default: it changes the stages mid-run on a few noisy measurements, so it is the
      user's call; ``pipe.rebalance()`` does it on demand.
    - ``init_fn``: for a model built under ``torch.device("meta")``: once the plan is made,
      each process materialises only its own stages on its device and initialises them:
      "reset_parameters" (each module's own; a Hugging Face model's ``_init_weights``) or a
      function called on each module owning a meta tensor, under an RNG seeded from
      ``torch.initial_seed()`` (global rank 0's) and the module's name, so the weights do not
      depend on the layout. Without it a meta model waits for ``load_state_dict`` /
      ``load_checkpoint`` (what they lack, e.g. a rotary ``inv_freq``, comes from the modules'
      init). A meta model is balanced by FLOPs + bytes estimated on meta (partitioner.estimate).

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
    gradients it produced are discarded and ``.grad`` is left as before the step. That costs a
    second copy of the gradients while a step adds to an existing ``.grad`` (accumulation
    across steps without zero_grad); ``grad_accumulation="in_place"`` adds into it in place
    instead, without the copy, and a failed (or cancelled) step may then leave it partly
    added (the error says so; see pipeline.execution.grads).

    Each executed action is labelled ``hybridpipe <stage><op><microbatch>`` (e.g. "1B3") with
    ``torch.profiler.record_function``; the actions run in worker threads, so profile with
    ``experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)``
    to see them. ``pipe.trace`` holds the same actions as measured ``scheduler.Event``s.

    Mixed precision: ``mixed_precision=torch.bfloat16`` (or ``torch.float16``) runs every
    stage's forward, and its recomputation, under ``torch.autocast`` for its device; parameters
    and grads stay fp32, the loss is computed in fp32, and activations cross stages in the dtype
    autocast gave them. fp16 adds dynamic loss scaling: call ``pipe.optimizer_step(opt)``
    instead of ``opt.step()`` (see pipeline.execution.precision and loss_scale). The caller's
    own ``torch.autocast`` (thread-local; it would not reach the worker threads) must agree
    with ``mixed_precision`` or the call raises; autocast blocks inside forward are kept by
    torch.export capture and refused by torch.fx. ``reduce_dtype=torch.bfloat16`` sends and
    sums the data-parallel gradient average in bf16 (default fp32). Grad mode is handled:
    ``pipe(x)`` under ``torch.no_grad()`` builds no graph.

    BatchNorm in train mode normalises each microbatch with its own statistics and updates
    the running statistics once per microbatch, so it differs from a whole-batch run (as in
    any microbatched pipeline); in eval mode the pipeline is exact. Data-parallel replicas
    take replica 0's running statistics after each step or forward (DDP's broadcast_buffers).
    Dropout draws different random numbers than a single-device run (each rank's thread has
    its own RNG stream use).
    """

    def __init__(
        self, model: nn.Module, stages: int | str = 4, *,
        schedule: str | os.PathLike[str] | Schedule = "1f1b",
        microbatches: int | str | None = None, loss_fn: LossFn | None = None,
        balance: str | Sequence[int] = "profile",
        devices: Sequence[str | torch.device] | None = None,
        example_input: Batch | None = None, virtual_stages: int | str | None = None,
        memory_limit: float | None = None, checkpoint_activations: bool = False,
        data_parallel: int | None = None, timeout: float | None = None,
        leaf_modules: tuple[type, ...] | None = None, rebalance: bool = False,
        capture_method: str = "auto", mixed_precision: torch.dtype | None = None,
        dynamic_dims: Sequence[int] = (), init_fn: InitFn | str | None = None,
        grad_accumulation: str = "atomic",
        shard: str | None = None, reduce_dtype: torch.dtype | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.module = model
        self._busy = CallGuard()  # see pipeline.facade.running.one_at_a_time
        self._layouts: AutoPlan | None = None
        if stages == "auto":
            auto = choose_layout(
                model, example_input, schedule=schedule, microbatches=microbatches,
                virtual_stages=virtual_stages, data_parallel=data_parallel,
                memory_limit=memory_limit, leaf_modules=leaf_modules,
                capture_method=capture_method, timeout=resolve_timeout(timeout))
            self._layouts, example_input = auto.plan, auto.example
            stages, data_parallel, schedule, microbatches, virtual_stages = auto.settings
        self.stages = check_settings(
            stages, microbatches, virtual_stages, memory_limit, data_parallel
        )
        self.loss_fn = loss_fn
        self.grad_accumulation = check_grad_accumulation(grad_accumulation)
        self.checkpoint_activations = checkpoint_activations
        self.timeout = resolve_timeout(timeout)
        self._executor = executor_for(self.stages, devices, data_parallel, self.timeout, shard)
        self.shard = self._executor.shard
        self.devices = self._executor.devices
        self._executor.precision = make_precision(mixed_precision, reduce_dtype, self.shard)
        warn_low_precision_parameters(model, self._executor.precision.dtype)
        self._state = ModelState(model, self._executor, self.timeout, init_fn)
        self._setup = Setup.plan_for(
            model, self._executor, self._load, self.stages, schedule=schedule,
            microbatches=microbatches, virtual_stages=virtual_stages, balance=balance,
            leaf_modules=leaf_modules, memory_limit=memory_limit, capture_method=capture_method,
            loss_fn=loss_fn, dynamic_dims=dynamic_dims,
        )
        self._measure = Measurement(self._setup, self.stages, rebalance)
        if example_input is not None:
            self._setup.setup(self._setup.as_args(example_input))

    def _load(self, planned: Planned) -> None:
        """Give a plan to the executor with this Pipeline's (current) loss and settings."""
        self._executor.load(
            planned, loss_fn=self.loss_fn, checkpoint_activations=self.checkpoint_activations
        )
        self._state.initialise()

    @property
    def microbatches(self) -> int | None:
        """Microbatches per batch (None until the first batch when not given)."""
        return self._setup.planner.microbatches

    @property
    def balance(self) -> str | Sequence[int]:
        return self._setup.planner.balance


    @one_at_a_time
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
        args = self._setup.args(x)
        with self._executor.precision.calling("Pipeline.step", self._device_types):
            result = run_step(self._executor, self.parameters(), args, y,
                              in_place=self.grad_accumulation == "in_place")
        self._measure.record(result.trace)
        if result.loss is None:
            raise RuntimeError("the executor returned no loss from the last stage")
        return result.loss

    @one_at_a_time
    def forward(self, x: Batch | None) -> Any:
        """Forward only, microbatched like `step` (fewer microbatches if the batch is smaller);
        equals ``model(x)`` (None on processes that do not hold the last stage). Under
        ``torch.no_grad()`` no graph is kept; otherwise the output stays connected to the
        parameters (a backward through it runs unpipelined)."""
        with self._executor.precision.calling("Pipeline.forward", self._device_types):
            return self._executor.forward(self._setup.args(x))

    __call__ = forward


    @property
    def schedule(self) -> Schedule:
        """The Schedule being run (built from the first batch if microbatches was not given)."""
        return self._setup.schedule

    @property
    def plan(self) -> Plan:
        """The partition (stages, nodes, predicted costs, imbalance)."""
        return self._setup.made.plan

    @property
    def stage_modules(self) -> list[StageModule]:
        """The stage modules this process holds, in stage order (they share the model's
        parameters; every stage in one process)."""
        self._setup.made  # noqa: B018 - raises the explanatory error before the first batch
        held = self._executor.held()
        return [held[s] for s in sorted(held)]

    @property
    def autoplan(self) -> AutoPlan | None:
        """The auto-planner's ranked candidates when a setting was "auto" (else None); for
        ``stages="auto"`` the (stages, data_parallel) layouts ranked for this world."""
        self._setup.made  # noqa: B018 - raises the explanatory error before the first batch
        return self._setup.planner.autoplan or self._layouts

    @property
    def graph(self) -> nx.DiGraph:
        """The captured (and, once profiled, annotated) graph the plan partitions."""
        return self._setup.made.graph

    def __repr__(self) -> str:
        planner = self._setup.planner
        name = planner.schedule.name if planner.schedule is not None else planner.schedule_spec
        return (
            f"Pipeline({type(self.module).__name__}, stages={self.stages}, schedule={name!r}, "
            f"microbatches={self.microbatches}, devices={[str(d) for d in self.devices]})"
        )
