"""`DistributedExecutor`: this process's pipeline rank of a Schedule under torch.distributed.
It runs the shared `RankRuntime` over a `P2PTransport`, averages gradients over replicas
(`GradSync`) and keeps their written buffers equal (`BufferSync`), sums the gradients of
parameters tied across pipeline ranks (`TieSync`), agrees on each step's batch shapes with its
pipeline (`StepAgreement`, step_agreement.py), and ends each step with the loss on every process
and the pipeline's trace on global rank 0 (`StepEnd`, step_end.py); `clip_grad_norm_` clips by
the whole model's norm. ``shard=`` shards the replicas' state (`Sharding`, shard.py).

Shapes. Tensor shapes and dtypes crossing ranks come from running the plan: at the first step
(and whenever the batch's shapes change) each message is preceded by a small metadata message,
cached under a key of the batch's shapes. Every step the first stage's rank sends that key, the
microbatch count, the call (step or forward) and its batch size (four integers) to the other
ranks of its pipeline, so a new batch shape re-agrees instead of hanging, and a rank that made
another call, or holds targets of another batch size, fails naming both values before any
activation moves.

Compiling. With ``compile=`` a process compiles its stages' regions in the first step that
meets a shape, while its peers wait for it. A call (batch-shape key, step or forward, grad mode)
not yet run since the stages were last prepared (`prepare_stage`) may compile on any process of
the pipeline, and every process knows it from the agreed key: its waits are bounded by the compile
allowance (``compile_timeout``) instead of the timeout, and it ends with a barrier of the
pipeline bounded by the allowance, after which no process compiles and every wait is bounded by
the timeout again (a rank may compile after its peers ended the step: the backward of an uneven
last microbatch under GPipe). A wait cannot be lengthened once it has begun (gloo's timed-out
receive fails its whole context), so the bound is chosen before the step's first wait. The
process groups' own timeouts (gloo's inside a collective, NCCL's watchdog) are raised to the
allowance.
Setup, in which global rank 0 profiles compiled units while the others wait for its plan,
is bounded by the allowance too.

Setup. Planning and `load` run as phases of the context's agreement
(pipeline.execution.distributed.agreement): no tensor moves before every process has checked in at
"the start" with the same settings; only then are the process groups made and replica 0's weights
copied to the other replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from partitioner import Captured, StageModule
from partitioner.tp_plan import TPPlan
from pipeline.execution.distributed.adoption import MoveReport, Optimizers, move_then_rebuild
from pipeline.execution.distributed.agreement import Agreement
from pipeline.execution.distributed.context import DistContext
from pipeline.execution.distributed.dtensors import local
from pipeline.execution.distributed.gradsync import (
    BufferSync,
    GradSync,
    finish_order,
    sync_replicas,
)
from pipeline.execution.distributed.p2p import MAX_MICROBATCHES, MAX_STAGES, P2PTransport
from pipeline.execution.distributed.shard import Sharding
from pipeline.execution.distributed.step_agreement import StepAgreement
from pipeline.execution.distributed.step_end import StepEnd
from pipeline.execution.distributed.ties import TieSync, find_ties
from pipeline.execution.executor import Executor, meta_message
from pipeline.execution.grads import running_statistics
from pipeline.execution.loss_parallel import ParallelLoss, parallel_loss
from pipeline.execution.materialize import meta_tensors
from pipeline.execution.passes import PreparedStage
from pipeline.execution.processes import Processes
from pipeline.execution.program import LossFn, StepResult
from pipeline.execution.runtime import RankRuntime
from pipeline.execution.tensor_parallel import parallelize
from pipeline.planning.decision import Coordination, Decision
from pipeline.planning.settings import PipelineSettings


class DistributedExecutor(Executor):
    """Runs this process's pipeline rank (see pipeline.execution.distributed for the rank layout).

    At `load` it keeps the stages placed on its pipeline rank (the others' tensors are freed)
    and copies their weights from replica 0 to the other replicas. `run_step` returns the
    global mean loss (the mean over replicas of each replica's loss) on every rank; grads on
    this process's parameters are averaged over its replicas. With `gather_trace`, global rank
    0's trace holds every rank of its pipeline (one message per rank per step); elsewhere the
    trace holds this rank's own events.
    """

    def __init__(
        self,
        settings: PipelineSettings,
        *,
        gather_trace: bool = True,
        bucket_bytes: int | None = None,
        prefetch: int = 2,
        agreement: Agreement | None = None,
    ) -> None:
        stages = settings.ranks
        ctx = DistContext(stages, settings.data_parallel, timeout=settings.timeout,
                          agreement=agreement, tensor_parallel=settings.tp_degree)
        self.context: DistContext = ctx
        self.devices = [ctx.device] * stages
        super().__init__(settings)
        self.tp_plan: TPPlan | None = None  # what the tensor-parallel plan sharded
        self.sharding = Sharding(settings.shard, ctx)
        self.shard = self.sharding.shard
        self.layout = ctx.layout
        self.coordination = Coordination(
            leads=self.layout.rank == 0, agree=ctx.agreement.sync, device=ctx.device,
            keeps_whole_model=False, phase=ctx.agreement.phase,
        )
        self.transport = P2PTransport(ctx, prefetch=prefetch)
        self.bucket_bytes = bucket_bytes
        self._tags_match = dist.get_backend() == "gloo"
        self.ending = StepEnd(
            ctx, gathers_trace=gather_trace and self.layout.dp_rank == 0
            and self.layout.tp_rank == 0 and stages > 1,
        )
        self._mine: dict[int, StageModule] = {}
        self.ties: TieSync | None = None
        self.agreement = StepAgreement(ctx, self.transport)
        # Calls (shape key, step or forward, grad mode) run since the stages were last built:
        # they compile nothing new (see the module's "Compiling").
        self._warm: set[tuple[int, str, bool]] = set()
        # The optimizers whose state moves with the units when a new decision is adopted.
        self.optimizers = Optimizers(
            lambda: {id(p) for m in self._mine.values() for p in m.parameters()})
        self.last_move: MoveReport | None = None  # of the last adopted decision that moved

    measures_rank_speeds = True  # one process (one device) per pipeline rank

    @property
    def processes(self) -> Processes:
        return self.context

    @property
    def rank_devices(self) -> dict[int, torch.device]:
        return {self.layout.pp_rank: self.context.device}

    # -- set-up -----------------------------------------------------------------------------------

    @contextmanager
    def setting_up(self) -> Iterator[None]:
        """A setup phase; with compile=, bounded by the compile allowance (global rank 0 may
        profile compiled units while the others wait for its plan)."""
        agreement = self.context.agreement
        with agreement.phase("setup"), (
            agreement.allowing(self.compile_timeout) if self.compile is not None
            else nullcontext()
        ):
            yield

    def prepare_stage(self, module: StageModule) -> PreparedStage:
        self._warm.clear()  # stages built anew compile in their first steps again
        return super().prepare_stage(module)

    def load(self, planned: Decision, *, loss_fn: LossFn | None) -> None:
        schedule = planned.schedule
        if schedule.num_stages > MAX_STAGES or schedule.num_microbatches >= MAX_MICROBATCHES:
            raise ValueError(
                f"schedule {schedule.name!r} has {schedule.num_stages} stages and "
                f"{schedule.num_microbatches} microbatches; the distributed executor supports "
                f"at most {MAX_STAGES} stages and {MAX_MICROBATCHES - 1} microbatches"
            )
        if schedule.num_ranks != self.layout.stages:
            raise ValueError(
                f"schedule {schedule.name!r} has {schedule.num_ranks} ranks but the layout has "
                f"stages={self.layout.stages}; build the schedule for {self.layout.stages} ranks"
            )
        self._mine = {s: planned.modules[s] for s in schedule.stages_of(self.layout.pp_rank)}
        if self.layout.tensor_parallel > 1:  # the stages' graphs: the tensor-parallel pass
            self._check_tensor_parallel(schedule.splits_backward)
            with self.context.agreement.phase("the tensor-parallel plan"):
                self.tp_plan = parallelize(planned, self._mine, self.context.tp_mesh,
                                           self.layout.tensor_parallel, self.settings.tp_plan)
            loss_fn = parallel_loss(loss_fn, self.tp_plan.loss)  # loss parallelism
        elif isinstance(loss_fn, ParallelLoss):  # relaid out without tp
            loss_fn = loss_fn.loss_fn
        ties = find_ties(planned.model, planned.modules, schedule.placement)
        self.ties = TieSync(self.context, planned.model, ties)
        kept = {id(t) for m in self._mine.values() for t in (*m.parameters(), *m.buffers())}
        with torch.no_grad():
            for t in (*planned.model.parameters(), *planned.model.buffers()):
                # Another process's stage: free its memory (a meta tensor has none; it keeps
                # its shape for the modules' init, pipeline.execution.materialize).
                if id(t) not in kept and not t.is_meta:
                    t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        super().load(planned, loss_fn=loss_fn)

    def _check_tensor_parallel(self, splits: bool) -> None:
        """What tensor parallelism does not compose with yet: a ValueError naming it and the
        fix, before any parameter is sharded (each composition needs its own exact test)."""
        if self.compile is not None and splits:
            raise ValueError(
                f"tensor_parallel={self.layout.tensor_parallel} with compile= does not compose "
                "with a split-backward schedule yet: a tensor-parallel region is compiled by "
                "torch.compile with its forward and backward as one autograd node, whose "
                "compiled backward cannot run for B and again for W (AOTAutograd's donated "
                "buffers; docs/tensor-parallel.md); use a schedule without a split backward "
                "(e.g. '1f1b'), or drop compile="
            )

    def _relocate(self, old: Decision, new: Decision, rebuild: Callable[[], None],
                  carrying: Sequence[torch.optim.Optimizer]) -> None:
        """The units whose pipeline rank changes move with their gradients and optimizer
        state (the known optimizers' and `carrying`'s; under tensor parallelism each tp rank
        its shards), then the executor is rebuilt (pipeline.execution.distributed.adoption)."""
        for optimizer in carrying:
            self.optimizers.offer(optimizer)
        self.last_move = move_then_rebuild(self.context, self.sharding, self.optimizers, old, new,
                                        rebuild)
        self.transport.forget_shapes()  # the new stages send other tensors at their cuts
        self.agreement.forget_messages()

    def measure_units(self, decision: Decision) -> Captured:
        """As `Executor.measure_units`; not under shard="full" or tensor_parallel > 1, whose
        units hold shards."""
        if self.shard == "full" or self.layout.tensor_parallel > 1:
            how = ("shard='full'" if self.shard == "full"
                   else f"tensor_parallel={self.layout.tensor_parallel}")
            raise ValueError(
                f"under {how} each process holds shards of its units' weights, which "
                "cannot be timed unit by unit; build the Pipeline with balance='profile' or "
                "rebalance=True (global rank 0 profiles the units before the model is split)"
            )
        return super().measure_units(decision)

    def maximum(self, values: Tensor) -> Tensor:
        """The elementwise maximum of `values` over every process (float64, on the CPU)."""
        reduced = values.to(self.context.device, torch.float64)
        with self.context.guard("gathering of measured figures"):
            work = dist.all_reduce(reduced, op=dist.ReduceOp.MAX, async_op=True)
            self.context.wait_work(work, None, "the measured figures")
        return reduced.cpu()

    def reload(self) -> None:
        """Move the held stages to this process's device (meta stages, of a model built on
        the meta device, stay there until load_state_dict gives them weights), copy replica
        0's weights to the other replicas, and rebuild the runtime and gradient buckets."""
        if self.planned is None:
            return
        with self.context.agreement.phase("building of the executor"):
            prepared = {s: self.prepare_stage(m) for s, m in self._mine.items()}
            self.weights_checked = False
            self.grads = GradSync(
                self.context,
                {
                    s: list(prepared[s].averaged)
                    for s in finish_order(self._schedule, self.layout.pp_rank)
                },
                bucket_bytes=self.bucket_bytes,
                reduce_dtype=self.precision.reduce_dtype,
            )
            statistics = running_statistics(self.planned.model)
            self.buffer_sync = BufferSync(self.context, list(self._mine.values()), statistics)
            self.runtime = RankRuntime(
                self.layout.pp_rank,
                self._schedule,
                prepared,
                self.transport,
                device=self.context.device,
                loss_fn=self.loss_fn,
                precision=self.precision,
                on_stage_done=self.grads.start,
                statistics=statistics,
                saved=self.saved_bytes.get(self.layout.pp_rank),
            )
        self.context.agreement.sync("the start")  # every process is built: tensors may move
        self.context.mesh  # noqa: B018 - the process groups, made in this order everywhere
        sync_replicas(self.context, list(self._mine.values()))
        if self.ties is not None:
            self.ties.rebind(self.planned.model)
            self.ties.start()
        self.sharding.attach(self.planned.model, self._mine, self.ties)
        if self.compile is not None:
            self._allow_compiling_in_groups()

    def _allow_compiling_in_groups(self) -> None:
        """Raise the process groups' own timeouts to the compile allowance where lower: gloo
        bounds a collective's internal waits by its group's timeout and NCCL's watchdog
        aborts any operation older than it, whatever bound the explicit wait has. Outside a
        compiling step every wait stays bounded by `timeout` (Failures.wait_work)."""
        seconds = timedelta(seconds=max(self.compile_timeout, self.context.timeout))
        ties = [group for _, group, _ in self.ties.mine] if self.ties is not None else []
        default = dist.distributed_c10d._get_default_group()
        for group in (default, self.context.pp_group, self.context.dp_group, *ties):
            try:  # no public getter of a group's timeout (torch 2.14)
                current = group._get_backend(self.context.device).options._timeout
            except (AttributeError, RuntimeError):
                current = None
            if current is None or current < seconds:
                set_timeout = getattr(dist, "set_timeout", None)  # private in older torch
                if set_timeout is None:
                    set_timeout = dist.distributed_c10d._set_pg_timeout
                set_timeout(seconds, group)

    @contextmanager
    def _compiling(self, key: int, mode: str) -> Iterator[None]:
        """The rest of a step whose call (`key`, `mode`, grad mode) may compile on some
        process of the pipeline: its waits bounded by the compile allowance, then a barrier
        of the pipeline under it (see the module's "Compiling"); else nothing."""
        call = (key, mode, torch.is_grad_enabled())
        if self.compile is None or call in self._warm:
            yield
            return
        ctx = self.context
        with ctx.failures.allowing(self.compile_timeout):
            yield
            done = torch.zeros(1, device=ctx.device)
            work = dist.all_reduce(done, group=ctx.pp_group, async_op=True)
            ctx.wait_work(work, None, "the end of a step that compiled (every stage's)")
        self._warm.add(call)

    def _runtimes(self) -> list[RankRuntime]:
        runtime: RankRuntime | None = getattr(self, "runtime", None)  # set by reload
        return [runtime] if runtime is not None else []

    def held(self) -> dict[int, StageModule]:
        return dict(self._mine)

    @property
    def _counts_loss(self) -> bool:
        """Whether this last-stage process adds its loss to the step's sum: with replicas the
        loss is a sum over every process, so one rank of each tp group adds it (each holds a
        copy); without, each pipeline's own last rank hands it on."""
        return self.layout.data_parallel == 1 or self.layout.tp_rank == 0

    def accumulates_in_place(self) -> set[int]:
        """As `Executor`'s, less the parameters tied across pipeline ranks (their gradients
        are summed over the copies after the step, which must see only the step's own); none
        under shard="full" (FSDP2 reduce-scatters each step's gradients into its shards)."""
        if self.shard == "full":
            return set()
        tied = {id(p) for p, _, _ in self.ties.mine} if self.ties is not None else set()
        return super().accumulates_in_place() - tied

    def check_weights(self) -> None:
        """`Executor.check_weights` on every process at once: a process holding meta tensors
        raises naming them and tells the others, which raise naming it (a setup sync point,
        reached by every process at its first step after a (re)load: nothing waits for the
        timeout and no tensor has moved)."""
        if self.weights_checked or self.planned is None:
            return
        agreement = self.context.agreement
        with agreement.phase("the check for meta tensors"):
            names = meta_tensors(self.planned.model, self._mine.values())
            if names:
                raise ValueError(meta_message(names, self.layout.describe()))
        agreement.sync("the check for meta tensors")
        self.weights_checked = True
    def make_optimizer(
        self, params: Sequence[nn.Parameter], optimizer_class: type[torch.optim.Optimizer],
        **kwargs: Any,
    ) -> torch.optim.Optimizer:
        made = self.sharding.make_optimizer(params, optimizer_class, **kwargs)
        self.optimizers.offer(made)  # a re-balance carries its state
        return made

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self._mine

    @property
    def holds_last_stage(self) -> bool:
        return self.planned is not None and self.planned.schedule.num_stages - 1 in self._mine

    def describe(self) -> str:
        return f"{self.layout.describe()}"

    def named_parameters(
        self, model: nn.Module, prefix: str = "", recurse: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        if not self._mine:
            return model.named_parameters(prefix, recurse)
        own = {id(p) for m in self._mine.values() for p in m.parameters()}
        # The model's own names (a tied parameter once, under its first name).
        return ((prefix + k, p) for k, p in model.named_parameters() if id(p) in own)

    def clip_grad_norm_(
        self, model: nn.Module, max_norm: float, norm_type: float, error_if_nonfinite: bool
    ) -> Tensor:
        """The norm over the whole model, each gradient counted once: each pipeline rank's
        share (a tied parameter counted on the lowest rank holding it) combined over the
        pipeline's group, where the replicas hold equal gradients after the average (each gets
        the same norm); over every process where gradients are sharded (shard="full", tensor
        parallelism), each part counted by the first of the processes holding it
        (`_counts`)."""
        params = [p for _, p in self.named_parameters(model)]
        copies = self.ties.copies() if self.ties is not None else set()
        group = self.sharding.norm_group if self.layout.tensor_parallel == 1 else None
        grads = [p.grad for p in params if p.grad is not None and id(p) not in copies
                 and self._counts(p.grad, over_replicas=group is None)]
        share = get_total_norm([local(g) for g in grads], norm_type)
        share = share.to(self.context.device, torch.float64)
        inf = norm_type == float("inf")
        if not inf:
            share = share.pow(norm_type)
        with self.context.guard("gradient norm"):
            work = dist.all_reduce(share, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM,
                                   group=group, async_op=True)
            self.context.wait_work(work, None, "the gradient norm")
        total = share if inf else share.pow(1.0 / norm_type)
        if error_if_nonfinite and not bool(total.isfinite()):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is {float(total)}; "
                "pass error_if_nonfinite=False to clip anyway"
            )
        clip_grads_with_norm_(params, max_norm, total)
        return total

    def _counts(self, g: Tensor, *, over_replicas: bool) -> bool:
        """Whether this process adds its part of gradient `g` to a norm summed over every
        process (`over_replicas`) or over its pipeline: of the processes holding the same
        part, the first along each mesh dim `g` is replicated over does, and, when `g` is
        not sharded over the replicas but the sum runs over them, replica 0's."""
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            if any(p.is_replicate() and mesh.get_local_rank(i) != 0
                   for i, p in enumerate(g.placements)):
                return False
            if "dp" in (mesh.mesh_dim_names or ()):
                return True
        return not over_replicas or self.layout.dp_rank == 0

    def any_rank(self, flag: Tensor) -> Tensor:
        """The maximum of `flag` over every process (all stages, all replicas)."""
        flag = flag.to(self.context.device, torch.float32)
        with self.context.guard("agreement on inf/NaN gradients"):
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
            self.context.wait_work(work, None, "the inf/NaN gradient check")
        return flag

    def share_loss(self, loss: Tensor | None) -> Tensor:
        """The last stage's loss on every process, the mean over replicas: a sum over every
        process, the others adding 0."""
        total = torch.zeros((), dtype=torch.float64, device=self.context.device)
        if loss is not None and self.layout.tp_rank == 0:  # one tp rank's copy in the sum
            total += loss.to(self.context.device, torch.float64)
        with self.context.guard("sharing of the evaluation loss"):
            work = dist.all_reduce(total, async_op=True)
            self.context.wait_work(work, None, "the evaluation loss")
        return total / self.layout.data_parallel

    # -- running ----------------------------------------------------------------------------------

    def _run_step(
        self,
        inputs: Sequence[tuple[Tensor, ...]] | None,
        targets: Sequence[Any] | None,
        loss_weights: Sequence[float],
    ) -> StepResult:
        schedule = self._schedule
        ctx = self.context
        with ctx.guard("training step"):
            m, last = schedule.num_microbatches, self.holds_last_stage
            key, _ = self.agreement.agree_key(schedule, "train", m, inputs, targets)
            with self._compiling(key, "train"):
                self.transport.begin(key, self.agreement.messages(schedule, "train", m))
                try:
                    total = torch.zeros((), dtype=torch.float64, device=ctx.device)
                    ending, early = self.ending, self._tags_match  # gloo: post the receives now
                    pending = ending.receives(schedule, total, holds_last=last) if early else []
                    self.buffer_sync.begin()
                    self.sharding.gather(self.runtime.rebind)
                    with self.runtime.step_leaves():
                        result = self.runtime.run_step(inputs, targets, loss_weights)
                    if last and self._counts_loss:
                        losses = [v.to(torch.float64) for v in result.losses.values()]
                        total += torch.stack(losses).sum()
                    if not early:
                        pending += ending.receives(schedule, total, holds_last=last)
                    pending += ending.sends(total, result.events, holds_last=last)
                    self.transport.finish()
                except BaseException:
                    self.transport.abandon()
                    self.sharding.release()
                    raise
                self.sharding.reduce()
                self.grads.finish()
                if self.ties is not None:
                    self.ties.finish()
                self.buffer_sync.finish()
                timeline = ending.finish(schedule, pending, result.events)
        return StepResult(total / self.layout.data_parallel, timeline, result.input_grads)

    def _run_forward(self, inputs: Sequence[tuple[Tensor, ...]] | None) -> list[Any]:
        """Forward only; on the last stage's rank the output per microbatch, elsewhere []."""
        with self.context.guard("forward pass"):
            count = len(inputs) if inputs is not None else 0
            key, count = self.agreement.agree_key(self._schedule, "forward", count, inputs)
            with self._compiling(key, "forward"):
                self.transport.begin(key, self.agreement.messages(self._schedule, "forward", count))
                self.buffer_sync.begin()
                self.sharding.gather(self.runtime.rebind)
                try:
                    grad = self.sharding.forward_grad(torch.is_grad_enabled())
                    result = self.runtime.run_forward(inputs, count, grad=grad)
                    self.transport.finish()
                except BaseException:
                    self.transport.abandon()
                    raise
                finally:
                    self.sharding.release()
                self.buffer_sync.finish()
        if not self.holds_last_stage:
            return []
        return [result.outputs[m] for m in range(count)]
