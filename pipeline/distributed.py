"""The distributed executor: runs a Schedule with one process per pipeline rank over
torch.distributed (launched by torchrun), with data-parallel replicas of the whole pipeline on
top. It reuses `RankRuntime` (the one action interpreter) and only supplies a `Transport` over
`isend`/`irecv`, the data-parallel gradient averaging and the failure handling.

Rank layout. world_size = data_parallel x stages. Global rank r is pipeline rank
``r % stages`` of replica ``r // stages``: ranks ``[d*stages, ..., d*stages + stages - 1]`` form
replica d's pipeline, and ranks ``[p, stages + p, 2*stages + p, ...]`` hold stage(s) of pipeline
rank p and average their gradients. This is the DeviceMesh
``init_device_mesh(device, (data_parallel, stages), mesh_dim_names=("dp", "pp"))``. On one
8-process node with stages=4: ranks 0-3 and 4-7 are two pipelines; {0, 4}, {1, 5}, {2, 6},
{3, 7} are the gradient groups. Keep a pipeline inside one node (its traffic is per microbatch)
by giving each node a multiple of `stages` processes.

Timeout. Every wait (a receive, a send's completion, a gradient all-reduce, the loss
reduction) is bounded by ``timeout`` seconds: ``Pipeline(..., timeout=...)``, else the
environment variable ``HYBRIDPIPE_TIMEOUT``, else 120 s. A rank that raises records the error
in the c10d store and tears its process group down, so its peers' waits fail at once and every
other rank raises `RankFailure` naming it (and exits non-zero). A rank killed outright (SIGKILL,
lost node) is named by whichever peer first sees its connection close; a rank that hangs is
named by the peers whose waits on it time out. After a failure the process group is gone:
restart the job (``torchrun --max-restarts``) from the last checkpoint. The one-off object
collectives of setup and checkpoints (broadcast/gather of the plan and of state) are bounded
by the process group's timeout: ``dist.init_process_group(..., timeout=timedelta(...))``.

Launch. One node: ``torchrun --nproc-per-node 4 train.py``. Several nodes: run on every node
``torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500
--rdzv-id job1 train.py`` where HOST:29500 is reachable from all nodes (any one of them). The
script calls ``dist.init_process_group("gloo")`` (CPU) or ``("nccl")`` (one GPU per process,
cuda:LOCAL_RANK), then builds ``Pipeline(model, stages=...)`` exactly as in one process; the
same call in every process. Data follows the DDP convention: every process of a replica calls
``step`` with that replica's batch (processes holding neither the first nor the last stage may
pass None). Global rank 0 makes the plan (profiling, if asked) and the others follow it; as
with DDP, replicas start from replica 0's weights.

Shapes. Tensor shapes and dtypes crossing ranks come from running the plan: at the first step
(and whenever the batch's shapes change) each message is preceded by a small metadata message,
cached under a key of the batch's shapes. Every step the first stage's rank sends that key (two
integers) to the other ranks of its pipeline, so a new batch shape re-agrees instead of hanging.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipeline.runtime import LossFn, RankRuntime, StepResult, forward_actions
from scheduler import Event, Op, Schedule, Send, Timeline, lower

ENV_TIMEOUT = "HYBRIDPIPE_TIMEOUT"
DEFAULT_TIMEOUT = 120.0
_FAILED_COUNT = "hybridpipe/failed/count"
_FAILED_TEXT = "hybridpipe/failed/text"
_META_LEN = 256  # int64 slots in a metadata message
_MAX_TENSORS = 64  # tensors per message (tag arithmetic)
_MAX_STAGES = 64
_MAX_MICROBATCHES = 1 << 16
BUCKET_BYTES = 25 * 2**20  # gradient all-reduce bucket cap (as DDP's 25 MB)
_DTYPES = (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)


def resolve_timeout(timeout: float | None) -> float:
    """`timeout` if given, else $HYBRIDPIPE_TIMEOUT, else 120 s; ValueError unless > 0."""
    source = "timeout"
    if timeout is None:
        text = os.environ.get(ENV_TIMEOUT)
        if text is None:
            return DEFAULT_TIMEOUT
        source = f"${ENV_TIMEOUT}"
        try:
            timeout = float(text)
        except ValueError:
            raise ValueError(f"{source}={text!r} is not a number; give seconds, e.g. 120") from None
    if not timeout > 0 or math.isinf(timeout):
        raise ValueError(f"{source} must be a finite number of seconds > 0, got {timeout}")
    return float(timeout)


# ---------------------------------------------------------------------------------------------
# Layout and process groups
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Where this process sits in world = data_parallel x stages (see the module docstring)."""

    world_size: int
    rank: int
    stages: int
    data_parallel: int

    @property
    def pp_rank(self) -> int:
        """This process's pipeline rank (which stages it holds)."""
        return self.rank % self.stages

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel replica (which pipeline it belongs to)."""
        return self.rank // self.stages

    def global_rank(self, pp_rank: int, dp_rank: int | None = None) -> int:
        """The global rank of pipeline rank `pp_rank` in replica `dp_rank` (default: ours)."""
        return (self.dp_rank if dp_rank is None else dp_rank) * self.stages + pp_rank

    def pipeline_ranks(self, dp_rank: int | None = None) -> list[int]:
        """Global ranks of one replica's pipeline, in pipeline-rank order."""
        return [self.global_rank(p, dp_rank) for p in range(self.stages)]

    def replica_ranks(self, pp_rank: int | None = None) -> list[int]:
        """Global ranks holding the same stages (one per replica): a gradient group."""
        p = self.pp_rank if pp_rank is None else pp_rank
        return [d * self.stages + p for d in range(self.data_parallel)]

    def describe(self, rank: int | None = None) -> str:
        """E.g. 'rank 5 (pipeline rank 1 of replica 1)'."""
        r = self.rank if rank is None else rank
        return f"rank {r} (pipeline rank {r % self.stages} of replica {r // self.stages})"


def make_layout(
    stages: int, data_parallel: int | None = None, *, world_size: int, rank: int
) -> Layout:
    """Check stages x data_parallel == world_size (data_parallel defaults to world // stages)."""
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be an int >= 1, got {stages!r}")
    if data_parallel is None:
        if world_size % stages != 0:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(
                f"world size {world_size} is not divisible by stages={stages}: every replica "
                f"needs {stages} processes; use stages in {divisors} or launch a multiple of "
                f"{stages} processes (torchrun --nproc-per-node)"
            )
        data_parallel = world_size // stages
    if not isinstance(data_parallel, int) or data_parallel < 1:
        raise ValueError(f"data_parallel must be an int >= 1, got {data_parallel!r}")
    if stages * data_parallel != world_size:
        raise ValueError(
            f"stages={stages} x data_parallel={data_parallel} = {stages * data_parallel} "
            f"processes, but the world has {world_size}; launch {stages * data_parallel} "
            "processes, or drop data_parallel (it defaults to world size // stages)"
        )
    return Layout(world_size, rank, stages, data_parallel)


class RankFailure(RuntimeError):
    """Another rank failed (raised, was killed, or stopped answering); names it."""


class _CommError(RuntimeError):
    """A wait on another rank failed (connection closed, timed out)."""

    def __init__(self, message: str, peer: int | None) -> None:
        super().__init__(message)
        self.peer = peer


class DistContext:
    """The process groups of one Layout: a DeviceMesh (dp, pp), this rank's gradient group,
    the c10d store (failure reports) and the timeout. Initialises the default process group
    from the torchrun environment when it is not initialised yet."""

    def __init__(
        self,
        stages: int,
        data_parallel: int | None = None,
        *,
        timeout: float | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.timeout = resolve_timeout(timeout)
        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, timeout=timedelta(seconds=self.timeout))
        self.layout = make_layout(
            stages, data_parallel, world_size=dist.get_world_size(), rank=dist.get_rank()
        )
        if device is None:
            if dist.get_backend() == "nccl":
                device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            else:
                device = torch.device("cpu")
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL and object collectives use the current one
        self.mesh: DeviceMesh = init_device_mesh(
            self.device.type,
            (self.layout.data_parallel, self.layout.stages),
            mesh_dim_names=("dp", "pp"),
        )
        self.dp_group = self.mesh.get_group("dp")
        self.pp_group = self.mesh.get_group("pp")
        self.store = dist.distributed_c10d._get_default_store()
        self.broken: str | None = None

    @property
    def wait(self) -> timedelta:
        return timedelta(seconds=self.timeout)

    # -- failure reports ------------------------------------------------------------------------

    def report(self, text: str) -> None:
        """Record the first failure of the job in the store (later reports are dropped)."""
        try:
            if self.store.add(_FAILED_COUNT, 1) == 1:
                self.store.set(_FAILED_TEXT, text)
        except RuntimeError:
            pass  # the store went down with the failed rank: peers fall back to their own view

    def cause(self) -> str | None:
        """The failure recorded in the store, if any (never blocks)."""
        try:
            if self.store.check([_FAILED_TEXT]):
                return self.store.get(_FAILED_TEXT).decode()
        except RuntimeError:
            return None
        return None

    def _await_cause(self, seconds: float) -> str | None:
        try:
            self.store.wait([_FAILED_TEXT], timedelta(seconds=seconds))
        except RuntimeError:  # DistStoreError (timeout, store gone) derives from RuntimeError
            return None
        return self.cause()

    def tear_down(self) -> None:
        """Destroy the process groups so peers blocked on this rank fail at once."""
        if dist.is_initialized():
            dist.destroy_process_group()

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Run a collective piece of work; on failure record/explain it, tear the groups down
        and raise (the original error for a local fault, RankFailure for a peer's)."""
        if self.broken is not None:
            raise RankFailure(
                f"{self.layout.describe()} cannot run a {what}: the process groups were torn "
                f"down after an earlier failure ({self.broken}); restart the job from a checkpoint"
            )
        try:
            yield
        except RankFailure:
            raise  # already explained by an inner guard
        except BaseException as err:
            cause = self.cause()
            if cause is None and isinstance(err, _CommError):
                if err.peer is None:
                    # A collective does not say which member is gone; a point-to-point peer
                    # of the failed rank usually does, moments later.
                    cause = self._await_cause(min(self.timeout, 3.0))
                if cause is None:
                    peer = "a peer" if err.peer is None else self.layout.describe(err.peer)
                    cause = f"{peer} stopped responding (killed, crashed or hung): {err}"
                    self.report(cause)
            if cause is not None:  # another rank failed first; this error follows from it
                self.broken = cause
                self.tear_down()
                raise RankFailure(
                    f"{self.layout.describe()} stopped its {what} because {cause}"
                ) from err
            text = f"{self.layout.describe()} raised {type(err).__name__}: {err}"
            self.report(text)
            self.broken = text
            self.tear_down()
            err.add_note(f"hybridpipe: {text}; the other ranks are told and stop")
            raise

    def wait_work(self, work: Any, peer: int | None, what: str) -> None:
        """Wait for a torch.distributed Work under the timeout, as a _CommError on failure."""
        try:
            work.wait(timeout=self.wait)
        except RuntimeError as err:
            source = "the other ranks" if peer is None else self.layout.describe(peer)
            raise _CommError(
                f"{self.layout.describe()} waiting for {what} from {source} failed "
                f"(timeout {self.timeout:g} s; set Pipeline(timeout=...) or ${ENV_TIMEOUT}): "
                f"{str(err).splitlines()[0]}",
                peer,
            ) from err


def agree(obj: Any) -> Any:
    """Global rank 0's `obj` on every rank (e.g. a Plan made from profiling, so that every
    process splits the model the same way). Bounded by the process group's own timeout."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---------------------------------------------------------------------------------------------
# Transport over isend / irecv
# ---------------------------------------------------------------------------------------------

MessageId = tuple[Op, int, int]  # (op, producing stage, microbatch), as in scheduler.lowering


@dataclass
class _CommPlan:
    """For one action list per rank: per peer, the messages it sends us in its send order."""

    incoming: dict[int, list[MessageId]]

    @classmethod
    def of(cls, schedule: Schedule, me: int) -> _CommPlan:
        incoming: dict[int, list[MessageId]] = {}
        for peer, program in enumerate(lower(schedule)):
            for ins in program:
                if isinstance(ins, Send) and ins.peer == me:
                    incoming.setdefault(peer, []).append((ins.op, ins.stage, ins.microbatch))
        return cls(incoming)


def _tag(kind: int, stage: int, microbatch: int, index: int) -> int:
    """A distinct int32 tag per (kind, stage, microbatch, tensor index); kind 0: activations,
    1: input grads, 2: batch-shape key, 3: trace (index 0) and loss (index 1). Index
    _MAX_TENSORS is a message's metadata."""
    return ((kind * _MAX_STAGES + stage) * _MAX_MICROBATCHES + microbatch) * (
        _MAX_TENSORS + 1
    ) + index


_SIG_TAG = _tag(2, 0, 0, 0)
_TRACE_TAG = _tag(3, 0, 0, 0)
_LOSS_TAG = _tag(3, 0, 0, 1)


def _encode_meta(tensors: Sequence[Tensor]) -> Tensor:
    values = [len(tensors)]
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"cannot send a {t.dtype} tensor between stages; use one of {_DTYPES}")
        values += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    if len(values) > _META_LEN or len(tensors) > _MAX_TENSORS:
        raise ValueError(
            f"{len(tensors)} tensors of {sum(t.dim() for t in tensors)} dims in all cross one "
            f"stage boundary; at most {_MAX_TENSORS} tensors and {_META_LEN} metadata slots "
            "fit: cut the model where fewer values cross"
        )
    return torch.tensor(values + [0] * (_META_LEN - len(values)), dtype=torch.int64)


def _pack(tensors: Sequence[Tensor]) -> dict[torch.dtype, Tensor]:
    """One flat buffer per dtype (in order of first appearance): one message per dtype
    instead of one per tensor, since each gloo message costs a round of syscalls."""
    groups: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t.detach().reshape(-1))
    return {dtype: ts[0].contiguous() if len(ts) == 1 else torch.cat(ts)
            for dtype, ts in groups.items()}


def _packed_sizes(layout: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> dict[torch.dtype, int]:
    sizes: dict[torch.dtype, int] = {}
    for dtype, shape in layout:
        sizes[dtype] = sizes.get(dtype, 0) + math.prod(shape)
    return sizes


def _unpack(
    flats: Mapping[torch.dtype, Tensor], layout: Sequence[tuple[torch.dtype, tuple[int, ...]]]
) -> list[Tensor]:
    """Views of the flat buffers with the message's shapes, in the message's order."""
    offsets = dict.fromkeys(flats, 0)
    out = []
    for dtype, shape in layout:
        n = math.prod(shape)
        out.append(flats[dtype][offsets[dtype] : offsets[dtype] + n].view(shape))
        offsets[dtype] += n
    return out


def _decode_meta(meta: Tensor) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    values = meta.tolist()
    out, i = [], 1
    for _ in range(values[0]):
        dtype, ndim = _DTYPES[values[i]], values[i + 1]
        out.append((dtype, tuple(values[i + 2 : i + 2 + ndim])))
        i += 2 + ndim
    return out


class P2PTransport:
    """`Transport` over torch.distributed point-to-point. One per process.

    Receives are posted ahead (`prefetch` per peer) in the order the peer sends, so transfers
    overlap compute (and NCCL's in-order matching holds). Sends are isends whose completion is
    awaited at the end of the step. Each (op, stage, microbatch, tensor) has its own tag.
    """

    def __init__(
        self, ctx: DistContext, schedule: Schedule, *, prefetch: int = 2
    ) -> None:
        self.ctx = ctx
        self.schedule = schedule
        self.prefetch = prefetch
        self.me = ctx.layout.pp_rank
        self._metas: dict[int, dict[MessageId, list[tuple[torch.dtype, tuple[int, ...]]]]] = {}
        self._key = 0
        self._new = False
        self._queue: dict[int, deque[MessageId]] = {}
        self._posted: dict[MessageId, tuple[int, list[Any], list[Tensor]]] = {}
        self._sends: list[tuple[Any, int, str, Tensor]] = []

    def _peer(self, pp_rank: int) -> int:
        return self.ctx.layout.global_rank(pp_rank)

    def _tag(self, msg: MessageId, index: int) -> int:
        op, stage, mb = msg
        return _tag(0 if op is Op.F else 1, stage, mb, index)

    def begin(self, key: int, plan: _CommPlan) -> None:
        """Start a step whose batch-shape key is `key` (same on every rank of the pipeline)."""
        self._key = key
        self._new = key not in self._metas
        if self._new:
            self._metas[key] = {}
        self._queue = {peer: deque(msgs) for peer, msgs in plan.incoming.items()}
        if not self._new:
            for peer in self._queue:
                for _ in range(self.prefetch):
                    self._post_next(peer)

    def _post_next(self, peer: int) -> MessageId | None:
        queue = self._queue.get(peer)
        if not queue:
            return None
        msg = queue.popleft()
        src = self._peer(peer)
        metas = self._metas[self._key]
        if msg not in metas:  # first time for this batch shape: metadata comes first
            meta = torch.empty(_META_LEN, dtype=torch.int64, device=self.ctx.device)
            work = dist.irecv(meta, src=src, tag=self._tag(msg, _MAX_TENSORS))
            self.ctx.wait_work(work, src, f"the shapes of {_describe(msg)}")
            metas[msg] = _decode_meta(meta)
        layout = metas[msg]
        flats = {
            dtype: torch.empty(n, dtype=dtype, device=self.ctx.device)
            for dtype, n in _packed_sizes(layout).items()
        }
        works = [
            dist.irecv(flat, src=src, tag=self._tag(msg, i))
            for i, flat in enumerate(flats.values())
        ]
        self._posted[msg] = (src, works, _unpack(flats, layout))
        return msg

    def recv(self, op: Op, stage: int, microbatch: int) -> tuple[Tensor, ...]:
        producer = stage - 1 if op is Op.F else stage + 1
        msg: MessageId = (op, producer, microbatch)
        peer = self.schedule.placement[producer]
        while msg not in self._posted:
            if self._post_next(peer) is None:
                raise RuntimeError(
                    f"pipeline rank {self.me} expects no {_describe(msg)} from pipeline rank "
                    f"{peer} in schedule {self.schedule.name!r}"
                )
        src, works, buffers = self._posted.pop(msg)
        for work in works:
            self.ctx.wait_work(work, src, _describe(msg))
        if not self._new:
            self._post_next(peer)
        return tuple(buffers)

    def send(self, op: Op, stage: int, microbatch: int, tensors: tuple[Tensor, ...]) -> None:
        msg: MessageId = (op, stage, microbatch)
        consumer = stage + 1 if op is Op.F else stage - 1
        dst = self._peer(self.schedule.placement[consumer])
        metas = self._metas[self._key]
        if msg not in metas:
            meta = _encode_meta(tensors).to(self.ctx.device)
            metas[msg] = _decode_meta(meta)
            work = dist.isend(meta, dst=dst, tag=self._tag(msg, _MAX_TENSORS))
            self._sends.append((work, dst, f"the shapes of {_describe(msg)}", meta))
        elif metas[msg] != [(t.dtype, tuple(t.shape)) for t in tensors]:
            raise ValueError(
                f"{_describe(msg)} has shapes {[tuple(t.shape) for t in tensors]} but had "
                f"{[shape for _, shape in metas[msg]]} for the same batch shapes: the "
                "distributed executor needs shapes that depend only on the input shapes "
                "(cut the model before data-dependent shapes, or pad them)"
            )
        for i, flat in enumerate(_pack(tensors).values()):
            work = dist.isend(flat, dst=dst, tag=self._tag(msg, i))
            self._sends.append((work, dst, _describe(msg), flat))
        self._reap()

    def track(self, work: Any, dst: int, tensor: Tensor) -> None:
        """Await `work` (an isend of `tensor` to global rank `dst`) with the step's sends."""
        self._sends.append((work, dst, "the batch-shape key", tensor))

    def _reap(self) -> None:
        """Drop completed sends (and the tensors they kept alive)."""
        if len(self._sends) > 32:
            self._sends = [s for s in self._sends if not s[0].is_completed()]

    def finish(self) -> None:
        """Wait for every send of the step; check no receive is left over."""
        for work, dst, what, _ in self._sends:
            self.ctx.wait_work(work, dst, f"the delivery of {what}")
        self._sends.clear()
        left = sorted(self._posted) + sorted(m for q in self._queue.values() for m in q)
        self._posted.clear()
        self._queue.clear()
        if left:
            raise RuntimeError(
                f"pipeline rank {self.me} ended the step with receives left over: {left}"
            )


def _describe(msg: MessageId) -> str:
    op, stage, mb = msg
    what = "activations" if op is Op.F else "input gradients"
    return f"{what} of stage {stage} microbatch {mb} ({op.value})"


# ---------------------------------------------------------------------------------------------
# Data-parallel gradient averaging
# ---------------------------------------------------------------------------------------------


class GradSync:
    """Averages each stage's gradients over its replicas: per stage, buckets of at most
    `bucket_bytes` (one dtype each) are flattened and all-reduced asynchronously when `start`
    is called (RankRuntime's on_stage_done), and copied back in `finish` at the end of step."""

    def __init__(
        self,
        ctx: DistContext,
        stage_params: Mapping[int, Sequence[nn.Parameter]],
        bucket_bytes: int | None = None,
    ) -> None:
        cap = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        self.ctx = ctx
        self.size = ctx.layout.data_parallel
        self.buckets: dict[int, list[list[nn.Parameter]]] = {}
        for stage, params in stage_params.items():
            buckets: list[list[nn.Parameter]] = []
            current: dict[torch.dtype, tuple[list[nn.Parameter], int]] = {}
            for p in reversed([p for p in params if p.requires_grad]):
                group, used = current.get(p.dtype, ([], 0))
                if group and used + p.numel() * p.element_size() > cap:
                    buckets.append(group)
                    group, used = [], 0
                group.append(p)
                current[p.dtype] = (group, used + p.numel() * p.element_size())
            buckets.extend(g for g, _ in current.values() if g)
            self.buckets[stage] = buckets
        self._pending: list[tuple[Any, Tensor, list[nn.Parameter]]] = []

    @property
    def _peer(self) -> int | None:
        """The one other member of a two-replica group (to name it if it fails)."""
        others = [r for r in self.ctx.layout.replica_ranks() if r != self.ctx.layout.rank]
        return others[0] if len(others) == 1 else None

    def start(self, stage: int) -> None:
        if self.size == 1:
            return
        for params in self.buckets.get(stage, []):
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            work = dist.all_reduce(flat, group=self.ctx.dp_group, async_op=True)
            self._pending.append((work, flat, params))

    def finish(self) -> None:
        try:
            for work, flat, params in self._pending:
                self.ctx.wait_work(work, self._peer, "the gradient all-reduce")
                flat.div_(self.size)
                offset = 0
                for p in params:
                    n = p.numel()
                    value = flat[offset : offset + n].view_as(p)
                    if p.grad is None:
                        p.grad = value.clone()
                    else:
                        p.grad.copy_(value)
                    offset += n
        finally:
            self._pending.clear()


def sync_replicas(ctx: DistContext, modules: Sequence[nn.Module]) -> None:
    """Copy replica 0's parameters and buffers of these stages to the other replicas (as DDP
    does at construction), so replicas start equal even when processes seeded differently.
    Meta tensors (weights still to be loaded) are skipped."""
    if ctx.layout.data_parallel == 1:
        return
    src = ctx.layout.global_rank(ctx.layout.pp_rank, 0)
    tensors = [t for m in modules for t in (*m.parameters(), *m.buffers()) if not t.is_meta]
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with ctx.guard("replica sync"), torch.no_grad():
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            work = dist.broadcast(flat, src=src, group=ctx.dp_group, async_op=True)
            ctx.wait_work(work, None if ctx.layout.rank == src else src, "replica 0's weights")
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


# ---------------------------------------------------------------------------------------------
# The executor
# ---------------------------------------------------------------------------------------------


@dataclass
class _Pending:
    """A started end-of-step transfer: its Work, the peer (None for a collective), what it
    carries (for error messages) and the receive buffer, if any."""

    work: Any
    peer: int | None
    what: str
    buffer: Tensor | None = None


def _shape_key(mode: str, count: int, inputs: Sequence[tuple[Tensor, ...]]) -> int:
    desc = [mode, count] + [
        (tuple(t.shape), str(t.dtype)) for mb in inputs for t in mb if isinstance(t, Tensor)
    ]
    digest = hashlib.blake2b(repr(desc).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class DistributedExecutor:
    """Runs this process's pipeline rank of a Schedule (the `Executor` protocol of
    pipeline.runtime). `stage_modules` maps each stage placed on this pipeline rank to its
    module (already on `ctx.device`).

    On construction the stages' weights are copied from replica 0 to the other replicas.
    `run_step` returns the global mean loss (the mean over replicas of each replica's loss) on
    every rank; grads on this process's parameters are averaged over its replicas. With
    `gather_trace`, global rank 0's trace holds every rank of its pipeline (one message per rank
    per step); elsewhere the trace holds this rank's own events.
    """

    def __init__(
        self,
        schedule: Schedule,
        stage_modules: Mapping[int, nn.Module],
        ctx: DistContext,
        *,
        loss_fn: LossFn | None = None,
        checkpoint_activations: bool = False,
        gather_trace: bool = True,
        bucket_bytes: int | None = None,
        prefetch: int = 2,
    ) -> None:
        if schedule.num_stages > _MAX_STAGES or schedule.num_microbatches >= _MAX_MICROBATCHES:
            raise ValueError(
                f"schedule {schedule.name!r} has {schedule.num_stages} stages and "
                f"{schedule.num_microbatches} microbatches; the distributed executor supports "
                f"at most {_MAX_STAGES} stages and {_MAX_MICROBATCHES - 1} microbatches"
            )
        if schedule.num_ranks != ctx.layout.stages:
            raise ValueError(
                f"schedule {schedule.name!r} has {schedule.num_ranks} ranks but the layout has "
                f"stages={ctx.layout.stages}; build the schedule for {ctx.layout.stages} ranks"
            )
        self.schedule = schedule
        self.ctx = ctx
        self.layout = ctx.layout
        self.transport = P2PTransport(ctx, schedule, prefetch=prefetch)
        self.grads = GradSync(
            ctx,
            {s: list(m.parameters()) for s, m in stage_modules.items()},
            bucket_bytes=bucket_bytes,
        )
        self.runtime = RankRuntime(
            self.layout.pp_rank,
            schedule,
            stage_modules,
            self.transport,
            device=ctx.device,
            loss_fn=loss_fn,
            checkpoint_activations=checkpoint_activations,
            on_stage_done=self.grads.start,
        )
        self._plans: dict[tuple[str, int], _CommPlan] = {}
        sync_replicas(ctx, list(stage_modules.values()))
        self._tags_match = dist.get_backend() == "gloo"
        self._gathers_trace = gather_trace and self.layout.dp_rank == 0 and self.layout.stages > 1
        self.holds_first = 0 in stage_modules
        self.holds_last = schedule.num_stages - 1 in stage_modules

    # -- per-step agreement ----------------------------------------------------------------------

    def _plan(self, mode: str, count: int) -> tuple[_CommPlan, Schedule]:
        if mode == "train":
            schedule = self.schedule
        else:
            s = self.schedule
            schedule = Schedule(
                s.num_ranks, s.num_stages, count, s.placement,
                tuple(tuple(forward_actions(s, r, count)) for r in range(s.num_ranks)),
                splits_backward=False, name=f"{s.name} (forward)",
            )
        if (mode, count) not in self._plans:
            self._plans[(mode, count)] = _CommPlan.of(schedule, self.layout.pp_rank)
        return self._plans[(mode, count)], schedule

    def _agree_key(
        self, mode: str, count: int, inputs: Sequence[tuple[Tensor, ...]] | None
    ) -> tuple[int, int]:
        """The first stage's rank tells its pipeline the batch-shape key and microbatch count."""
        first = self.layout.global_rank(self.schedule.placement[0])
        if self.layout.rank == first:
            if inputs is None:
                raise ValueError(
                    f"{self.layout.describe()} runs stage 0 and needs the batch; pass this "
                    "replica's inputs to step()/forward on this process"
                )
            sig = torch.tensor(
                [_shape_key(mode, count, inputs), count], dtype=torch.int64, device=self.ctx.device
            )
            for r in self.layout.pipeline_ranks():
                if r != first:  # completion is awaited with the step's other sends
                    self.transport.track(dist.isend(sig, dst=r, tag=_SIG_TAG), r, sig)
            return int(sig[0]), count
        sig = torch.empty(2, dtype=torch.int64, device=self.ctx.device)
        self.ctx.wait_work(dist.irecv(sig, src=first, tag=_SIG_TAG), first, "the batch-shape key")
        return int(sig[0]), int(sig[1])

    # -- Executor protocol ----------------------------------------------------------------------

    def run_step(
        self,
        inputs: Sequence[tuple[Tensor, ...]] | None,
        targets: Sequence[Any] | None,
        loss_weights: Sequence[float],
    ) -> StepResult:
        schedule = self.schedule
        with self.ctx.guard("training step"):
            key, _ = self._agree_key("train", schedule.num_microbatches, inputs)
            plan, _ = self._plan("train", schedule.num_microbatches)
            self.transport.begin(key, plan)
            total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
            pending = self._end_receives(total) if self._tags_match else []
            result = self.runtime.run_step(inputs, targets, loss_weights)
            if self.holds_last:
                total += torch.stack([v.to(torch.float64) for v in result.losses.values()]).sum()
            if not self._tags_match:
                pending += self._end_receives(total)
            pending += self._end_sends(total, result.events)
            self.transport.finish()
            self.grads.finish()
            timeline = self._finish(pending, result.events)
        return StepResult(total / self.layout.data_parallel, timeline)

    # -- the end of a step: the loss on every rank, the trace on global rank 0 ---------------------

    def _end_receives(self, total: Tensor) -> list[_Pending]:
        """The step's last messages for this rank: with data parallelism every rank but the
        last stage's joins the loss all-reduce (adding 0); otherwise those ranks receive the
        loss from the last stage's rank. Global rank 0 receives its pipeline's traces (one
        row per action). With gloo (tags match messages) these are posted when the step
        starts, so they are complete when waited on; in-order backends post them at the end."""
        pending: list[_Pending] = []
        if not self.holds_last:
            if self.layout.data_parallel > 1:
                pending.append(_Pending(dist.all_reduce(total, async_op=True), None, "the loss"))
            else:
                last = self.layout.global_rank(self.schedule.placement[-1])
                work = dist.irecv(total, src=last, tag=_LOSS_TAG)
                pending.append(_Pending(work, last, "the loss"))
        if self._gathers_trace and self.layout.rank == 0:
            for peer in range(1, self.layout.stages):
                n = len(self.schedule.actions[peer])
                buf = torch.empty(n * 5, dtype=torch.float64, device=self.ctx.device)
                work = dist.irecv(buf, src=peer, tag=_TRACE_TAG)
                pending.append(_Pending(work, peer, "the trace", buf))
        return pending

    def _end_sends(self, total: Tensor, events: Sequence[Event]) -> list[_Pending]:
        """The last stage's rank shares the loss; replica 0's other ranks send their trace."""
        pending: list[_Pending] = []
        if self.holds_last:
            if self.layout.data_parallel > 1:
                pending.append(_Pending(dist.all_reduce(total, async_op=True), None, "the loss"))
            else:
                last = self.layout.rank
                for r in self.layout.pipeline_ranks():
                    if r != last:
                        work = dist.isend(total, dst=r, tag=_LOSS_TAG)
                        pending.append(_Pending(work, r, "the delivery of the loss"))
        if self._gathers_trace and self.layout.rank != 0:
            rows = [[e.stage, "FBW".index(e.op.value), e.microbatch, e.start, e.end]
                    for e in events]
            packed = torch.tensor(rows, dtype=torch.float64, device=self.ctx.device).reshape(-1)
            work = dist.isend(packed, dst=0, tag=_TRACE_TAG)
            pending.append(_Pending(work, 0, "the delivery of the trace", packed))
        return pending

    def _finish(self, pending: Sequence[_Pending], events: Sequence[Event]) -> Timeline:
        every = list(events)
        for item in pending:
            self.ctx.wait_work(item.work, item.peer, item.what)
            if item.what == "the trace" and item.buffer is not None and item.peer is not None:
                for stage, op, mb, start, end in item.buffer.reshape(-1, 5).tolist():
                    every.append(
                        Event(item.peer, int(stage), Op("FBW"[int(op)]), int(mb), start, end)
                    )
        every.sort(key=lambda e: e.start)
        return Timeline(tuple(every), self.layout.stages, self.schedule.splits_backward,
                        name=self.schedule.name)

    def forward(self, inputs: Sequence[tuple[Tensor, ...]] | None) -> list[Any]:
        """Forward only; on the last stage's rank the output per microbatch, elsewhere []."""
        with self.ctx.guard("forward pass"):
            count = len(inputs) if inputs is not None else 0
            key, count = self._agree_key("forward", count, inputs)
            plan, _ = self._plan("forward", count)
            self.transport.begin(key, plan)
            result = self.runtime.run_forward(inputs, count, grad=torch.is_grad_enabled())
            self.transport.finish()
        if not self.holds_last:
            return []
        return [result.outputs[m] for m in range(count)]

    def close(self) -> None:
        """Nothing to release: every step waits for its own communication, and the process
        groups belong to the job (destroy_process_group ends them)."""


__all__ = [
    "DEFAULT_TIMEOUT",
    "ENV_TIMEOUT",
    "DistContext",
    "DistributedExecutor",
    "GradSync",
    "Layout",
    "P2PTransport",
    "RankFailure",
    "agree",
    "make_layout",
    "resolve_timeout",
]
