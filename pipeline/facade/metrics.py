"""Per-step figures of a Pipeline (`StepMetrics`, ``pipe.metrics``): samples and tokens per
second, achieved FLOP/s and MFU against a stated peak, the bubble fraction measured in the
step's trace and the peak memory of each pipeline rank this process runs; and the opt-in log
line every N steps (``pipe.log_metrics``).

What a step costs to measure: two clock reads, a pass over the trace's events, and one memory
query per device (the CUDA allocator's peak, reset for the next step; on CPU the process's
peak RSS). The model's FLOPs are counted once, on fake tensors, the first time a figure needs
them (partitioner.flops)."""

from __future__ import annotations

import logging
import resource
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, fx

from partitioner.flops import Spec, count_flops, stand_ins
from pipeline.execution.executor import Executor
from pipeline.planning.decision import Decision
from pipeline.planning.microbatch import Microbatches, batch_size
from scheduler import Timeline, format_bytes

log = logging.getLogger("hybridpipe")

# Dense peak FLOP/s per GPU (vendor data sheets, no sparsity), by a substring of the device
# name (more specific names first) and by the arithmetic the matmuls run in.
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("B200", {"bf16": 2.25e15, "tf32": 1.1e15, "fp32": 80e12}),
    ("H100 PCIe", {"bf16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    ("H100", {"bf16": 989e12, "tf32": 495e12, "fp32": 67e12}),
    ("H200", {"bf16": 989e12, "tf32": 495e12, "fp32": 67e12}),
    ("H800", {"bf16": 989e12, "tf32": 495e12, "fp32": 67e12}),
    ("GH200", {"bf16": 989e12, "tf32": 495e12, "fp32": 67e12}),
    ("A100", {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("A800", {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
    ("L4", {"bf16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    ("V100", {"fp16": 125e12, "fp32": 15.7e12}),
)


def arithmetic(dtype: torch.dtype | None) -> str:
    """What the matmuls of a step run in: the autocast dtype, else fp32 (tf32 when torch
    allows it for matmuls), else the parameters' own (e.g. "float64": no peak known)."""
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16" if dtype == torch.bfloat16 else "fp16"
    if dtype in (None, torch.float32):
        return "tf32" if torch.get_float32_matmul_precision() != "highest" else "fp32"
    return str(dtype).removeprefix("torch.")


def device_peak_flops(device: torch.device, kind: str) -> float | None:
    """The dense peak FLOP/s of `device` for arithmetic `kind` from `PEAK_FLOPS` (a bf16
    peak stands for fp16 and back), or None when unknown (any CPU; unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for part, peaks in PEAK_FLOPS:
        if part in name:
            twin = {"bf16": "fp16", "fp16": "bf16"}.get(kind, kind)
            return peaks.get(kind, peaks.get(twin))
    return None


def tokens_per_row(args: Sequence[Any]) -> int | None:
    """Tokens per sample when the first input has a sequence dim: token ids (an integer
    tensor of 2+ dims, [batch, seq, ...]) or embeddings ([batch, seq, features] float); else
    None (e.g. images)."""
    first = next((a for a in args if isinstance(a, Tensor)), None)
    if first is None or first.dim() < 2:
        return None
    if not first.is_floating_point() or first.dim() == 3:
        return int(first.shape[1])
    return None


class FlopCount:
    """The model's forward + backward FLOPs per sample (or per token), counted once on fake
    tensors when first asked (`per_unit`). `snapshot` keeps what the count needs while the
    process still holds the whole model."""

    def __init__(self) -> None:
        self._source: tuple[fx.GraphModule, dict[str, Spec], tuple[Any, ...]] | None = None
        self._per_unit: float | None = None
        self.by_token = False

    def snapshot(self, gm: fx.GraphModule, example: tuple[Any, ...]) -> None:
        if self._source is None:
            self._source = (gm, stand_ins(gm), example)

    def per_unit(self) -> float | None:
        """FLOPs per token when the example has a sequence dim, else per sample."""
        if self._per_unit is None and self._source is not None:
            gm, tensors, example = self._source
            forward, backward = count_flops(gm, tensors, example)
            rows = next((int(a.shape[0]) for a in example if isinstance(a, Tensor)), 1)
            seq = tokens_per_row(example)
            self.by_token = seq is not None
            self._per_unit = (forward + backward) / (rows * (seq or 1))
            self._source = None
        return self._per_unit


@dataclass(frozen=True)
class StepMetrics:
    """One step's figures. `seconds`: wall time of the ``pipe.step`` call; `samples` and
    `tokens`: of the whole job's step (this replica's batch x data-parallel replicas; tokens
    None when the input has no sequence dim, see `tokens_per_row`); `flops`: the model's
    FLOPs of that step (forward + backward as captured; recomputation not counted, as MFU
    is usually stated); `peak_flops`: per device, from the device or ``pipe.log_metrics(
    peak_flops=...)``; `devices`: ranks x replicas; `bubble`: idle share of the measured
    trace's ranks over its span; `peak_memory`: pipeline rank -> bytes, for the ranks this
    process runs (`memory_source` says what was read: the CUDA allocator's peak during the
    step, or the process's peak RSS so far, shared by CPU ranks of one process)."""

    step: int
    loss: Tensor
    seconds: float
    samples: int
    tokens: int | None
    devices: int
    bubble: float
    peak_memory: dict[int, int]
    memory_source: str
    peak_flops: float | None
    flop_count: FlopCount = field(repr=False, compare=False)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.tokens is None or self.seconds <= 0 else self.tokens / self.seconds

    @property
    def flops(self) -> float | None:
        per_unit = self.flop_count.per_unit()
        if per_unit is None:
            return None
        units = self.tokens if self.flop_count.by_token and self.tokens else self.samples
        return per_unit * units

    @property
    def flops_per_s(self) -> float | None:
        """Achieved model FLOP/s of the whole job."""
        flops = self.flops
        return None if flops is None or self.seconds <= 0 else flops / self.seconds

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation: achieved FLOP/s / (peak per device x devices)."""
        achieved = self.flops_per_s
        if achieved is None or not self.peak_flops:
            return None
        return achieved / (self.peak_flops * self.devices)

    def _compute(self) -> str | None:
        """Achieved FLOP/s and MFU as text; None when the FLOPs are not known."""
        achieved = self.flops_per_s
        if achieved is None:
            return None
        mfu = self.mfu
        return f"{format_flops(achieved)}/s" + (
            f" MFU {mfu:.1%} of {format_flops(self.peak_flops)}/s x {self.devices}"
            if mfu is not None and self.peak_flops else " (MFU: no peak known, pass "
            "peak_flops=)")

    def _memory(self) -> str:
        memory = " ".join(f"rank{r} {format_bytes(b)}" for r, b in sorted(self.peak_memory.items()))
        return f"{memory} ({self.memory_source})"

    def line(self) -> str:
        """The log line: step, loss, throughput, FLOP/s and MFU, bubble, memory per rank."""
        parts = [f"step {self.step}", f"loss {float(self.loss):.4f}",
                 f"{self.seconds * 1e3:.1f} ms", f"{self.samples_per_s:,.1f} samples/s"]
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:,.0f} tokens/s")
        compute = self._compute()
        if compute is not None:
            parts.append(compute)
        parts.append(f"bubble {self.bubble:.1%}")
        parts.append(f"peak memory {self._memory()}")
        return "hybridpipe: " + " | ".join(parts)

    def __str__(self) -> str:
        """What ``print(pipe.metrics)`` shows: one figure a line, in units people read."""
        tokens = ("no sequence dim" if self.tokens_per_s is None
                  else f"{self.tokens_per_s:,.0f}")
        rows = [
            f"step {self.step}: loss {float(self.loss):.4f}, {self.seconds * 1e3:.1f} ms",
            f"  samples/s    {self.samples_per_s:,.1f} ({self.samples} a step)",
            f"  tokens/s     {tokens}",
            f"  FLOP/s, MFU  {self._compute() or 'not counted'}",
            f"  bubble       {self.bubble:.1%}",
            f"  peak memory  {self._memory()}",
        ]
        return "\n".join(rows)


def format_flops(flops: float) -> str:
    """FLOPs with an SI prefix: "3.83 MFLOP", "412 TFLOP"."""
    for prefix in ("", "k", "M", "G", "T"):
        if abs(flops) < 1000 or prefix == "T":
            return f"{flops:.3g} {prefix}FLOP"
        flops /= 1000
    return f"{flops:.3g} TFLOP"


def measured_bubble(trace: Timeline) -> float:
    """Idle share of the ranks that have events in `trace` over the trace's span (under
    torch.distributed a process's trace holds its own rank, or its whole pipeline on global
    rank 0)."""
    if not trace.events:
        return 0.0
    ranks = {e.rank for e in trace.events}
    start = min(e.start for e in trace.events)
    span = max(e.end for e in trace.events) - start
    busy = sum(e.duration for e in trace.events)
    return max(0.0, 1.0 - busy / (len(ranks) * span)) if span > 0 else 0.0


def peak_memory(devices: dict[int, torch.device]) -> tuple[dict[int, int], str]:
    """Peak bytes per pipeline rank: the CUDA allocator's peak since the last call (reset
    now), or the process's peak RSS for CPU ranks."""
    peaks: dict[int, int] = {}
    seen: dict[torch.device, int] = {}
    sources = set()
    for rank, device in devices.items():
        if device not in seen:
            if device.type == "cuda":
                seen[device] = int(torch.cuda.max_memory_allocated(device))
                torch.cuda.reset_peak_memory_stats(device)
                sources.add("CUDA allocator peak")
            else:  # ru_maxrss: kilobytes on Linux, bytes on macOS
                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                seen[device] = int(rss if sys.platform == "darwin" else rss * 1024)
                sources.add("process peak RSS")
        peaks[rank] = seen[device]
    return peaks, ", ".join(sorted(sources))


def shown(text: str) -> None:
    """A metrics line where the user sees it: on the "hybridpipe" logger when logging is set
    up to show its INFO records (a handler and the level), else printed (Python's default
    logging drops INFO, so a line logged there by default would never be seen)."""
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info("%s", text)
    else:
        print(text, flush=True)


class Metrics:
    """The figures of a Pipeline's steps: `record` after each step; `last` the latest
    `StepMetrics`; a log line every `every` steps when asked (`configure`)."""

    def __init__(self) -> None:
        self.flop_count = FlopCount()
        self.last: StepMetrics | None = None
        self.steps = 0
        self.every: int | None = None
        self.peak_flops: float | None = None
        self.emit: Callable[[str], None] = shown

    def configure(
        self, every: int | None, peak_flops: float | None,
        to: Callable[[str], None] | None,
    ) -> None:
        if every is not None and (isinstance(every, bool) or not isinstance(every, int)
                                  or every < 1):
            raise ValueError(f"every={every!r}: give a positive number of steps, or None")
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(
                f"peak_flops={peak_flops!r}: give the dense peak FLOP/s of one device "
                "(e.g. 989e12 for an H100 in bf16), or None to read it from the device"
            )
        self.every, self.peak_flops = every, peak_flops
        self.emit = shown if to is None else to

    def record(
        self, *, loss: Tensor, seconds: float, rows: int, seq: int | None, replicas: int,
        trace: Timeline, devices: dict[int, torch.device], world: int,
        peak_flops: float | None,
    ) -> StepMetrics:
        """This step's figures (`rows`: this replica's batch size; `seq`: tokens per row,
        None without a sequence dim; `devices`: pipeline rank -> device, for this process's
        ranks; `world`: devices of the job; `peak_flops`: the device's, if known)."""
        self.steps += 1
        memory, source = peak_memory(devices)
        samples = rows * replicas
        self.last = StepMetrics(
            step=self.steps, loss=loss, seconds=seconds, samples=samples,
            tokens=None if seq is None else samples * seq, devices=world,
            bubble=measured_bubble(trace), peak_memory=memory, memory_source=source,
            peak_flops=self.peak_flops if self.peak_flops is not None else peak_flops,
            flop_count=self.flop_count,
        )
        if self.every is not None and self.steps % self.every == 0:
            self.emit(self.last.line())
        return self.last

    def after_step(
        self, executor: Executor, planned: Decision, inputs: Microbatches | None, targets: Any,
        loss: Tensor, trace: Timeline, seconds: float,
    ) -> StepMetrics:
        """`record` for a step of `planned` run by `executor` on `inputs` and `targets` (a
        process that got neither counts the planned batch: example rows x microbatches)."""
        if inputs is not None:
            rows = inputs.rows
        elif targets is not None:
            rows = batch_size(targets, "targets")
        else:
            rows = batch_size(planned.example, "inputs") * planned.schedule.num_microbatches
        devices, replicas = executor.rank_devices, executor.processes.data_parallel
        dtype = executor.precision.dtype or next(
            (p.dtype for p in planned.model.parameters() if p.is_floating_point()), None)
        return self.record(
            loss=loss, seconds=seconds, rows=rows,
            seq=tokens_per_row(inputs.parts[0] if inputs is not None else planned.example),
            replicas=replicas, trace=trace, devices=devices,
            world=planned.schedule.num_ranks * replicas,
            peak_flops=device_peak_flops(next(iter(devices.values())), arithmetic(dtype)),
        )
