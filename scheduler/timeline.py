"""`Event` and `Timeline`: what ran where and when. The simulator predicts Timelines and the
executors measure them, from the same Event records, so both are analysed and drawn alike."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler.ir import Op


@dataclass(frozen=True)
class Event:
    """One executed (or predicted) action: `rank` ran `op` of `stage` on `microbatch`
    from `start` to `end` (seconds, or abstract cost units in simulation)."""

    rank: int
    stage: int
    op: Op
    microbatch: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Timeline:
    """Events of one step plus the figures derived from them.

    `bubble_fraction` = idle / (ranks x step_time). `peak_inflight[r]` is the most
    (stage, microbatch) activations held on rank r at once: held from the start of F until
    the end of B (or of W when backward is split). `memory[r]` is rank r's held activation
    amount over time as (time, amount) steps, in `activation` units per (stage, microbatch):
    `activation_unit` names them, "B" (bytes, the default) or e.g. "microbatch".
    """

    events: tuple[Event, ...]
    num_ranks: int
    splits_backward: bool
    name: str = ""
    activation: tuple[float, ...] | None = None
    activation_unit: str = "B"
    step_time: float = field(init=False)
    bubble_fraction: float = field(init=False)
    peak_inflight: tuple[int, ...] = field(init=False)
    peak_memory: tuple[float, ...] = field(init=False)
    memory: tuple[tuple[tuple[float, float], ...], ...] = field(init=False)

    def __post_init__(self) -> None:
        events = self.events
        if events:
            t0 = min(e.start for e in events)
            step = max(e.end for e in events) - t0
        else:
            t0, step = 0.0, 0.0
        busy = sum(e.duration for e in events)
        bubble = 1.0 - busy / (self.num_ranks * step) if step > 0 else 0.0
        by_rank: list[list[Event]] = [[] for _ in range(self.num_ranks)]
        for e in events:
            if not 0 <= e.rank < self.num_ranks:
                raise ValueError(
                    f"event {e} names rank {e.rank}, outside 0..{self.num_ranks - 1}; "
                    "set num_ranks to cover every event's rank"
                )
            by_rank[e.rank].append(e)
        counts, peaks, curves = [], [], []
        for rank in range(self.num_ranks):
            curve, peak_count, peak_amount = self._held(by_rank[rank], t0)
            counts.append(peak_count)
            peaks.append(peak_amount)
            curves.append(curve)
        object.__setattr__(self, "step_time", step)
        object.__setattr__(self, "bubble_fraction", max(0.0, bubble))
        object.__setattr__(self, "peak_inflight", tuple(counts))
        object.__setattr__(self, "peak_memory", tuple(peaks))
        object.__setattr__(self, "memory", tuple(curves))

    def _held(
        self, events: list[Event], t0: float
    ) -> tuple[tuple[tuple[float, float], ...], int, float]:
        release_op = Op.W if self.splits_backward else Op.B
        deltas: list[tuple[float, int, float]] = []  # (time, +1/-1, amount); frees sort first
        for e in events:
            amount = self.activation[e.stage] if self.activation is not None else 1.0
            if e.op is Op.F:
                deltas.append((e.start - t0, 1, amount))
            elif e.op is release_op:
                deltas.append((e.end - t0, -1, -amount))
        deltas.sort(key=lambda d: (d[0], d[1]))
        count, amount, peak_count, peak_amount = 0, 0.0, 0, 0.0
        curve: list[tuple[float, float]] = [(0.0, 0.0)]
        for time, step, delta in deltas:
            count += step
            amount += delta
            peak_count = max(peak_count, count)
            peak_amount = max(peak_amount, amount)
            curve.append((time, amount))
        return tuple(curve), peak_count, peak_amount

    def for_rank(self, rank: int) -> list[Event]:
        """Rank `rank`'s events in start order."""
        return sorted((e for e in self.events if e.rank == rank), key=lambda e: e.start)


def format_bytes(size: float) -> str:
    """A byte count as people read it: "512 B", "3.5 KiB", "31.4 MiB", "1.25 GiB"."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            # 3 significant digits, but whole numbers from 100 up ("1000 MiB", not "1e+03")
            return f"{size:.0f} {unit}" if unit == "B" or abs(size) >= 100 else (
                f"{size:.3g} {unit}")
        size /= 1024
    return f"{size:.0f} GiB"


def format_amount(amount: float, unit: str) -> str:
    """An activation amount in its unit: bytes as `format_bytes`, others as "1.5 microbatch"."""
    return format_bytes(amount) if unit == "B" else f"{amount:.3g} {unit}"


def per_stage(value: float | Sequence[float], num_stages: int, what: str) -> tuple[float, ...]:
    """Broadcast a scalar cost to every stage, or check a per-stage sequence's length."""
    if isinstance(value, (int, float)):
        return (float(value),) * num_stages
    values = tuple(float(v) for v in value)
    if len(values) != num_stages:
        raise ValueError(
            f"{what} has {len(values)} entries for {num_stages} stages; "
            "give a scalar or one value per stage"
        )
    return values
