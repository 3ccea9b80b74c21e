"""CUDA stream helpers for the local executor. Every function is a no-op on CPU (a single
`CPU_STREAM` placeholder stands for "no stream"), so the same executor code runs with
``devices=["cpu", "cpu"]`` and only this module needs a GPU to exercise (torchgpipe style)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeAlias

import torch


class _CPUStream:
    """Placeholder stream for CPU devices."""

    def __repr__(self) -> str:
        return "CPU_STREAM"


CPU_STREAM = _CPUStream()
AnyStream: TypeAlias = "torch.cuda.Stream | _CPUStream"


def new_stream(device: torch.device) -> AnyStream:
    """A fresh stream on `device` (CPU_STREAM on CPU)."""
    if device.type != "cuda":
        return CPU_STREAM
    return torch.cuda.Stream(device)


def current_stream(device: torch.device) -> AnyStream:
    """The calling thread's current stream on `device` (CPU_STREAM on CPU)."""
    if device.type != "cuda":
        return CPU_STREAM
    return torch.cuda.current_stream(device)


@contextmanager
def use_device(device: torch.device) -> Iterator[None]:
    """Make `device` the current CUDA device inside the block (nothing on CPU)."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


@contextmanager
def use_stream(stream: AnyStream) -> Iterator[None]:
    """Make `stream` current on its device inside the block (nothing for CPU_STREAM)."""
    if not isinstance(stream, torch.cuda.Stream):
        yield
        return
    with torch.cuda.stream(stream):
        yield


def record_event(stream: AnyStream) -> torch.cuda.Event | None:
    """An event marking the work queued on `stream` so far (None on CPU)."""
    if not isinstance(stream, torch.cuda.Stream):
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def wait_event(stream: AnyStream, event: torch.cuda.Event | None) -> None:
    """Make later work on `stream` wait for `event`, without blocking the host."""
    if isinstance(stream, torch.cuda.Stream) and event is not None:
        stream.wait_event(event)


def wait_stream(waiter: AnyStream, source: AnyStream) -> None:
    """Make later work on `waiter` wait for the work queued on `source` so far."""
    if isinstance(waiter, torch.cuda.Stream) and isinstance(source, torch.cuda.Stream):
        waiter.wait_stream(source)


def record_stream(tensor: torch.Tensor, stream: AnyStream) -> None:
    """Tell the caching allocator `tensor` is used on `stream`, so its memory is not reused
    before that stream's queued work is done (needed when a tensor crosses streams)."""
    if isinstance(stream, torch.cuda.Stream) and tensor.is_cuda:
        tensor.record_stream(stream)
