"""Point-to-point messages between the pipeline ranks of one replica: the wire format (a
metadata message describing the tensors the first time a message of a batch shape is sent,
then one flat buffer per dtype) and `P2PTransport`, the runtime's `Transport` over
torch.distributed ``isend``/``irecv``, with receives posted ahead in each sender's order.

Tags: every (kind, stage, microbatch, tensor index) has its own int32 tag (`tag`), so gloo
matches messages by tag; NCCL matches in posting order, which the sender-ordered posting
keeps."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pipeline.distributed.context import DistContext
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


class P2PTransport:
    """`Transport` over torch.distributed point-to-point. One per process.

    `begin` starts a step with its messages: receives are posted ahead (`prefetch` per peer)
    in the order each peer sends (`scheduler.incoming`), so transfers overlap compute (and
    NCCL's in-order matching holds). Sends are isends whose completion is awaited in `finish`.
    Message shapes are cached per batch-shape key (see pipeline.distributed.executor).
    """

    def __init__(self, ctx: DistContext, *, prefetch: int = 2) -> None:
        self.ctx = ctx
        self.prefetch = prefetch
        self.me = ctx.layout.pp_rank
        self._metas: dict[int, dict[MessageKey, TensorLayout]] = {}
        self._key = 0
        self._new = False
        self._queue: dict[int, deque[MessageKey]] = {}
        self._posted: dict[MessageKey, tuple[int, list[Any], list[Tensor]]] = {}
        self._sends: list[tuple[Any, int, str, Tensor]] = []

    def begin(self, shape_key: int, incoming: Mapping[int, Sequence[MessageKey]]) -> None:
        """Start a step whose batch-shape key is `shape_key` (the same on every rank of the
        pipeline); `incoming[peer]` are the messages pipeline rank `peer` sends us, in order."""
        self._key = shape_key
        self._new = shape_key not in self._metas
        if self._new:
            self._metas[shape_key] = {}
        self._queue = {peer: deque(msgs) for peer, msgs in incoming.items()}
        if not self._new:
            for peer in self._queue:
                for _ in range(self.prefetch):
                    self._post_next(peer)

    def _post_next(self, peer: int) -> MessageKey | None:
        queue = self._queue.get(peer)
        if not queue:
            return None
        msg = queue.popleft()
        src = self.ctx.layout.global_rank(peer)
        metas = self._metas[self._key]
        if msg not in metas:  # first time for this batch shape: metadata comes first
            meta = torch.empty(META_LEN, dtype=torch.int64, device=self.ctx.device)
            work = dist.irecv(meta, src=src, tag=_message_tag(msg, MAX_TENSORS))
            self.ctx.wait_work(work, src, f"the shapes of {describe_message(msg)}")
            metas[msg] = decode_meta(meta)
        layout = metas[msg]
        flats = {
            dtype: torch.empty(n, dtype=dtype, device=self.ctx.device)
            for dtype, n in packed_sizes(layout).items()
        }
        works = [
            dist.irecv(flat, src=src, tag=_message_tag(msg, i))
            for i, flat in enumerate(flats.values())
        ]
        self._posted[msg] = (src, works, unpack(flats, layout))
        return msg

    def recv(self, recv: Recv) -> tuple[Tensor, ...]:
        msg = recv.key
        while msg not in self._posted:
            if self._post_next(recv.peer) is None:
                raise RuntimeError(
                    f"pipeline rank {self.me} expects no {describe_message(msg)} from "
                    f"pipeline rank {recv.peer} in this step"
                )
        src, works, buffers = self._posted.pop(msg)
        for work in works:
            self.ctx.wait_work(work, src, describe_message(msg))
        if not self._new:
            self._post_next(recv.peer)
        return tuple(buffers)

    def send(self, send: Send, tensors: tuple[Tensor, ...]) -> None:
        msg = send.key
        dst = self.ctx.layout.global_rank(send.peer)
        metas = self._metas[self._key]
        if msg not in metas:
            meta = encode_meta(tensors).to(self.ctx.device)
            metas[msg] = decode_meta(meta)
            work = dist.isend(meta, dst=dst, tag=_message_tag(msg, MAX_TENSORS))
            self._sends.append((work, dst, f"the shapes of {describe_message(msg)}", meta))
        elif metas[msg] != [(t.dtype, tuple(t.shape)) for t in tensors]:
            raise ValueError(
                f"{describe_message(msg)} has shapes {[tuple(t.shape) for t in tensors]} but had "
                f"{[shape for _, shape in metas[msg]]} for the same batch shapes: the "
                "distributed executor needs shapes that depend only on the input shapes "
                "(cut the model before data-dependent shapes, or pad them)"
            )
        for i, flat in enumerate(pack(tensors).values()):
            work = dist.isend(flat, dst=dst, tag=_message_tag(msg, i))
            self._sends.append((work, dst, describe_message(msg), flat))
        self._reap()

    def track(self, work: Any, dst: int, tensor: Tensor, what: str) -> None:
        """Await `work` (an isend of `tensor` to global rank `dst`) with the step's sends."""
        self._sends.append((work, dst, what, tensor))

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
