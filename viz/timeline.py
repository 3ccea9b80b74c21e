"""Pictures of training runs over time: a per-rank Gantt chart of one step, several steps stacked
on one time axis, the activation memory each rank holds over the step, and the loss per step.
Predicted (simulated) and measured Timelines are drawn by the same code."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.container import BarContainer
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from scheduler import Event, Op, Timeline, format_amount
from viz.style import (
    OP_NAMES,
    chunk_color,
    format_time,
    save,
    stage_color,
    text_color,
    time_scale,
)

_WIDTH_IN = 11.0  # figure width; wide enough for 8 ranks x 32 microbatches at a glance
_ROW_IN = 0.42  # height of one rank's row
_LABEL_PT = 7.0  # microbatch label font size
_OP_ORDER = {Op.F: 0, Op.B: 1, Op.W: 2}


def plot_timeline(
    timeline: Timeline,
    path: str | Path | None = None,
    ax: Axes | None = None,
    title: str | None = None,
    *,
    unit: str | None = None,
) -> Figure:
    """Gantt chart of one step: one row per rank, a block per Event coloured by op (F/B/W),
    darker per virtual stage, the microbatch number on each block wide enough to hold it, idle
    time left blank. The title gives the schedule, step time and bubble fraction.

    `unit` is the time unit of the events: "s" for measured/profiled seconds (shown as s, ms or
    µs), None for abstract simulation cost units. Draws into `ax` if given, else a new Figure.
    Writes PNG/SVG/PDF when `path` is given (format from the extension). Returns the Figure.
    """
    _check_timeline(timeline, "timeline")
    if ax is None:
        fig = Figure(figsize=(_WIDTH_IN, 1.9 + _ROW_IN * timeline.num_ranks), layout="constrained")
        ax = fig.add_subplot()
        own = True
    else:
        fig = _figure_of(ax)
        own = False
    factor, xlabel = time_scale(timeline.step_time, unit)
    width_in = _axes_width_in(fig, ax, own)
    bars = _draw_gantt(ax, timeline, factor, timeline.step_time * factor, width_in)
    ax.set_xlabel(xlabel)
    ax.set_title(
        title if title is not None else _summary(timeline, timeline.name, unit), loc="left"
    )
    handles = _legend_handles(bars)
    if own:
        fig.legend(handles=handles, loc="outside lower center", ncol=_columns(bars), frameon=False)
    else:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return save(fig, path)


def plot_comparison(
    timelines: Sequence[Timeline],
    labels: Sequence[str] | None = None,
    path: str | Path | None = None,
    *,
    unit: str | None = None,
    title: str | None = None,
) -> Figure:
    """Several Timelines stacked on one shared time axis (predicted vs measured, or several
    schedules), each titled with its label, step time, bubble fraction and peak activations
    held (in-flight count, or memory when the Timeline has activation sizes). `labels`
    default to the timelines' names. Returns the Figure."""
    timelines = list(timelines)
    if not timelines:
        raise ValueError("plot_comparison needs at least one timeline; got an empty list")
    for i, tl in enumerate(timelines):
        _check_timeline(tl, f"timelines[{i}]")
    names = [tl.name or f"timeline {i}" for i, tl in enumerate(timelines)]
    if labels is not None:
        names = list(labels)
        if len(names) != len(timelines):
            raise ValueError(
                f"got {len(names)} labels for {len(timelines)} timelines; give one label each"
            )
    span = max(tl.step_time for tl in timelines)
    factor, xlabel = time_scale(span, unit)
    heights = [0.75 + _ROW_IN * tl.num_ranks for tl in timelines]
    fig = Figure(figsize=(_WIDTH_IN, sum(heights) + 1.0), layout="constrained")
    axes = fig.subplots(len(timelines), 1, sharex=True, squeeze=False, height_ratios=heights)[:, 0]
    width_in = _axes_width_in(fig, axes[0], True)
    bars: dict[tuple[Op, int], BarContainer] = {}
    for ax, tl, name in zip(axes, timelines, names, strict=True):
        bars.update(_draw_gantt(ax, tl, factor, span * factor, width_in))
        ax.set_title(_summary(tl, name, unit), loc="left", fontsize="medium")
    axes[-1].set_xlabel(xlabel)
    if title is not None:
        fig.suptitle(title)
    handles = _legend_handles(bars)
    fig.legend(handles=handles, loc="outside lower center", ncol=_columns(bars), frameon=False)
    return save(fig, path)


def plot_memory(
    timeline: Timeline,
    path: str | Path | None = None,
    *,
    unit: str | None = None,
    title: str | None = None,
) -> Figure:
    """Activations held per rank over the step: one row per rank (shared axes), held from the
    start of a forward until its backward (or weight-grad when backward is split) ends, in
    (stage, microbatch) units unless the Timeline carries per-stage activation sizes (bytes:
    drawn in KiB, MiB or GiB as the peak needs; or its `activation_unit`)."""
    _check_timeline(timeline, "timeline")
    ranks = timeline.num_ranks
    factor, xlabel = time_scale(timeline.step_time, unit)
    fig = Figure(figsize=(_WIDTH_IN, 1.3 + 0.85 * ranks), layout="constrained")
    axes = fig.subplots(ranks, 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    end = timeline.step_time * factor
    scale, shown = _amount_scale(timeline)
    for rank, ax in enumerate(axes):
        times, amounts = _settled(timeline.memory[rank], factor)
        amounts = [a / scale for a in amounts]
        times.append(end)
        amounts.append(amounts[-1])
        color = stage_color(rank)
        ax.step(times, amounts, where="post", color=color, linewidth=1.4, label=f"rank {rank}")
        ax.fill_between(times, amounts, step="post", color=color, alpha=0.25, linewidth=0)
        peak = timeline.peak_memory[rank]
        ax.set_ylabel(f"rank {rank}", rotation=0, ha="right", va="center")
        ax.text(
            1.005, 0.5, f"peak {_peak(timeline, peak)}", transform=ax.transAxes, va="center",
            fontsize="small",
        )
        ax.grid(alpha=0.3)
        ax.set_axisbelow(True)
        if timeline.activation is None:
            ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=3))
        else:
            ax.yaxis.set_major_locator(MaxNLocator(nbins=3))
    axes[0].set_xlim(0.0, end if end > 0 else 1.0)
    axes[0].set_ylim(bottom=0.0)
    axes[-1].set_xlabel(xlabel)
    what = ("(stage, microbatch) activations" if timeline.activation is None
            else f"activation memory ({shown})")
    head = timeline.name or "timeline"
    fig.suptitle(title if title is not None else f"{head}: {what} held per rank", x=0.01, ha="left")
    return save(fig, path)


def plot_loss(
    losses: Sequence[float],
    path: str | Path | None = None,
    *,
    title: str | None = None,
    xlabel: str = "step",
) -> Figure:
    """The training loss per step as a line, first and last values marked. Returns the Figure."""
    values = [float(v) for v in losses]
    if not values:
        raise ValueError("plot_loss needs at least one loss value; got an empty sequence")
    fig = Figure(figsize=(7.0, 3.6), layout="constrained")
    ax = fig.add_subplot()
    steps = list(range(len(values)))
    ax.plot(steps, values, color=stage_color(0), linewidth=1.6, marker="o", markersize=3)
    ax.margins(x=0.04, y=0.15)  # room for the value labels
    for step in sorted({0, len(values) - 1}):
        ax.annotate(
            f"{values[step]:.3g}",
            (step, values[step]),
            xytext=(0, 6),
            textcoords="offset points",
            ha="center",
            fontsize="small",
        )
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.set_title(title if title is not None else "training loss", loc="left")
    return save(fig, path)


def _settled(
    curve: Sequence[tuple[float, float]], factor: float
) -> tuple[list[float], list[float]]:
    """The curve with only the last amount kept at each instant: a release and an acquire at
    the same time would otherwise draw a zero-width dip."""
    times: list[float] = []
    amounts: list[float] = []
    for t, amount in curve:
        if times and times[-1] == t * factor:
            amounts[-1] = amount
        else:
            times.append(t * factor)
            amounts.append(amount)
    return times, amounts


def _peak(timeline: Timeline, amount: float) -> str:
    """A held amount as the title shows it: a count, or in the Timeline's activation unit."""
    if timeline.activation is None:
        return f"{amount:.3g}"
    return format_amount(amount, timeline.activation_unit)


def _amount_scale(timeline: Timeline) -> tuple[float, str]:
    """The divisor of the memory axis and its unit: bytes in the binary unit of the largest
    peak (KiB, MiB, GiB), other units as they are."""
    if timeline.activation is None:
        return 1.0, "count"
    if timeline.activation_unit != "B":
        return 1.0, timeline.activation_unit
    peak = max(timeline.peak_memory, default=0.0)
    for power, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if peak >= 1024**power:
            return float(1024**power), unit
    return 1.0, "B"


def _check_timeline(timeline: object, what: str) -> None:
    if not isinstance(timeline, Timeline):
        raise TypeError(
            f"{what} must be a scheduler.Timeline, got {type(timeline).__name__}; build one with "
            "scheduler.simulate(...) or take a measured one from Pipeline.trace"
        )


def _figure_of(ax: Axes) -> Figure:
    fig = ax.get_figure()
    if not isinstance(fig, Figure):
        raise TypeError("ax must belong to a matplotlib Figure (got an axes without a figure)")
    return fig


def _axes_width_in(fig: Figure, ax: Axes, own: bool) -> float:
    """The axes' width in inches, less the y labels' room, used to decide which labels fit."""
    if own:  # constrained layout gives the axes all but the rank labels' room
        return fig.get_figwidth() - 1.3
    return max(1.0, fig.get_figwidth() * ax.get_position().width)


def _chunk_of(timeline: Timeline) -> dict[tuple[int, int], int]:
    """(rank, stage) -> that stage's index among the rank's stages (its virtual-stage chunk)."""
    stages: dict[int, set[int]] = {}
    for e in timeline.events:
        stages.setdefault(e.rank, set()).add(e.stage)
    return {
        (rank, stage): i for rank, owned in stages.items() for i, stage in enumerate(sorted(owned))
    }


def _draw_gantt(
    ax: Axes, timeline: Timeline, factor: float, span: float, width_in: float
) -> dict[tuple[Op, int], BarContainer]:
    """Draw one bar per Event into `ax`, rank 0 on top; return the bars per (op, chunk)."""
    t0 = min((e.start for e in timeline.events), default=0.0)
    chunk = _chunk_of(timeline)
    groups: dict[tuple[Op, int], list[Event]] = {}
    for e in timeline.events:
        groups.setdefault((e.op, chunk[e.rank, e.stage]), []).append(e)
    span = span if span > 0 else 1.0
    inch_per_unit = width_in / span
    char_in = 0.64 * _LABEL_PT / 72  # digit width (DejaVu Sans: 0.636 em) at the label size
    bars: dict[tuple[Op, int], BarContainer] = {}
    for (op, c), events in sorted(groups.items(), key=lambda kv: (_OP_ORDER[kv[0][0]], kv[0][1])):
        color = chunk_color(op, c)
        bars[op, c] = ax.barh(
            [e.rank for e in events],
            [e.duration * factor for e in events],
            left=[(e.start - t0) * factor for e in events],
            height=0.8,
            color=color,
            edgecolor="white",
            linewidth=0.6,
            gid=f"{op.value}{c}",
        )
        ink = text_color(color)
        for e in events:
            label = str(e.microbatch)
            if e.duration * factor * inch_per_unit >= char_in * len(label) + 0.02:
                ax.text(
                    (e.start - t0 + e.duration / 2) * factor,
                    e.rank,
                    label,
                    ha="center",
                    va="center",
                    fontsize=_LABEL_PT,
                    color=ink,
                    clip_on=True,
                )
    ranks = timeline.num_ranks
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlim(0.0, span)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    return bars


def _legend_handles(bars: dict[tuple[Op, int], BarContainer]) -> list[Patch]:
    chunks = max((c for _, c in bars), default=0) + 1
    handles = []
    for op, c in sorted(bars, key=lambda k: (_OP_ORDER[k[0]], k[1])):
        name = f"{op.value} {OP_NAMES[op]}"
        label = f"{name}, chunk {c}" if chunks > 1 else name
        handles.append(Patch(facecolor=chunk_color(op, c), label=label))
    return handles


def _columns(bars: dict[tuple[Op, int], BarContainer]) -> int:
    """One legend column per op, so chunks of an op stack in its column."""
    return max(1, len({op for op, _ in bars}))


def _summary(timeline: Timeline, name: str, unit: str | None) -> str:
    head = name or "timeline"
    if timeline.activation is None:
        held = f"peak in-flight {max(timeline.peak_inflight, default=0)}"
    else:
        held = f"peak memory {_peak(timeline, max(timeline.peak_memory, default=0.0))}"
    return (
        f"{head}: step {format_time(timeline.step_time, unit)}, "
        f"bubble {timeline.bubble_fraction:.1%}, {held}"
    )
