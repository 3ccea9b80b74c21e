"""Point-to-point messages between the pipeline ranks of one replica: the wire format (a
metadata message describing the tensors the first time a message of a batch shape is sent,
then one flat buffer per dtype) and `P2PTransport`, the runtime's `Transport` over
torch.distributed ``isend``/``irecv``, with receives posted ahead in each sender's order.

Messages travel in the pipeline's own process group (the mesh's "pp" group, whose group
ranks are the pipeline ranks), through `ProcessGroup.send`/`recv` directly: `dist.isend`'s
argument checks and rank translation cost ~10 us a call and are already settled here. Tags:
every (kind, stage, microbatch, tensor index) has its own int32 tag (`tag`), so gloo matches
messages by tag; NCCL matches in posting order, which the sender-ordered posting keeps.

Under tensor parallelism (tp > 1) a boundary tensor is whole and the same on every tp rank of
a stage (a tensor-parallel stage makes its outputs and its input gradients whole), and tp rank
t of a stage sends to tp rank t of the next: each sends only its 1/tp part of each flat buffer
(`TPSlices`), and the receiving tp ranks all-gather the parts within their tp group (inside a
node) to rebuild it, as Megatron-LM's scatter/gather at a pipeline boundary. A buffer whose
element count tp does not divide travels whole from every tp rank, as with tp = 1."""

from __future__ import annotations

import math
import queue
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pipeline.execution.distributed.context import DistContext
from pipeline.execution.distributed.failure import CommError
from scheduler import MessageKey, Op, Recv, Send, describe_message

META_LEN = 256  # int64 slots in a metadata message
MAX_TENSORS = 64  # tensors per message (tag arithmetic)
MAX_STAGES = 64
MAX_MICROBATCHES = 1 << 16
_DTYPES = (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)

TensorLayout = list[tuple[torch.dtype, tuple[int, ...]]]


def tag(kind: int, stage: int, microbatch: int, index: int) -> int:
    """A distinct int32 tag per (kind, stage, microbatch, tensor index); kind 0: activations,
    1: input grads, 2: batch-shape key, 3: trace (index 0) and loss (index 1). Index
    MAX_TENSORS is a message's metadata."""
    return ((kind * MAX_STAGES + stage) * MAX_MICROBATCHES + microbatch) * (
        MAX_TENSORS + 1
    ) + index


SIG_TAG = tag(2, 0, 0, 0)
TRACE_TAG = tag(3, 0, 0, 0)
LOSS_TAG = tag(3, 0, 0, 1)


def _message_tag(key: MessageKey, index: int) -> int:
    op, stage, mb = key
    return tag(0 if op is Op.F else 1, stage, mb, index)


def encode_meta(tensors: Sequence[Tensor]) -> Tensor:
    """The metadata message of `tensors`: count, then (dtype index, ndim, *shape) each."""
    values = [len(tensors)]
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"cannot send a {t.dtype} tensor between stages; use one of {_DTYPES}")
        values += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    if len(values) > META_LEN or len(tensors) > MAX_TENSORS:
        raise ValueError(
            f"{len(tensors)} tensors of {sum(t.dim() for t in tensors)} dims in all cross one "
            f"stage boundary; at most {MAX_TENSORS} tensors and {META_LEN} metadata slots "
            "fit: cut the model where fewer values cross"
        )
    return torch.tensor(values + [0] * (META_LEN - len(values)), dtype=torch.int64)


def decode_meta(meta: Tensor) -> TensorLayout:
    values = meta.tolist()
    out, i = [], 1
    for _ in range(values[0]):
        dtype, ndim = _DTYPES[values[i]], values[i + 1]
        out.append((dtype, tuple(values[i + 2 : i + 2 + ndim])))
        i += 2 + ndim
    return out


def pack(tensors: Sequence[Tensor]) -> dict[torch.dtype, Tensor]:
    """One flat buffer per dtype (in order of first appearance): one message per dtype
    instead of one per tensor, since each gloo message costs a round of syscalls."""
    groups: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t.detach().reshape(-1))
    return {dtype: ts[0].contiguous() if len(ts) == 1 else torch.cat(ts)
            for dtype, ts in groups.items()}


def packed_sizes(layout: TensorLayout) -> dict[torch.dtype, int]:
    sizes: dict[torch.dtype, int] = {}
    for dtype, shape in layout:
        sizes[dtype] = sizes.get(dtype, 0) + math.prod(shape)
    return sizes


def unpack(flats: Mapping[torch.dtype, Tensor], layout: TensorLayout) -> list[Tensor]:
    """Views of the flat buffers with the message's shapes, in the message's order."""
    offsets = dict.fromkeys(flats, 0)
    out = []
    for dtype, shape in layout:
        n = math.prod(shape)
        out.append(flats[dtype][offsets[dtype] : offsets[dtype] + n].view(shape))
        offsets[dtype] += n
    return out


@dataclass
class BoundaryBytes:
    """Bytes of the activations and input gradients this rank sent to other stages since the
    transport was made: `whole`, those of the tensors the messages carry; `sent`, those it put
    on the wire (`whole` / tp where tp divides every buffer; metadata not counted)."""

    whole: int = 0
    sent: int = 0


class TPSlices:
    """The part of a flat buffer that one tp rank sends (`part`) and the receiving side's
    gather of the parts (`gather`), over the tp group of `ctx` (tp ranks t of stages s and
    s+1 are pipeline peers). A buffer of n elements is split when tp divides n, else it
    travels whole."""

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx
        self.degree = ctx.layout.tensor_parallel
        self.rank = ctx.layout.tp_rank
        self._group: dist.ProcessGroup | None = None

    def splits(self, n: int) -> bool:
        return self.degree > 1 and n % self.degree == 0

    def part(self, flat: Tensor) -> Tensor:
        """This tp rank's slice of `flat` (1-d), or `flat` where it travels whole."""
        n = flat.numel()
        if not self.splits(n):
            return flat
        size = n // self.degree
        return flat[self.rank * size : (self.rank + 1) * size]

    def receiving(self, flat: Tensor) -> Tensor:
        """The buffer a receive of `flat` (1-d) lands in: a new one of its part's size, or
        `flat` itself where it travels whole."""
        if not self.splits(flat.numel()):
            return flat
        return flat.new_empty(flat.numel() // self.degree)

    def gather(self, whole: Tensor, part: Tensor, msg: MessageKey) -> None:
        """Fill `whole` with every tp rank's `part` (this rank's among them), under the
        timeout."""
        if self._group is None:  # DeviceMesh.get_group costs ~0.1 ms a call
            self._group = self.ctx.tp_mesh.get_group()
        work = dist.all_gather_into_tensor(whole, part, group=self._group, async_op=True)
        self.ctx.wait_work(work, None, _About(msg, "the tp all-gather of "))


class _About:
    """A lazily formatted description of a message for error messages: formatting it on every
    send and receive would cost more than the bookkeeping it describes."""

    __slots__ = ("key", "prefix")

    def __init__(self, key: MessageKey, prefix: str = "") -> None:
        self.key, self.prefix = key, prefix

    def __str__(self) -> str:
        return self.prefix + describe_message(self.key)


# Bytes of receive buffers a rank posts ahead per peer under gloo (beyond `prefetch`).
AHEAD_BYTES = 64 * 2**20
# Longest `_Sender.post` waits for its thread to take a message (seconds).
HANDOFF_WAIT = 0.002
_Pending = tuple[Any, int, object, Tensor]  # (Work, pipeline rank, what it carries, buffer)
_Posted = tuple[int, list[Any], list[Tensor], list[tuple[Tensor, Tensor]]]


class _Sender:
    """Posts isends from a thread of its own for one step. gloo's isend can block its caller
    for a long time (it takes the connection's lock, which gloo's reader thread holds while
    it is descheduled on a busy machine); on this thread that wait overlaps the next compute.
    Messages are matched by tag, so posting order does not matter (gloo only).

    `handoff`: `post` waits (at most HANDOFF_WAIT) until the thread has taken the message.
    Without it the thread needs Python's GIL to take it while the caller goes on with its
    next action, and an action's Python code holds the GIL: the message left only when that
    code ended (benchmarks/bench_transfer.py: 590 us median send to arrival when the sender
    then runs 0.6 ms of Python, 125 us with the handoff, 121-136 us either way before
    kernels). The wait is bounded so that a thread still inside a slow isend cannot hold the
    step; the message is posted all the same, and `close` enforces the timeout."""

    def __init__(self, group: dist.ProcessGroup, handoff: bool = True) -> None:
        self.group = group
        self.queue: queue.SimpleQueue[tuple[Tensor, int, int, object] | None] = (
            queue.SimpleQueue()
        )
        self.handoff = threading.Event() if handoff else None
        self.posted: list[_Pending] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="hybridpipe-send", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        send, posted, handoff = self.group.send, self.posted, self.handoff
        while (item := self.queue.get()) is not None:
            if handoff is not None:
                handoff.set()
            tensor, peer, tag_, what = item
            try:
                posted.append((send([tensor], peer, tag_), peer, what, tensor))
            except BaseException as err:  # noqa: B036 - handed to the step's thread
                self.error = err
                return

    def post(self, item: tuple[Tensor, int, int, object]) -> None:
        """Queue an isend (see `handoff`)."""
        if self.handoff is None:
            self.queue.put(item)
            return
        self.handoff.clear()
        self.queue.put(item)
        self.handoff.wait(HANDOFF_WAIT)

    def close(self, timeout: float) -> list[_Pending]:
        """Stop after the queued isends; return them (their completion is the caller's)."""
        self.queue.put(None)
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise CommError(
                f"posting this step's sends took longer than the timeout ({timeout:g} s)", None
            )
        if self.error is not None:
            raise self.error
        return self.posted


class P2PTransport:
    """`Transport` over torch.distributed point-to-point. One per process.

    `begin` starts a step with its messages: receives are posted ahead in the order each peer
    sends (`scheduler.incoming`), so transfers overlap compute (and NCCL's in-order matching
    holds): at least `prefetch` per peer, and under gloo more, while the buffers posted and not
    yet consumed stay within `ahead_bytes` per peer (default AHEAD_BYTES; every receive of a
    step on small messages). gloo delivers a message only once its receive is posted, so a
    sender that runs ahead (GPipe's forwards, an interleaved rank's chunks) waited a round
    trip per message beyond the first few (figures: docs/distributed.md, "Speed"). Under NCCL,
    whose receives hold its stream, it stays at `prefetch`. Sends are isends (under gloo
    posted from a `_Sender` thread, with its `handoff` unless handoff=False) whose completion
    is awaited in `finish`. Message shapes are cached per batch-shape key (see
    pipeline.execution.distributed.executor).
    """

    def __init__(
        self, ctx: DistContext, *, prefetch: int = 2, send_thread: bool | None = None,
        ahead_bytes: int | None = None, handoff: bool = True,
    ) -> None:
        self.ctx = ctx
        self.prefetch = prefetch
        self.me = ctx.layout.pp_rank
        if send_thread is None or ahead_bytes is None:
            gloo = dist.get_backend() == "gloo"
            send_thread = gloo if send_thread is None else send_thread
            ahead_bytes = (AHEAD_BYTES if gloo else 0) if ahead_bytes is None else ahead_bytes
        self.send_thread = send_thread
        self.ahead_bytes = ahead_bytes
        self.handoff = handoff
        self._ahead: dict[int, tuple[int, int]] = {}  # peer -> (receives, bytes) posted ahead
        self._metas: dict[int, dict[MessageKey, TensorLayout]] = {}
        self._plans: dict[int, dict[MessageKey, list[tuple[torch.dtype, int]]]] = {}
        self._key = 0
        self._new = False
        self._queue: dict[int, deque[MessageKey]] = {}
        # msg -> (peer, its receives, the message's tensors, (whole, part) to gather)
        self._posted: dict[MessageKey, _Posted] = {}
        self.slices = TPSlices(ctx)
        self.bytes = BoundaryBytes()
        self._sends: list[_Pending] = []
        self._sender: _Sender | None = None

    @property
    def group(self) -> dist.ProcessGroup:
        """This pipeline's process group (made after setup: see DistContext)."""
        return self.ctx.pp_group

    def begin(self, shape_key: int, incoming: Mapping[int, Sequence[MessageKey]]) -> None:
        """Start a step whose batch-shape key is `shape_key` (the same on every rank of the
        pipeline); `incoming[peer]` are the messages pipeline rank `peer` sends us, in order."""
        self._key = shape_key
        self._new = shape_key not in self._metas
        if self._new:
            self._metas[shape_key] = {}
            self._plans[shape_key] = {}
        self._queue = {peer: deque(msgs) for peer, msgs in incoming.items()}
        if self.send_thread:
            self._sender = _Sender(self.group, self.handoff)
        self._ahead = {peer: (0, 0) for peer in self._queue}
        if not self._new:
            for peer in self._queue:
                self._fill(peer)

    def forget_shapes(self) -> None:
        """Drop the message shapes learnt per batch-shape key (the stages changed: their
        boundaries carry other tensors); the next step of each key learns them again."""
        self._metas.clear()
        self._plans.clear()

    def _fill(self, peer: int) -> None:
        """Post receives from `peer` ahead: up to `prefetch` of them, and more while the
        buffers posted and not yet consumed stay within `ahead_bytes`."""
        queue_, plans = self._queue.get(peer), self._plans[self._key]
        while queue_:
            count, size = self._ahead[peer]
            more = sum(n * dtype.itemsize for dtype, n in plans[queue_[0]])
            if count >= self.prefetch and size + more > self.ahead_bytes:
                return
            self._post_next(peer)

    def _post_next(self, peer: int) -> MessageKey | None:
        queue_ = self._queue.get(peer)
        if not queue_:
            return None
        msg = queue_.popleft()
        plans = self._plans[self._key]
        plan = plans.get(msg)
        if plan is None:  # first time for this batch shape: metadata comes first
            meta = torch.empty(META_LEN, dtype=torch.int64, device=self.ctx.device)
            work = self.group.recv([meta], peer, _message_tag(msg, MAX_TENSORS))
            self._wait(work, peer, _About(msg, "the shapes of "))
            layout = self._metas[self._key][msg] = decode_meta(meta)
            plan = plans[msg] = list(packed_sizes(layout).items())
        device = self.ctx.device
        flats = [torch.empty(n, dtype=dtype, device=device) for dtype, n in plan]
        wires = [self.slices.receiving(flat) for flat in flats]
        gathers = [(flat, wire) for flat, wire in zip(flats, wires, strict=True)
                   if wire is not flat]
        recv = self.group.recv
        works = [recv([wire], peer, _message_tag(msg, i)) for i, wire in enumerate(wires)]
        layout = self._metas[self._key][msg]
        if len(layout) == 1:  # one tensor: its buffer is the tensor
            tensors = [flats[0].view(layout[0][1])]
        else:
            tensors = unpack(dict(zip((d for d, _ in plan), flats, strict=True)), layout)
        self._posted[msg] = (peer, works, tensors, gathers)
        count, size = self._ahead[peer]
        self._ahead[peer] = (count + 1, size + sum(n * dtype.itemsize for dtype, n in plan))
        return msg

    def _wait(self, work: Any, peer: int, what: object) -> None:
        self.ctx.wait_work(work, self.ctx.layout.global_rank(peer), what)

    def recv(self, recv: Recv) -> tuple[Tensor, ...]:
        msg = recv.key
        while msg not in self._posted:
            if self._post_next(recv.peer) is None:
                raise RuntimeError(
                    f"pipeline rank {self.me} expects no {describe_message(msg)} from "
                    f"pipeline rank {recv.peer} in this step"
                )
        peer, works, buffers, gathers = self._posted.pop(msg)
        count, size = self._ahead[peer]
        taken = sum(n * dtype.itemsize for dtype, n in self._plans[self._key][msg])
        self._ahead[peer] = (count - 1, size - taken)
        if not self._new:  # post the next receives while this one may still be in flight
            self._fill(peer)
        about = _About(msg)
        for work in works:
            self._wait(work, peer, about)
        for whole, part in gathers:  # the same messages in the same order on every tp rank
            self.slices.gather(whole, part, msg)
        return tuple(buffers)

    def send(self, send: Send, tensors: tuple[Tensor, ...]) -> None:
        msg, dst = send.key, send.peer
        metas = self._metas[self._key]
        known = metas.get(msg)
        if known is None:
            meta = encode_meta(tensors).to(self.ctx.device)
            metas[msg] = decode_meta(meta)
            self._isend(meta, dst, _message_tag(msg, MAX_TENSORS), _About(msg, "the shapes of "))
        elif len(known) != len(tensors) or any(
            t.shape != shape or t.dtype != dtype
            for t, (dtype, shape) in zip(tensors, known, strict=True)
        ):
            raise ValueError(
                f"{describe_message(msg)} has shapes {[tuple(t.shape) for t in tensors]} but "
                f"had {[shape for _, shape in known]} for the same batch shapes: the "
                "distributed executor needs shapes that depend only on the input shapes "
                "(cut the model before data-dependent shapes, or pad them)"
            )
        about = _About(msg)
        flats = ([tensors[0].detach().reshape(-1)] if len(tensors) == 1
                 else list(pack(tensors).values()))
        for i, flat in enumerate(flats):
            wire = self.slices.part(flat).contiguous()
            self.bytes.whole += flat.numel() * flat.element_size()
            self.bytes.sent += wire.numel() * wire.element_size()
            self._isend(wire, dst, _message_tag(msg, i), about)

    def _isend(self, tensor: Tensor, dst: int, tag_: int, what: object) -> None:
        sender = self._sender
        if sender is None:
            self._sends.append((self.group.send([tensor], dst, tag_), dst, what, tensor))
            self._reap()
            return
        if sender.error is not None:
            raise sender.error
        sender.post((tensor, dst, tag_, what))

    def track(self, work: Any, dst: int, tensor: Tensor, what: str) -> None:
        """Await `work` (an isend of `tensor` to pipeline rank `dst`) with the step's sends."""
        self._sends.append((work, dst, what, tensor))

    def _reap(self) -> None:
        """Drop completed sends (and the tensors they kept alive)."""
        if len(self._sends) > 32:
            self._sends = [s for s in self._sends if not s[0].is_completed()]

    def abandon(self) -> None:
        """Drop a failed step's state and stop its sender thread (without waiting)."""
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.queue.put(None)
        self._sends.clear()
        self._posted.clear()
        self._queue.clear()

    def finish(self) -> None:
        """Wait for every send of the step; check no receive is left over."""
        sender, self._sender = self._sender, None
        try:
            if sender is not None:
                self._sends += sender.close(self.ctx.failures.timeout)
            for work, dst, what, _ in self._sends:
                self._wait(work, dst, f"the delivery of {what}")
        finally:
            self._sends.clear()
        left = sorted(self._posted) + sorted(m for q in self._queue.values() for m in q)
        self._posted.clear()
        self._queue.clear()
        if left:
            raise RuntimeError(
                f"pipeline rank {self.me} ended the step with receives left over: {left}"
            )
