"""`Pipeline`: the public API. Each method hands its work to one collaborator: planning to
`PlanningPhase` (pipeline.facade.planning_phase, over the `Planner`: capture -> profile ->
partition -> split -> costs), running to an `Executor` (local threads in one process, or one
process per pipeline rank under torchrun: pipeline.execution), the model's state (state dicts,
checkpoints, meta models) to `ModelState` (pipeline.facade.model_state), and the measured steps
with what is computed from them (calibration, prediction, re-plans) to `MeasuredSteps`
(pipeline.facade.measurement). The local and distributed difference lives in the executor."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import networkx as nx
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, Sampler

from partitioner import Captured, Plan, StageModule
from partitioner.saved_bytes import SavedBytes
from partitioner.tp_plan import TPPlan
from partitioner.unit_costs import UnitCosts
from pipeline.execution.choose import executor_for
from pipeline.execution.compiled import CompileStats
from pipeline.execution.executor import merge_outputs
from pipeline.execution.loss_scale import LossScaler, Stepper
from pipeline.execution.materialize import InitFn
from pipeline.execution.precision import warn_low_precision_parameters
from pipeline.execution.processes import Processes
from pipeline.execution.program import LossFn
from pipeline.execution.stage_io import check_loss_fn
from pipeline.facade.arguments import check_settings
from pipeline.facade.data import replica_sampler
from pipeline.facade.measurement import MeasuredSteps
from pipeline.facade.metrics import Metrics, StepMetrics
from pipeline.facade.model_state import ModelState
from pipeline.facade.planning_phase import PlanningPhase, auto_layout
from pipeline.facade.running import CallGuard, one_at_a_time, run_step
from pipeline.facade.train_eval import ModeSwitch
from pipeline.planning.activation_policies import Selective
from pipeline.planning.autoplan import AutoPlan
from pipeline.planning.calibration import Calibration, Rebalance
from pipeline.planning.costs import StageCosts
from pipeline.planning.decision import Decision
from pipeline.planning.microbatch import Batch, Microbatches
from pipeline.planning.settings import PipelineSettings
from pipeline.planning.synthesis import Resynthesis
from scheduler import Schedule, Timeline

_P = TypeVar("_P", bound="Pipeline")


class Pipeline:
    """A model split into pipeline stages that trains exactly as the unsplit model:
    ``pipe.step(x, y)`` leaves the gradients of ``loss_fn(model(x), y).backward()`` on the
    whole batch (each microbatch's loss weighted by its share of the batch) and ``pipe(x)``
    equals ``model(x)``. In one process a worker thread runs each pipeline rank on its
    device; under torchrun each process runs one pipeline rank, with data-parallel replicas
    of the pipeline, and every process makes the same calls.

    Arguments (all after ``stages`` keyword-only):

    - ``model``: the torch.nn.Module to split; on real devices or built on meta (``init_fn``).
    - ``stages``: pipeline ranks; "auto" under torchrun: a layout for the world size chosen
      from the global batch ``example_input``.
    - ``schedule``: a name in ``scheduler.SCHEDULES`` ("gpipe", "1f1b", "interleaved-1f1b",
      "zb-h1", "zbv", ...), a ``scheduler.Schedule``, the path of a schedule text file, or
      "auto" (the fastest simulated, a synthesised one included).
    - ``microbatches``: per batch (default ``min(2 x stages, batch size)``), or "auto".
    - ``loss_fn``: ``loss_fn(output, targets)``, a mean-reduced loss; `step` needs it.
    - ``balance``: "profile" (measured time), "parameters", "uniform", or units per stage.
    - ``devices``: one per pipeline rank, in one process (default: CUDA devices when there
      are at least ``stages``, else CPU).
    - ``example_input``: a batch to plan from now (default: the first batch).
    - ``virtual_stages``: model chunks per rank (default 2 for interleaved-1f1b, zbv and
      dualpipev, else 1), or "auto".
    - ``memory_limit``: bytes per device the "auto" choices must fit in.
    - ``checkpoint_activations``: what each stage keeps for its backward: "none" (False),
      "full" (True; recomputed block by block), "selective" (matmul, convolution and
      attention outputs kept, the rest recomputed), "offload" (kept in host memory), or one
      per stage; see docs/precision-memory.md.
    - ``data_parallel``: replicas of the pipeline (torchrun; default world_size // stages).
    - ``timeout``: seconds any wait may take (default $HYBRIDPIPE_TIMEOUT, else 120).
    - ``leaf_modules``: module classes kept whole when capturing.
    - ``rebalance``: re-partition once from measured costs if that cuts the predicted step
      by > 5% (off by default; ``pipe.rebalance()`` does it on demand).
    - ``capture_method``: "auto" (torch.export, falling back to torch.fx), "export" or "fx".
    - ``mixed_precision``: ``torch.bfloat16`` or ``torch.float16`` autocast in every stage
      (fp16 adds loss scaling: step with ``pipe.optimizer_step(opt)``).
    - ``dynamic_dims``: input dims besides the batch that are captured dynamic, e.g. ``(1,)``.
    - ``init_fn``: for a model built on meta: "reset_parameters" or a function initialising
      each module; each process initialises only its own stages.
    - ``grad_accumulation``: "atomic" (a failed step leaves ``.grad`` as it was) or
      "in_place" (steps add into ``.grad`` without a second copy).
    - ``shard``: how replicas share their state (torchrun): None, "optimizer" (ZeRO-1) or
      "full" (FSDP2); build the optimizer with ``pipe.optimizer(...)``.
    - ``reduce_dtype``: the dtype of the data-parallel gradient average (default fp32).
    - ``compile``: True, or a dict of torch.compile arguments (mode, backend, dynamic,
      fullgraph, options): every stage's forward and backward run compiled, equal blocks
      sharing one artefact; split-backward schedules keep B and W apart (docs/compile.md).
    - ``tensor_parallel``: processes sharing each stage's width (torchrun; world =
      data_parallel x stages x tensor_parallel, tp ranks consecutive); the plan is derived
      from the captured graph (Megatron pairs, attention by heads, vocab-parallel embedding),
      see docs/tensor-parallel.md. "auto" (torchrun, with ``example_input=``): the
      auto-planner chooses it with the layout among the divisors of the world inside a node,
      each priced at its shard shapes with its collectives (``pipe.autoplan.why()``).
    - ``tp_plan``: instead, rules ``{"module path glob": "colwise" | "rowwise" |
      "replicate"}`` (or torch's ColwiseParallel / RowwiseParallel); ``pipe.tp_plan`` shows
      what was applied.
    - ``compile_timeout``: with ``compile=``, the seconds a wait may take in a step in which
      a process may be compiling (the first step of each batch shape, and setup), instead of
      ``timeout`` (never less; default $HYBRIDPIPE_COMPILE_TIMEOUT, else 1800).
    - ``sequence_parallel``: with ``tensor_parallel``, the norms, dropout and residual adds
      between the tensor-parallel matmuls run on 1/tp of the tokens each (all-gather and
      reduce-scatter instead of all-reduce; docs/tensor-parallel.md).

    The arguments are checked once into ``pipe.settings`` (a frozen
    pipeline.planning.settings.PipelineSettings); ``pipe.describe()`` shows how each stage
    was prepared to run (docs/architecture.md).

    Guides: docs/training.md (options and what a step guarantees), docs/capture.md (capture
    and real models), docs/schedules.md, docs/planning.md (cost model, profiling, auto-plan,
    simulate, rebalance), docs/precision-memory.md, docs/distributed.md (torchrun, data
    parallel, sharding), docs/big-models.md (meta models, init_fn), docs/checkpoints.md
    (checkpoints, elastic training), docs/cli.md (the command line and pictures),
    docs/compile.md (compiled stages), docs/tensor-parallel.md (tensor_parallel, tp_plan).
    """

    def __init__(
        self, model: nn.Module, stages: int | str = 4, *,
        schedule: str | os.PathLike[str] | Schedule = "1f1b",
        microbatches: int | str | None = None, loss_fn: LossFn | None = None,
        balance: str | Sequence[int] = "profile",
        devices: Sequence[str | torch.device] | None = None,
        example_input: Batch | None = None, virtual_stages: int | str | None = None,
        memory_limit: float | None = None,
        checkpoint_activations: bool | str | Selective | Sequence[bool | str | Selective] = False,
        data_parallel: int | None = None, timeout: float | None = None,
        leaf_modules: tuple[type, ...] | None = None, rebalance: bool = False,
        capture_method: str = "auto", mixed_precision: torch.dtype | None = None,
        dynamic_dims: Sequence[int] = (), init_fn: InitFn | str | None = None,
        grad_accumulation: str = "atomic",
        shard: str | None = None, reduce_dtype: torch.dtype | None = None,
        compile: bool | dict[str, Any] = False,  # noqa: A002 - torch.compile's name
        compile_timeout: float | None = None,
        tensor_parallel: int | str = 1, tp_plan: Mapping[str, Any] | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.module = model
        self._busy = CallGuard()  # see pipeline.facade.running.one_at_a_time
        self._layouts: AutoPlan | None = None
        loss_fn = check_loss_fn(loss_fn)  # its signature, before anything is planned
        settings = check_settings(
            stages, schedule=schedule, microbatches=microbatches, balance=balance,
            devices=devices, virtual_stages=virtual_stages, memory_limit=memory_limit,
            checkpoint_activations=checkpoint_activations, data_parallel=data_parallel,
            timeout=timeout, leaf_modules=leaf_modules, rebalance=rebalance,
            capture_method=capture_method, mixed_precision=mixed_precision,
            dynamic_dims=dynamic_dims, grad_accumulation=grad_accumulation, shard=shard,
            reduce_dtype=reduce_dtype, compile=compile, compile_timeout=compile_timeout,
            tensor_parallel=tensor_parallel, tp_plan=tp_plan,
            sequence_parallel=sequence_parallel,
        )
        layout = job = None
        if "auto" in (settings.stages, settings.tensor_parallel):  # the layout for the world
            layout, job = auto_layout(model, example_input, settings)
            self._layouts, example_input = layout.ranking, layout.example
            settings = settings.laid_out(
                stages=layout.stages, data_parallel=layout.data_parallel,
                schedule=layout.schedule, microbatches=layout.microbatches,
                virtual_stages=layout.virtual_stages, tensor_parallel=layout.tensor_parallel)
        self.settings: PipelineSettings = settings
        self.stages = settings.ranks
        self.loss_fn = loss_fn
        self.grad_accumulation = settings.grad_accumulation
        self.checkpoint_activations = settings.checkpoint_activations
        self.timeout = settings.timeout
        self._executor = executor_for(settings, job)
        self.shard = self._executor.shard
        self.devices = self._executor.devices
        warn_low_precision_parameters(model, self._executor.precision.dtype)
        self._model_state = ModelState(model, self._executor, self.timeout, init_fn)
        self._modes = ModeSwitch(model)  # before any plan: it needs every tensor's shape
        self._setup = PlanningPhase.agreed(
            model, self._executor, self._load, settings, loss_fn=loss_fn,
            surveyed=layout.surveyed if layout is not None else None,
        )
        self._measured = MeasuredSteps(self._setup, self.stages, settings.rebalance)
        self._metrics = Metrics()
        if example_input is not None:
            self._setup.plan_on(example_input)

    def _load(self, decision: Decision) -> None:
        """Give a plan to the executor with this Pipeline's (current) loss and settings."""
        # What the FLOP count needs, while this process still holds the whole model.
        self._metrics.flop_count.snapshot(decision.captured.graph_module, decision.example)
        self._executor.load(decision, loss_fn=self.loss_fn)
        self._model_state.initialise()

    # -- planning and running -----------------------------------------------------------------

    @property
    def microbatches(self) -> int | None:
        """Microbatches per batch (None until the first batch when not given)."""
        return self._setup.microbatches

    @property
    def balance(self) -> str | Sequence[int]:
        """How the stages were balanced ("profile", "parameters", "uniform" or the sizes)."""
        return self._setup.planner.balance

    @one_at_a_time
    def step(self, x: Batch | None, y: Batch | None) -> Tensor:
        """Forward and backward over all microbatches of batch `x` with targets `y`.

        Gradients accumulate into the parameters' ``.grad`` (call the optimizer after). Returns
        the whole-batch loss: the sum over microbatches of ``loss_fn(out_m, y_m) * n_m / n``, a
        detached 0-dim tensor on the last stage's device (the mean loss for mean-reduced
        losses). On error nothing is accumulated: ``.grad`` is as it was before the step.

        Under torchrun every process calls it with its replica's batch (a process holding
        neither stage 0 nor the last stage may pass None for both, the first-stage one None for
        `y`, the last-stage one None for `x`) and gets the mean loss over the replicas.
        """
        if self.loss_fn is None:
            raise ValueError(
                "Pipeline.step needs a loss: pass loss_fn=... (e.g. nn.CrossEntropyLoss()) when "
                "building the Pipeline, or call pipe(x) for forward only"
            )
        start = time.perf_counter()
        inputs = self._inputs(x, whole=True)
        with self._executor.precision.calling("Pipeline.step", self._device_types):
            result = run_step(self._executor, self.parameters(), inputs, y,
                              in_place=self.grad_accumulation == "in_place")
        self._measured.record(result.trace)
        if result.loss is None:
            raise RuntimeError("the executor returned no loss from the last stage")
        self._metrics.after_step(self._executor, self._setup.require_plan(), inputs, y,
                                 result.loss,
                                 result.trace, time.perf_counter() - start)
        return result.loss

    def _inputs(self, x: Batch | None, *, whole: bool) -> Microbatches | None:
        """`x` split into microbatches (planning first on the first batch; `PlanningPhase.inputs`),
        with the held stages running the modes the model's modules are in now
        (pipeline.facade.train_eval)."""
        inputs = self._setup.inputs(x, whole=whole)
        self._modes.follow(self._setup, self._executor)
        return inputs

    @property
    def metrics(self) -> StepMetrics | None:
        """The last step's figures (None before the first step): samples/s, tokens/s (when the
        input has a sequence dim), achieved FLOP/s and MFU, the measured bubble fraction and
        the peak memory of this process's ranks (pipeline.facade.metrics.StepMetrics)."""
        return self._metrics.last

    def log_metrics(
        self, every: int | None = 10, *, peak_flops: float | None = None,
        to: Callable[[str], None] | None = None,
    ) -> None:
        """Show `metrics` as one line every `every` steps (None: stop): printed, or on the
        "hybridpipe" logger at INFO when logging is set up to show it (``logging.basicConfig(
        level=logging.INFO)``), or through `to` (e.g. a file's write). `peak_flops`: one
        device's dense peak FLOP/s for MFU (default: read from the device's name for the
        arithmetic the step runs in; none on CPU). Every process shows its own ranks' memory.
        Step numbers count on from `steps_done` (a resumed run's)."""
        self._metrics.configure(every, peak_flops, to)

    @property
    def steps_done(self) -> int:
        """Training steps run, counted on from a resumed checkpoint's (`Checkpointer.resume`
        sets it; set it yourself after ``load_checkpoint``): `metrics.step` and the
        `log_metrics` lines number the next step ``steps_done + 1``."""
        return self._metrics.steps

    @steps_done.setter
    def steps_done(self, steps: int) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps_done={steps!r}: give the number of steps done, an int >= 0")
        self._metrics.steps = steps

    @one_at_a_time
    def forward(self, x: Batch | None) -> Any:
        """Forward only, microbatched like `step` (fewer microbatches if the batch is smaller);
        equals ``model(x)`` (None on processes that do not hold the last stage). Under
        ``torch.no_grad()`` no graph is kept; otherwise the output stays connected to the
        parameters (a backward through it runs unpipelined)."""
        with self._executor.precision.calling("Pipeline.forward", self._device_types):
            return self._executor.forward(self._inputs(x, whole=False))

    __call__ = forward

    @one_at_a_time
    def evaluate(
        self, x: Batch | None, y: Batch | None, *, return_outputs: bool = False
    ) -> Tensor | tuple[Tensor, Any]:
        """The loss of batch `x` with targets `y`, as `step` computes it but forward only: a
        forward-only schedule over the microbatches under ``torch.no_grad()`` (no autograd
        state kept), with ``.grad``, the optimizer and the random number generators of the
        training run left as they were (dropout in train mode draws from a forked RNG), and
        BatchNorm statistics untouched in eval mode. Runs in the modules' mode: call
        ``pipe.eval()`` first for a validation pass. Returns the loss (a detached 0-dim
        tensor) on every process, the mean over replicas; with `return_outputs`, also the
        merged output (None on processes without the last stage). Under torchrun every
        process calls it, passing inputs and targets as to `step`."""
        if self.loss_fn is None:
            raise ValueError(
                "Pipeline.evaluate needs a loss: pass loss_fn=... when building the Pipeline, "
                "or call pipe(x) under torch.no_grad() for the outputs alone"
            )
        devices = [d for d in self.devices if d.type == "cuda"]
        with self._executor.precision.calling("Pipeline.evaluate", self._device_types), \
                torch.random.fork_rng(devices=devices):
            loss, outputs = self._executor.evaluate(self._inputs(x, whole=False), y)
        if not return_outputs:
            return loss
        return loss, None if outputs is None else merge_outputs(outputs)

    @property
    def schedule(self) -> Schedule:
        """The Schedule being run (built from the first batch if microbatches was not given)."""
        return self._setup.schedule

    @property
    def plan(self) -> Plan:
        """The partition (stages, nodes, predicted costs, imbalance)."""
        return self._setup.require_plan().plan

    @property
    def tp_plan(self) -> TPPlan | None:
        """With ``tensor_parallel`` > 1, the tensor-parallel plan applied to the stages this
        process holds (each parameter's split dim and why, what stays replicated and its
        bytes; ``print(pipe.tp_plan)``); None without tensor parallelism or before the plan."""
        return self._executor.tp_plan

    def count_saved_activations(self) -> dict[int, SavedBytes]:
        """Count, from the next step on, the bytes each pipeline rank run in this process
        keeps for its backward (what ``checkpoint_activations`` decides; each storage once,
        parameters not counted; partitioner.saved_bytes): pipeline rank -> meter, whose
        ``peak`` after a step is that rank's peak. Once the plan is made."""
        self._setup.require_plan()
        return self._executor.count_saved()

    @property
    def compile_stats(self) -> CompileStats | None:
        """With ``compile=``: graphs compiled, seconds spent, regions sharing an artefact and
        what runs eager with the reason (logged after a step that compiled); else None."""
        return self._executor.compile_stats if self._executor.compile is not None else None

    @property
    def stage_modules(self) -> list[StageModule]:
        """The stage modules this process holds, in stage order (they share the model's
        parameters; every stage in one process)."""
        self._setup.require_plan()  # the explanatory error before the first batch
        held = self._executor.held()
        return [held[s] for s in sorted(held)]

    def describe(self) -> str:
        """How this Pipeline runs, as text: the schedule, then each stage this process holds
        with the stage-preparation passes that made it ready to run, in their order (split,
        tensor parallel, activation policy, compile, precision, data parallel;
        pipeline.execution.passes), one line each. Once the plan is made."""
        self._setup.require_plan()  # the explanatory error before the first batch
        prepared = self._executor.prepared
        stages = [prepared[s].describe() for s in sorted(self._executor.held()) if s in prepared]
        return "\n".join([repr(self), *stages])

    @property
    def autoplan(self) -> AutoPlan | None:
        """The auto-planner's ranked candidates when a setting was "auto" (else None); for
        ``stages="auto"`` / ``tensor_parallel="auto"`` the (tensor_parallel, stages,
        data_parallel) layouts ranked for this world (``.why()``: why the best won)."""
        auto = self._setup.require_plan().auto  # the explanatory error before the first batch
        return auto.ranking if auto is not None else self._layouts

    @property
    def captured(self) -> Captured:
        """The captured model the plan partitions (partitioner.Captured: its units, flat
        graph module, input structure and dims, capture method)."""
        return self._setup.require_plan().captured

    @property
    def graph(self) -> nx.DiGraph:
        """The captured units the plan partitions, as a networkx graph (`captured.graph`;
        their costs are `captured.costs`)."""
        return self._setup.require_plan().captured.graph

    # -- as the model would: parameters, optimizers, state dicts, checkpoints, train/eval --

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The model's parameters (the stages share them); under torch.distributed, once set
        up, only this process's stages' parameters. An optimizer built from them at any time
        trains the weights that run: a model built on meta keeps these objects when its
        weights are made or loaded (docs/big-models.md)."""
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
    def distributed(self) -> Processes | None:
        """The process groups and rank layout under torch.distributed (the executor's
        `DistContext`: ``layout``, ``dp_group``, ``pp_group``, ...), else None."""
        return self._executor.context

    @property
    def processes(self) -> Processes:
        """The job's processes (this one alone, in one process): ``stages``,
        ``data_parallel``, ``dp_rank``, ``pp_rank``, ``rank``, ``world_size`` and the
        collective steps checkpoints take (pipeline.execution.processes)."""
        return self._executor.processes

    def replica_sampler(
        self, data: Dataset[Any] | Sampler[Any], *, shuffle: bool = True, seed: int = 0,
        drop_last: bool = False, epoch: int = 0, start: int = 0,
    ) -> Sampler[Any]:
        """This process's data-parallel replica's share of a dataset (torch's
        DistributedSampler over the layout's replicas, resumable: `start` skips the samples the
        job consumed this epoch under any layout; pipeline.facade.data.ReplicaSampler) or of a
        sized sampler (every replicas-th index). Every pipeline rank of a replica gets the same
        indices; in one process, all of them. Use it as ``DataLoader(data, batch_size,
        sampler=pipe.replica_sampler(data))`` and call ``set_epoch`` each epoch."""
        processes = self._executor.processes
        return replica_sampler(data, processes.data_parallel, processes.dp_rank,
                               shuffle=shuffle, seed=seed, drop_last=drop_last, epoch=epoch,
                               start=start)

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
        return self._model_state.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load a whole-model state dict (e.g. ``model.state_dict()``, or ``torch.load(path,
        mmap=True)``) into the stages this process holds. Missing or unexpected keys (when
        `strict`) and shape mismatches raise ValueError listing them."""
        self._model_state.load_state_dict(state_dict, strict)

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
        self._model_state.save_checkpoint(path, optimizer, extra, keep, async_save)

    def wait_checkpoint(self, timeout: float | None = None) -> None:
        """Return once the asynchronous save in flight (if any) is live on every process;
        raise its error (the previous version stays live). Bounded by `timeout` seconds
        (default: the Pipeline's timeout). Call it before the process ends."""
        self._model_state.wait_checkpoint(timeout)

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
        return self._model_state.load_checkpoint(path, optimizer, version)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none)

    def train(self: _P, mode: bool = True) -> _P:
        self.module.train(mode)
        return self

    def eval(self: _P) -> _P:
        return self.train(False)

    # -- measured and predicted steps --------------------------------------------------------

    @property
    def trace(self) -> Timeline | None:
        """The measured Timeline of the last successful step (None before the first step).
        Times are host perf_counter seconds; on CUDA they time kernel launches, not kernels.
        Under torch.profiler each action is also labelled ``hybridpipe <stage><op><microbatch>``
        (e.g. "hybridpipe 1B3"); the actions run in worker threads, so profile with
        ``experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)``
        to see them."""
        return self._measured.trace

    def profiled_costs(self) -> StageCosts:
        """Per-stage profiled seconds for one microbatch (profiling now, on one microbatch of
        the first batch, if the plan was not balanced by profile). Under torch.distributed the
        costs are those global rank 0 measured before the model was split, or, without them,
        measured now by each process on the units it holds (every process calls it then)."""
        return self._measured.profiled_costs()

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
        return self._measured.simulate(schedule, comm, calibrated)

    @property
    def calibration(self) -> Calibration | None:
        """Measured costs from the recorded step traces (pipeline.planning.calibration), or None
        before the second step (the first is warm-up)."""
        return self._measured.calibration

    def rebalance(self, threshold: float = 0.05) -> Rebalance:
        """Re-partition from the measured costs when that cuts the calibrated predicted step
        by more than `threshold` (the stage modules are rebuilt; they share the model's
        parameters, so an optimizer over ``pipe.parameters()`` keeps working). Returns and
        logs the Rebalance report (also kept as ``pipe.rebalanced``). Under torchrun every
        process calls it at the same step: each rank's measured stage times are gathered,
        global rank 0 re-partitions for the ranks' measured speeds, and the moved units'
        weights, grads and optimizer state travel rank to rank (docs/distributed.md)."""
        return self._measured.rebalance(threshold)

    @property
    def rebalanced(self) -> Rebalance | None:
        """The report of the last `rebalance` (automatic or on demand), else None."""
        return self._measured.rebalanced

    def rebalance_from(
        self, costs: Mapping[str, UnitCosts], *,
        optimizer: torch.optim.Optimizer | None = None, threshold: float = 0.0,
    ) -> Rebalance:
        """The elastic re-plan: re-partition the running plan from unit costs an earlier run
        of this model measured (its ``pipe.captured.costs``, which a checkpoint keeps;
        `Checkpointer.resume` calls this at another layout before loading) when that cuts the
        step they predict by more than `threshold`, without profiling again. This Pipeline
        keeps those costs (``pipe.captured.costs``) for later re-plans and checkpoints. Under
        torchrun every process calls it; the moved units' state in `optimizer` (and in those
        made by ``pipe.optimizer(...)``) moves with them. Returns the Rebalance report."""
        return self._measured.rebalance_from(costs, optimizer, threshold)

    def resynthesize(self, threshold: float = 0.05) -> Resynthesis:
        """Synthesise a schedule from the measured costs within the memory the running one
        may hold (``memory_limit``, else its peak in-flight activations) and run it from the
        next step if it cuts the calibrated predicted step by more than `threshold`. Under
        torchrun every process calls it at the same step (global rank 0 synthesises from
        every rank's measured times). Returns the report, also kept as
        ``pipe.resynthesized``."""
        return self._measured.resynthesize(threshold)

    @property
    def resynthesized(self) -> Resynthesis | None:
        """The report of the last `resynthesize` (automatic or on demand), else None."""
        return self._measured.resynthesized

    def __repr__(self) -> str:
        planner, decision = self._setup.planner, self._setup.decision
        schedule = decision.schedule if decision is not None else planner.schedule
        name = schedule.name if schedule is not None else planner.schedule_spec
        return (
            f"Pipeline({type(self.module).__name__}, stages={self.stages}, schedule={name!r}, "
            f"microbatches={self.microbatches}, devices={[str(d) for d in self.devices]})"
        )
