"""Picture of a partition Plan: predicted time per stage (forward, backward and communication
stacked) against the lower bound, and optionally the captured graph coloured by stage (condensed
by module for large graphs)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import networkx as nx
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch

from scheduler import Op, format_bytes
from viz.style import OP_COLORS, format_time, save, stage_color, stage_marker, time_scale

COMM_COLOR = "#999999"
UNPLACED_COLOR = "#DDDDDD"
_PLAN_FIELDS = (
    "stages",
    "forward_times",
    "backward_times",
    "stage_costs",
    "cut_bytes",
    "imbalance",
    "lower_bound",
    "method",
)


class PlanLike(Protocol):
    """What plot_partition reads from a Plan (partitioner.Plan has all of it)."""

    @property
    def stages(self) -> Sequence[Sequence[str]]: ...
    @property
    def forward_times(self) -> Sequence[float]: ...
    @property
    def backward_times(self) -> Sequence[float]: ...
    @property
    def stage_costs(self) -> Sequence[float]: ...
    @property
    def cut_bytes(self) -> Sequence[float]: ...
    @property
    def imbalance(self) -> float: ...
    @property
    def lower_bound(self) -> float: ...
    @property
    def method(self) -> str: ...


def plot_partition(
    plan: PlanLike,
    path: str | Path | None = None,
    graph: nx.DiGraph | None = None,
    *,
    max_nodes: int = 60,
    title: str | None = None,
    stage_notes: Sequence[str] | None = None,
) -> Figure:
    """Per-stage predicted time, forward/backward/transfer stacked (transfer is stage_costs
    minus forward and backward), with the lower bound as a dashed line, each boundary's cut
    size, and the imbalance in the title. Times are in seconds. A plan without profiled times
    (balanced by parameters or node count) shows parameter bytes per stage instead.

    With `graph` (from partitioner.capture), a second panel draws its nodes in execution order
    coloured by stage; a graph of more than `max_nodes` nodes is condensed into one node per
    (stage, module prefix), sized by how many nodes it holds. `stage_notes`: a line per stage
    under its tick (the tensor-parallel plan there, partitioner.tp_work.stage_lines). Returns
    the Figure.
    """
    missing = [name for name in _PLAN_FIELDS if not hasattr(plan, name)]
    if missing:
        raise TypeError(
            f"plot_partition needs a Plan (partitioner.partition's result); "
            f"{type(plan).__name__} lacks {', '.join(missing)}"
        )
    if max_nodes < 2:
        raise ValueError(f"max_nodes must be at least 2, got {max_nodes}")
    num_stages = len(plan.stages)
    if stage_notes is not None and len(stage_notes) != num_stages:
        raise ValueError(f"stage_notes has {len(stage_notes)} lines for {num_stages} stages")
    for name in ("forward_times", "backward_times", "stage_costs"):
        if len(getattr(plan, name)) != num_stages:
            raise ValueError(
                f"plan.{name} has {len(getattr(plan, name))} entries for {num_stages} stages"
            )
    if graph is None:
        fig = Figure(figsize=(max(6.0, 1.2 * num_stages + 3.0), 4.2), layout="constrained")
        _draw_costs(fig.add_subplot(), plan, stage_notes)
    else:
        items, edges, condensed = _graph_items(graph, plan, max_nodes)
        cols = min(len(items), 12)
        rows = max(1, math.ceil(len(items) / max(cols, 1)))
        fig = Figure(figsize=(11.0, 4.6 + 1.15 * rows), layout="constrained")
        top, bottom = fig.subplots(2, 1, height_ratios=[4.0, 1.15 * rows + 0.6])
        _draw_costs(top, plan, stage_notes)
        _draw_graph(bottom, graph, items, edges, condensed, cols, num_stages)
    if title is not None:
        fig.suptitle(title, x=0.01, ha="left", fontweight="bold")
    return save(fig, path)


def _draw_costs(ax: Axes, plan: PlanLike, notes: Sequence[str] | None = None) -> None:
    n = len(plan.stages)
    forward = [float(t) for t in plan.forward_times]
    backward = [float(t) for t in plan.backward_times]
    comm = [
        max(0.0, float(c) - f - b)
        for c, f, b in zip(plan.stage_costs, forward, backward, strict=True)
    ]
    peak = max(
        [f + b + c for f, b, c in zip(forward, backward, comm, strict=True)]
        + [float(plan.lower_bound)]
    )
    if max(forward + backward, default=0.0) <= 0:
        # Not profiled (balanced by parameters or node count): show what was balanced.
        _draw_sizes(ax, plan, notes)
        return
    factor, label = time_scale(peak, "s")
    xs = list(range(n))
    bottom = [0.0] * n
    for values, color, name, hatch in (
        (forward, OP_COLORS[Op.F], "forward", ""),
        (backward, OP_COLORS[Op.B], "backward", ""),
        (comm, COMM_COLOR, "transfer", "//"),
    ):
        ax.bar(
            xs,
            [v * factor for v in values],
            bottom=bottom,
            color=color,
            edgecolor="white",
            hatch=hatch,
            label=name,
            width=0.65,
        )
        bottom = [b + v * factor for b, v in zip(bottom, values, strict=True)]
    ax.axhline(
        float(plan.lower_bound) * factor,
        color="black",
        linestyle="--",
        linewidth=1.2,
        label=f"lower bound {format_time(float(plan.lower_bound), 's')}",
    )
    for x, total in zip(xs, bottom, strict=True):
        ax.text(x, total, f"{total:.3g}", ha="center", va="bottom", fontsize="small")
    _stage_axis(ax, plan, peak * factor, notes)
    ax.set_ylabel(f"predicted {label}")
    ax.set_title(
        f"partition ({plan.method}): imbalance {float(plan.imbalance):.3g} (max / mean), "
        f"bottleneck {format_time(max(plan.stage_costs, default=0.0), 's')} "
        f"vs lower bound {format_time(float(plan.lower_bound), 's')}",
        loc="left",
    )


def _draw_sizes(ax: Axes, plan: PlanLike, notes: Sequence[str] | None = None) -> None:
    """Parameter bytes per stage (node counts when the plan has none), for unprofiled plans."""
    params = getattr(plan, "stage_params", None)
    if params is not None and len(params) == len(plan.stages) and sum(params) > 0:
        values = [float(p) / 2**20 for p in params]
        what, ylabel = "parameters", "parameters (MiB)"
    else:
        values = [float(len(nodes)) for nodes in plan.stages]
        what, ylabel = "nodes", "nodes"
    ax.bar(range(len(values)), values, color=OP_COLORS[Op.F], width=0.65, label=what)
    for x, value in enumerate(values):
        ax.text(x, value, f"{value:.3g}", ha="center", va="bottom", fontsize="small")
    mean = sum(values) / len(values) if values else 0.0
    _stage_axis(ax, plan, max(values, default=0.0), notes)
    ax.set_ylabel(ylabel)
    ax.set_title(
        f"partition ({plan.method}): no profiled times; {what} per stage, "
        f"max / mean {max(values) / mean if mean > 0 else 1.0:.3g}",
        loc="left",
    )


def _stage_axis(ax: Axes, plan: PlanLike, top: float, notes: Sequence[str] | None = None
                ) -> None:
    """Stage ticks with node counts (and a note each), cut sizes in the gaps, limits, grid
    and legend."""
    n = len(plan.stages)
    ticks = [f"stage {k}\n{_count(len(nodes), 'node')}" for k, nodes in enumerate(plan.stages)]
    if notes is not None:
        ticks = [f"{t}\n{note}" for t, note in zip(ticks, notes, strict=True)]
    ax.set_xticks(range(n), ticks)
    for k, size in enumerate(plan.cut_bytes[: n - 1]):
        ax.text(  # in the gap between stage k and k+1, where the cut is
            k + 0.5,
            0.02,
            f"cut\n{format_bytes(float(size))}",
            transform=ax.get_xaxis_transform(),
            ha="center",
            va="bottom",
            fontsize="x-small",
            color="#444444",
        )
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylim(0.0, top * 1.15 if top > 0 else 1.0)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize="small")


def _graph_items(
    graph: nx.DiGraph, plan: PlanLike, max_nodes: int
) -> tuple[list[dict[str, Any]], dict[tuple[int, int], float], bool]:
    """The things to draw, in execution order: each {label, stage, count}, plus weighted edges
    between their indices. Nodes themselves when few enough, else (stage, module prefix) groups."""
    stage_of: dict[str, int] = {}
    for k, stage_names in enumerate(plan.stages):
        for name in stage_names:
            stage_of[name] = k
    order = list(nx.topological_sort(graph))
    names = {node: str(graph.nodes[node].get("name", node)) for node in order}
    stage = {node: stage_of.get(names[node], -1) for node in order}
    if len(order) <= max_nodes:
        key = {node: (stage[node], names[node]) for node in order}
        condensed = False
    else:
        key = _condense(graph, order, stage, names, max_nodes)
        condensed = True
    index: dict[tuple[int, str], int] = {}
    items: list[dict[str, Any]] = []
    for node in order:
        group = key[node]
        if group not in index:
            index[group] = len(items)
            items.append({"label": group[1], "stage": group[0], "count": 0})
        items[index[group]]["count"] += 1
    edges: dict[tuple[int, int], float] = {}
    for u, v, data in graph.edges(data=True):
        a, b = index[key[u]], index[key[v]]
        if a != b:
            edges[a, b] = edges.get((a, b), 0.0) + float(data.get("bytes", 0.0) or 0.0)
    return items, edges, condensed


def _condense(
    graph: nx.DiGraph,
    order: list[Any],
    stage: dict[Any, int],
    names: dict[Any, str],
    max_nodes: int,
) -> dict[Any, tuple[int, str]]:
    """Group nodes by (stage, module path prefix), choosing the deepest prefix that keeps at most
    `max_nodes` groups; nodes outside any module join the group of the node run before them in
    the same stage. Falls back to one group per stage."""
    for depth in (3, 2, 1):
        key: dict[Any, tuple[int, str]] = {}
        previous: dict[int, str] = {}
        for node in order:
            module = graph.nodes[node].get("module")
            if module:
                group = ".".join(str(module).split(".")[:depth])
            else:
                group = previous.get(stage[node], names[node])
            previous[stage[node]] = group
            key[node] = (stage[node], group)
        if len(set(key.values())) <= max_nodes:
            return key
    return {node: (stage[node], f"stage {stage[node]}") for node in order}


def _draw_graph(
    ax: Axes,
    graph: nx.DiGraph,
    items: list[dict[str, Any]],
    edges: dict[tuple[int, int], float],
    condensed: bool,
    cols: int,
    num_stages: int,
) -> None:
    """Nodes in execution order, snaking left-to-right then right-to-left, so consecutive
    nodes sit side by side; later-than-next edges (skips) are drawn as arcs."""
    pos = _snake_positions(len(items), cols)
    biggest = max(item["count"] for item in items)
    sizes = [
        80 + 320 * math.sqrt(item["count"] / biggest) if condensed else 110.0 for item in items
    ]
    _draw_edges(ax, edges, pos, sizes)
    _draw_nodes(ax, items, pos, sizes)
    _label_nodes(ax, items, pos, condensed)
    rows = -min(p[1] for p in pos)
    ax.set_xlim(-0.7, cols - 0.3)
    ax.set_ylim(-rows - 0.7, 0.7)
    ax.set_axis_off()
    _stage_legend(ax, sorted({it["stage"] for it in items}))
    what = (
        f"captured graph: {graph.number_of_nodes()} nodes condensed to {len(items)} groups "
        "(module, node count), in execution order"
        if condensed
        else f"captured graph: {graph.number_of_nodes()} nodes in execution order"
    )
    ax.set_title(f"{what}; {num_stages} stages", loc="left", fontsize="medium")


def _snake_positions(count: int, cols: int) -> list[tuple[float, float]]:
    """(x, y) of `count` items laid out in rows of `cols`, every other row right-to-left."""
    pos = []
    for i in range(count):
        row, col = divmod(i, cols)
        column = col if row % 2 == 0 else cols - 1 - col
        pos.append((float(column), -float(row)))
    return pos


def _draw_edges(
    ax: Axes,
    edges: dict[tuple[int, int], float],
    pos: list[tuple[float, float]],
    sizes: list[float],
) -> None:
    """One arrow per edge: straight to the next item, a low arc for skips."""
    for a, b in sorted(edges):
        (xa, ya), (xb, yb) = pos[a], pos[b]
        adjacent = b == a + 1
        # Skips bow out of the row; keep the bow low so it stays inside the panel.
        bow = 0.0 if adjacent else -min(0.35, 0.8 / math.hypot(xb - xa, yb - ya))
        ax.add_patch(
            FancyArrowPatch(
                pos[a],
                pos[b],
                arrowstyle="-|>",
                mutation_scale=7,
                color="#777777" if adjacent else "#AAAAAA",
                linewidth=0.8,
                connectionstyle=f"arc3,rad={bow}",
                shrinkA=math.sqrt(sizes[a]) / 2 + 1,  # marker radius in points, then a gap
                shrinkB=math.sqrt(sizes[b]) / 2 + 1,
                zorder=1,
                gid="edge",
            )
        )


def _draw_nodes(
    ax: Axes,
    items: list[dict[str, Any]],
    pos: list[tuple[float, float]],
    sizes: list[float],
) -> None:
    """The items as markers coloured and shaped by stage (one scatter per marker shape)."""
    colors = [stage_color(it["stage"]) if it["stage"] >= 0 else UNPLACED_COLOR for it in items]
    by_marker: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        by_marker.setdefault(stage_marker(max(item["stage"], 0)), []).append(i)
    for marker, members in by_marker.items():
        ax.scatter(
            [pos[i][0] for i in members],
            [pos[i][1] for i in members],
            s=[sizes[i] for i in members],
            c=[colors[i] for i in members],
            marker=marker,
            edgecolors="black",
            linewidths=0.5,
            zorder=2,
            gid="nodes",
        )


def _label_nodes(
    ax: Axes, items: list[dict[str, Any]], pos: list[tuple[float, float]], condensed: bool
) -> None:
    """Each item's (shortened) label, with its node count when condensed."""
    for i, (item, (x, y)) in enumerate(zip(items, pos, strict=True)):
        label = item["label"] if len(item["label"]) <= 16 else item["label"][:15] + "…"
        if condensed and item["count"] > 1:
            label = f"{label} ({item['count']})"
        above = i % 2 == 1  # alternate sides so neighbours' labels do not collide
        ax.annotate(
            label,
            (x, y),
            xytext=(0, 9 if above else -9),
            textcoords="offset points",
            ha="center",
            va="bottom" if above else "top",
            fontsize=6.5,
        )


def _stage_legend(ax: Axes, shown: list[int]) -> None:
    """A legend entry per stage shown (-1: nodes in no stage), outside the panel on the right."""
    handles = [
        Line2D(
            [],
            [],
            linestyle="",
            marker=stage_marker(max(k, 0)),
            markersize=8,
            markerfacecolor=stage_color(k) if k >= 0 else UNPLACED_COLOR,
            markeredgecolor="black",
            markeredgewidth=0.5,
            label=f"stage {k}" if k >= 0 else "not in any stage",
        )
        for k in shown
    ]
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        frameon=False,
        fontsize="small",
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
