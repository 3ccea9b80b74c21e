"""Predicts a Schedule's Timeline from per-stage costs: an event-driven run in which each rank
executes its actions in order, each starting when the rank is free and its inputs have arrived."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from scheduler.ir import Op, Schedule
from scheduler.timeline import Event, Timeline, per_stage
from scheduler.validate import check_structure, execute

Cost = float | Sequence[float]


def _boundary_bytes(message_bytes: Cost, num_stages: int) -> tuple[float, ...]:
    """Bytes crossing each boundary s -> s+1 (the gradient going back carries the same)."""
    if isinstance(message_bytes, (int, float)):
        return (float(message_bytes),) * num_stages
    values = tuple(float(v) for v in message_bytes)
    if len(values) not in (num_stages - 1, num_stages):
        raise ValueError(
            f"message_bytes has {len(values)} entries for {num_stages} stages; give a scalar or "
            f"one value per boundary ({num_stages - 1}) or per stage ({num_stages}, last unused)"
        )
    return values + (0.0,) * (num_stages - len(values))


def simulate(
    schedule: Schedule,
    forward: Cost,
    backward: Cost,
    weight: Cost = 0.0,
    comm: float = 0.0,
    *,
    bandwidth: float | None = None,
    message_bytes: Cost | None = None,
    activation: Cost | None = None,
    activation_unit: str = "B",
    scale: Callable[[int, int, int], float] | None = None,
) -> Timeline:
    """Simulate one step of `schedule` and return its predicted Timeline.

    Costs are scalars or one value per stage. `weight` is the W cost of a split backward; for a
    schedule that does not split backward each B costs `backward + weight`. A cross-rank input
    arrives `comm` after its producer ends, plus `message_bytes[s] / bandwidth` when both are
    given (message_bytes[s]: bytes crossing boundary s -> s+1, activations forward and
    gradients back); same-rank handoffs are free. `activation` (per stage) sizes the memory
    curve, in `activation_unit` (bytes by default). `scale(stage, op, microbatch)` multiplies
    single actions' costs (e.g. drawn from a measured spread). A schedule that cannot run
    raises the same ValueError as `validate`.
    """
    n = schedule.num_stages
    f = per_stage(forward, n, "forward")
    b = per_stage(backward, n, "backward")
    w = per_stage(weight, n, "weight")
    for what, values in (("forward", f), ("backward", b), ("weight", w)):
        if any(v < 0 for v in values):
            raise ValueError(f"{what} costs {values} include a negative value; costs must be >= 0")
    if comm < 0:
        raise ValueError(f"comm={comm} is negative; give a latency >= 0")
    if (bandwidth is None) != (message_bytes is None):
        raise ValueError(
            "give both bandwidth and message_bytes (or neither) to model transfer time; "
            f"got bandwidth={bandwidth}, message_bytes={message_bytes}"
        )
    if bandwidth is not None and bandwidth <= 0:
        raise ValueError(f"bandwidth={bandwidth} must be > 0 (bytes per time unit)")
    act = per_stage(activation, n, "activation") if activation is not None else None
    check_structure(schedule)
    times = _execute(schedule, f, b, w, comm, bandwidth, message_bytes, scale)
    events = tuple(
        Event(rank, a.stage, a.op, a.microbatch, start, end)
        for rank, acts in enumerate(schedule.actions)
        for a, (start, end) in zip(acts, times[rank], strict=True)
    )
    return Timeline(
        events=events,
        num_ranks=schedule.num_ranks,
        splits_backward=schedule.splits_backward,
        name=schedule.name,
        activation=act,
        activation_unit=activation_unit,
    )


def _execute(
    schedule: Schedule,
    f: Sequence[float],
    b: Sequence[float],
    w: Sequence[float],
    comm: float,
    bandwidth: float | None,
    message_bytes: Cost | None,
    scale: Callable[[int, int, int], float] | None = None,
) -> list[list[tuple[float, float]]]:
    n = schedule.num_stages
    if schedule.splits_backward:
        costs = [(f[s], b[s], w[s]) for s in range(n)]
    else:
        costs = [(f[s], b[s] + w[s], 0.0) for s in range(n)]
    delay = [float(comm)] * n
    if bandwidth is not None and message_bytes is not None:
        sizes = _boundary_bytes(message_bytes, n)
        delay = [comm + sizes[s] / bandwidth for s in range(n)]

    def latency(from_stage: int, to_stage: int, op: int) -> float:
        # Activations cross boundary from_stage -> from_stage+1; gradients cross it backwards.
        return delay[min(from_stage, to_stage)]

    return execute(schedule, lambda s, o: costs[s][o], latency, scale)


@dataclass(frozen=True)
class Summary:
    """The figures of a predicted Timeline without its events: step time, bubble fraction and
    each rank's peak held activation amount (in `activation` units)."""

    step_time: float
    bubble_fraction: float
    peak_memory: tuple[float, ...]


def summarize(
    schedule: Schedule,
    forward: Sequence[float],
    backward: Sequence[float],
    weight: Sequence[float],
    comm: float,
    activation: Sequence[float],
) -> Summary:
    """`simulate`'s step time, bubble and peak memory for a schedule already known to be
    well formed (a generator's output), per-stage costs given: what a planner comparing
    thousands of candidates needs, at a fraction of the cost (no structure check, no Events).
    Same figures as the Timeline's (tested)."""
    times = _execute(schedule, forward, backward, weight, comm, None, None)
    t0 = min((t[0][0] for t in times if t), default=0.0)
    t1 = max((t[-1][1] for t in times if t), default=0.0)
    busy = sum(end - start for rank in times for start, end in rank)
    step = t1 - t0
    bubble = max(0.0, 1.0 - busy / (schedule.num_ranks * step)) if step > 0 else 0.0
    return Summary(step, bubble, peak_held(schedule, activation))


def peak_held(schedule: Schedule, activation: Sequence[float]) -> tuple[float, ...]:
    """Each rank's peak held activation amount, from its action list alone: a rank runs its
    list one action at a time and only its own F (taking at its start) and B or W (freeing at
    its end) change what it holds, so the peak does not depend on the costs. Equals the
    simulated Timeline's `peak_memory` for any costs."""
    release = Op.W if schedule.splits_backward else Op.B
    peaks = []
    for acts in schedule.actions:
        held = peak = 0.0
        for a in acts:
            if a.op is Op.F:
                held += activation[a.stage]
                peak = max(peak, held)
            elif a.op is release:
                held -= activation[a.stage]
        peaks.append(peak)
    return tuple(peaks)


def rank_costs_to_stages(cost: Cost, schedule: Schedule, what: str = "cost") -> list[float]:
    """Per-stage costs from per-rank costs: a rank's share of the model is split evenly over its
    virtual stages, so schedules with different chunk counts simulate the same model. A scalar
    is one rank's cost; a sequence with one value per stage is taken as it is."""
    v = schedule.virtual_stages
    if isinstance(cost, (int, float)):
        return [float(cost) / v] * schedule.num_stages
    values = [float(c) for c in cost]
    if len(values) == schedule.num_stages:
        return values
    if len(values) == schedule.num_ranks:
        return [values[rank] / v for rank in schedule.placement]
    raise ValueError(
        f"{what} has {len(values)} values; {schedule.name} needs one number, one per rank "
        f"({schedule.num_ranks}) or one per stage ({schedule.num_stages})"
    )
