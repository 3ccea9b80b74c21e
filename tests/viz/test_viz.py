"""viz: plots are rendered headless and checked for structure (one bar per event, colours per
op, labels, legends), and Chrome traces against the Trace Event Format."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import networkx as nx
import pytest
from matplotlib.axes import Axes
from matplotlib.collections import PathCollection
from matplotlib.colors import to_hex
from matplotlib.patches import FancyArrowPatch, Rectangle

from scheduler import Event, Op, Timeline, build_schedule, format_bytes, simulate
from viz import (
    plot_comparison,
    plot_loss,
    plot_memory,
    plot_partition,
    plot_timeline,
    to_chrome_trace,
)
from viz.style import OP_COLORS, chunk_color, stage_color

F, B, W = Op.F, Op.B, Op.W


def two_rank_1f1b(t0: float = 0.0, scale: float = 1.0) -> Timeline:
    """2 ranks x 2 microbatches, F=1, B=2: the 1F1B order written out by hand."""
    spans = [
        (0, 0, F, 0, 0, 1),
        (0, 0, F, 1, 1, 2),
        (1, 1, F, 0, 1, 2),
        (1, 1, B, 0, 2, 4),
        (1, 1, F, 1, 4, 5),
        (0, 0, B, 0, 4, 6),
        (1, 1, B, 1, 5, 7),
        (0, 0, B, 1, 7, 9),
    ]
    events = tuple(
        Event(r, s, op, m, t0 + a * scale, t0 + b * scale) for r, s, op, m, a, b in spans
    )
    return Timeline(events, num_ranks=2, splits_backward=False, name="1f1b")


def chunked_split() -> Timeline:
    """2 ranks, 2 chunks each (stages 0,2 on rank 0; 1,3 on rank 1), split backward."""
    events = []
    t = {0: 0.0, 1: 0.0}
    for stage in (0, 1, 2, 3):
        rank = stage % 2
        t[rank] = max(t.values())
        events.append(Event(rank, stage, F, 0, t[rank], t[rank] + 1))
        t[rank] += 1
    for stage in (3, 2, 1, 0):
        rank = stage % 2
        t[rank] = max(t.values())
        events.append(Event(rank, stage, B, 0, t[rank], t[rank] + 1))
        events.append(Event(rank, stage, W, 0, t[rank] + 1, t[rank] + 2))
        t[rank] += 2
    return Timeline(tuple(events), num_ranks=2, splits_backward=True, name="chunked")


def bars_of(ax: Axes) -> list[Rectangle]:
    return [bar for container in ax.containers for bar in container]


def digit_texts(ax: Axes) -> list[str]:
    return [t.get_text() for t in ax.texts if t.get_text().isdigit()]


# ------------------------------------------------------------------------------ plot_timeline


def test_timeline_has_one_bar_per_event_at_its_place_and_colour() -> None:
    tl = two_rank_1f1b()
    fig = plot_timeline(tl)
    ax = fig.axes[0]
    bars = bars_of(ax)
    assert len(bars) == len(tl.events)
    drawn = sorted(
        (round(b.get_y() + b.get_height() / 2), b.get_x(), b.get_width(), to_hex(b.get_facecolor()))
        for b in bars
    )
    expected = sorted((e.rank, e.start, e.duration, OP_COLORS[e.op].lower()) for e in tl.events)
    assert drawn == expected
    # Idle time stays blank: each rank's bars cover exactly its busy time.
    for rank in range(tl.num_ranks):
        covered = sum(w for r, _, w, _ in drawn if r == rank)
        assert covered == pytest.approx(sum(e.duration for e in tl.for_rank(rank)))
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    assert ax.get_ylim()[0] > ax.get_ylim()[1]  # rank 0 on top


def test_timeline_title_legend_and_microbatch_labels() -> None:
    tl = two_rank_1f1b()
    fig = plot_timeline(tl)
    ax = fig.axes[0]
    title = ax.get_title(loc="left")
    assert "1f1b" in title
    assert f"{tl.step_time:.3g}" in title
    assert f"{tl.bubble_fraction:.1%}" in title
    assert len(fig.legends) == 1
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["F forward", "B backward"]
    # Every block is wide enough here: one label per event, each its microbatch.
    assert sorted(digit_texts(ax)) == sorted(str(e.microbatch) for e in tl.events)


def test_narrow_blocks_get_no_label() -> None:
    wide = [Event(0, 0, F, 0, 0.0, 50.0), Event(0, 0, B, 0, 50.0, 100.0)]
    narrow = [Event(0, 0, F, 7, 100.0, 100.01)]
    fig = plot_timeline(Timeline(tuple(wide + narrow), 1, False, name="x"))
    assert sorted(digit_texts(fig.axes[0])) == ["0", "0"]


def test_virtual_stages_and_weight_grads_get_their_own_shades() -> None:
    tl = chunked_split()
    fig = plot_timeline(tl)
    colours = {
        (round(b.get_y() + 0.4), b.get_x()): to_hex(b.get_facecolor()) for b in bars_of(fig.axes[0])
    }
    for e in tl.events:
        chunk = 0 if e.stage < 2 else 1
        assert colours[e.rank, e.start] == chunk_color(e.op, chunk)
    assert len({chunk_color(op, c) for op in (F, B, W) for c in (0, 1)}) == 6
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "F forward, chunk 1" in labels and "W weight grad, chunk 0" in labels
    assert len(labels) == 6


def test_measured_seconds_start_at_zero_in_readable_units() -> None:
    tl = two_rank_1f1b(t0=5000.0, scale=1e-3)  # perf_counter-like clock, ms-long blocks
    ax = plot_timeline(tl, unit="s").axes[0]
    assert min(b.get_x() for b in bars_of(ax)) == pytest.approx(0.0)
    assert max(b.get_x() + b.get_width() for b in bars_of(ax)) == pytest.approx(9.0)
    assert ax.get_xlabel() == "time (ms)"
    assert "9 ms" in ax.get_title(loc="left")


def test_empty_timeline_draws_empty_rows() -> None:
    ax = plot_timeline(Timeline((), 3, False, name="nothing ran")).axes[0]
    assert bars_of(ax) == []
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1", "rank 2"]


def test_timeline_draws_into_given_axes() -> None:
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.add_subplot()
    assert plot_timeline(two_rank_1f1b(), ax=ax, title="mine") is fig
    assert ax.get_title(loc="left") == "mine"
    assert len(bars_of(ax)) == 8
    assert ax.get_legend() is not None


@pytest.mark.parametrize(
    ("suffix", "magic"), [(".png", b"\x89PNG"), (".svg", b"<?xml"), (".pdf", b"%PDF")]
)
def test_writes_format_by_extension(tmp_path: Path, suffix: str, magic: bytes) -> None:
    path = tmp_path / "sub" / f"t{suffix}"
    plot_timeline(two_rank_1f1b(), path)
    assert path.read_bytes().startswith(magic)


def test_bad_inputs_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'\.jpgx'.*\.png, \.svg, \.pdf"):
        plot_timeline(two_rank_1f1b(), tmp_path / "t.jpgx")
    with pytest.raises(TypeError, match="scheduler.Timeline"):
        plot_timeline([1, 2])  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- plot_comparison


def test_comparison_stacks_timelines_on_one_axis() -> None:
    fast, slow = two_rank_1f1b(), chunked_split()
    fig = plot_comparison([fast, slow], labels=["predicted", "measured"])
    axes = fig.axes
    assert len(axes) == 2
    assert [len(bars_of(ax)) for ax in axes] == [len(fast.events), len(slow.events)]
    assert axes[0].get_xlim() == axes[1].get_xlim()
    assert axes[0].get_xlim()[1] == pytest.approx(max(fast.step_time, slow.step_time))
    for ax, tl, label in zip(axes, (fast, slow), ("predicted", "measured"), strict=True):
        title = ax.get_title(loc="left")
        assert title.startswith(label)
        assert f"{tl.step_time:.3g}" in title and f"{tl.bubble_fraction:.1%}" in title
    assert len(fig.legends) == 1


def test_comparison_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="at least one"):
        plot_comparison([])
    with pytest.raises(ValueError, match="2 labels for 1 timelines"):
        plot_comparison([two_rank_1f1b()], labels=["a", "b"])


# -------------------------------------------------------------------------------- plot_memory


def test_memory_has_one_panel_per_rank_following_the_curve() -> None:
    tl = two_rank_1f1b()
    fig = plot_memory(tl)
    assert len(fig.axes) == tl.num_ranks
    for rank, ax in enumerate(fig.axes):
        line = ax.lines[0]
        xs, ys = list(line.get_xdata()), list(line.get_ydata())
        assert max(ys) == tl.peak_memory[rank] == tl.peak_inflight[rank]
        assert xs[-1] == pytest.approx(tl.step_time) and ys[-1] == 0.0
        assert len(set(xs[:-1])) == len(xs) - 1  # one amount per instant
        assert any(t.get_text() == f"peak {tl.peak_memory[rank]:.3g}" for t in ax.texts)
    assert [ax.get_ylabel() for ax in fig.axes] == ["rank 0", "rank 1"]


def test_memory_in_bytes_is_drawn_in_mib_and_titled_so() -> None:
    tl = two_rank_1f1b()
    sized = Timeline(tl.events, tl.num_ranks, tl.splits_backward, name="1f1b",
                     activation=(3 * 2**20, 5 * 2**20))
    fig = plot_memory(sized)
    assert "activation memory (MiB)" in fig.get_suptitle()
    for rank, ax in enumerate(fig.axes):
        assert max(ax.lines[0].get_ydata()) == sized.peak_memory[rank] / 2**20
        assert any(t.get_text() == f"peak {format_bytes(sized.peak_memory[rank])}"
                   for t in ax.texts)
    assert "peak memory 6 MiB" in plot_timeline(sized).axes[0].get_title(loc="left")
    units = Timeline(tl.events, tl.num_ranks, tl.splits_backward, activation=(0.5, 0.5),
                     activation_unit="microbatch")
    assert "peak memory 1 microbatch" in plot_timeline(units).axes[0].get_title(loc="left")


def test_memory_has_no_zero_width_dips() -> None:
    # Rank 0 frees microbatch 0 at t=3 and starts microbatch 1 at t=3: held stays at 1.
    events = (
        Event(0, 0, F, 0, 0.0, 1.0),
        Event(0, 0, B, 0, 1.0, 3.0),
        Event(0, 0, F, 1, 3.0, 4.0),
        Event(0, 0, B, 1, 4.0, 6.0),
    )
    line = plot_memory(Timeline(events, 1, False)).axes[0].lines[0]
    assert list(line.get_xdata()) == [0.0, 3.0, 6.0, 6.0]
    assert list(line.get_ydata()) == [1.0, 1.0, 0.0, 0.0]


# ----------------------------------------------------------------------------- plot_partition


@dataclass(frozen=True)
class FakePlan:
    stages: list[list[str]]
    forward_times: list[float]
    backward_times: list[float]
    stage_costs: list[float]
    cut_bytes: list[int]
    imbalance: float
    lower_bound: float
    method: str = "profile"
    stage_memory: list[float] = field(default_factory=list)


def chain_plan(n: int, stages: int) -> tuple[FakePlan, nx.DiGraph]:
    names = [f"n{i}" for i in range(n)]
    graph = nx.DiGraph()
    for i, name in enumerate(names):
        graph.add_node(name, name=name, module=f"blocks.{i // 3}.part{i % 3}")
    nx.add_path(graph, names, bytes=1024)
    graph.add_edge(names[0], names[-1], bytes=2048)  # a long skip
    size = n // stages
    parts = [names[k * size : (k + 1) * size] for k in range(stages - 1)]
    parts.append(names[(stages - 1) * size :])
    forward = [1e-3 * (k + 1) for k in range(stages)]
    backward = [2 * f for f in forward]
    costs = [3 * f + 5e-4 for f in forward]
    plan = FakePlan(
        stages=parts,
        forward_times=forward,
        backward_times=backward,
        stage_costs=costs,
        cut_bytes=[1024] * (stages - 1),
        imbalance=max(costs) / (sum(costs) / stages),
        lower_bound=sum(forward + backward) / stages,
    )
    return plan, graph


def test_partition_bars_stack_forward_backward_transfer_under_a_bound() -> None:
    plan, _ = chain_plan(12, 3)
    fig = plot_partition(plan)
    ax = fig.axes[0]
    assert len(ax.containers) == 3
    forward, backward, transfer = ([b.get_height() for b in c] for c in ax.containers)
    # Times are drawn in ms here; the stacks are forward, backward, then the rest of the cost.
    assert forward == pytest.approx([1e3 * t for t in plan.forward_times])
    assert backward == pytest.approx([1e3 * t for t in plan.backward_times])
    assert transfer == pytest.approx([0.5] * 3)
    bound = [line for line in ax.lines if line.get_linestyle() == "--"]
    assert len(bound) == 1 and bound[0].get_ydata()[0] == pytest.approx(1e3 * plan.lower_bound)
    assert f"{plan.imbalance:.3g}" in ax.get_title(loc="left")
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "stage 0\n4 nodes",
        "stage 1\n4 nodes",
        "stage 2\n4 nodes",
    ]
    assert sum("cut\n1 KiB" == t.get_text() for t in ax.texts) == 2
    assert ax.get_legend() is not None


@dataclass(frozen=True)
class UnprofiledPlan(FakePlan):
    stage_params: list[int] = field(default_factory=list)


def test_unprofiled_plan_shows_what_was_balanced() -> None:
    plan, _ = chain_plan(10, 2)
    zeros = {"forward_times": [0.0] * 2, "backward_times": [0.0] * 2, "stage_costs": [0.0] * 2}
    by_params = UnprofiledPlan(
        **{**plan.__dict__, **zeros, "method": "parameters"}, stage_params=[2**20, 3 * 2**20]
    )
    ax = plot_partition(by_params).axes[0]
    assert [b.get_height() for b in bars_of(ax)] == [1.0, 3.0]
    assert ax.get_ylabel() == "parameters (MiB)"
    assert "max / mean 1.5" in ax.get_title(loc="left")
    by_count = FakePlan(**{**plan.__dict__, **zeros, "method": "uniform"})
    ax = plot_partition(by_count).axes[0]
    assert [b.get_height() for b in bars_of(ax)] == [5.0, 5.0]
    assert ax.get_ylabel() == "nodes"


def test_partition_graph_nodes_coloured_by_stage() -> None:
    plan, graph = chain_plan(12, 3)
    fig = plot_partition(plan, graph=graph)
    assert len(fig.axes) == 2
    gax = fig.axes[1]
    (nodes,) = [c for c in gax.collections if isinstance(c, PathCollection)]
    colours = [to_hex(c) for c in nodes.get_facecolors()]
    expected = [to_hex(stage_color(k)) for k, part in enumerate(plan.stages) for _ in part]
    assert colours == expected
    arrows = [p for p in gax.patches if isinstance(p, FancyArrowPatch)]
    assert len(arrows) == graph.number_of_edges()
    assert [t.get_text() for t in gax.get_legend().get_texts()] == [
        "stage 0",
        "stage 1",
        "stage 2",
    ]


def test_large_graph_is_condensed_by_module() -> None:
    plan, graph = chain_plan(60, 4)
    fig = plot_partition(plan, graph=graph, max_nodes=30)
    gax = fig.axes[1]
    (nodes,) = [c for c in gax.collections if isinstance(c, PathCollection)]
    assert len(nodes.get_offsets()) == 20  # blocks.0 .. blocks.19 (each within one stage)
    assert "condensed to 20 groups" in gax.get_title(loc="left")
    assert any(t.get_text() == "blocks.0 (3)" for t in gax.texts)
    # Fewer allowed groups than modules: one group per stage.
    fig = plot_partition(plan, graph=graph, max_nodes=4)
    (nodes,) = [c for c in fig.axes[1].collections if isinstance(c, PathCollection)]
    assert len(nodes.get_offsets()) == 4


def test_partition_rejects_what_is_not_a_plan() -> None:
    with pytest.raises(TypeError, match="lacks .*lower_bound"):
        plot_partition(object())  # type: ignore[arg-type]
    plan, _ = chain_plan(6, 2)
    bad = FakePlan(**{**plan.__dict__, "forward_times": [1.0]})
    with pytest.raises(ValueError, match="forward_times has 1 entries for 2 stages"):
        plot_partition(bad)


# ---------------------------------------------------------------------------- to_chrome_trace


def check_trace_format(trace: dict[str, Any], tl: Timeline) -> list[dict[str, Any]]:
    """The Trace Event Format's JSON object form, as Perfetto and chrome://tracing read it."""
    assert isinstance(trace["traceEvents"], list)
    json.dumps(trace)  # JSON-able
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert len(complete) == len(tl.events)
    assert len(complete) + len(meta) == len(trace["traceEvents"])
    for e in complete:
        assert set(e) >= {"name", "ph", "ts", "dur", "pid", "tid", "args"}
        assert isinstance(e["pid"], int) and e["ts"] >= 0 and e["dur"] >= 0
        assert set(e["args"]) == {"stage", "op", "microbatch"}
    names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(tl.num_ranks)}
    return complete


def test_chrome_trace_of_measured_seconds(tmp_path: Path) -> None:
    tl = two_rank_1f1b(t0=1234.5, scale=1e-3)
    path = tmp_path / "trace.json"
    trace = to_chrome_trace(tl, path)
    assert json.loads(path.read_text()) == trace
    complete = check_trace_format(trace, tl)
    t0 = min(e.start for e in tl.events)
    expected = sorted(
        (e.rank, e.op.value, e.stage, e.microbatch, (e.start - t0) * 1e6, e.duration * 1e6)
        for e in tl.events
    )
    got = sorted(
        (e["pid"], e["args"]["op"], e["args"]["stage"], e["args"]["microbatch"], e["ts"], e["dur"])
        for e in complete
    )
    for g, x in zip(got, expected, strict=True):
        assert g[:4] == x[:4]
        assert g[4:] == pytest.approx(x[4:], abs=1e-3)
    assert trace["otherData"]["bubble_fraction"] == tl.bubble_fraction


def test_chrome_trace_of_a_simulated_schedule() -> None:
    schedule = build_schedule("zbv", 2, 4)
    tl = simulate(schedule, 1.0, 1.0, 1.0)
    trace = to_chrome_trace(tl, seconds_per_unit=1e-3)
    complete = check_trace_format(trace, tl)
    assert len(complete) == sum(len(acts) for acts in schedule.actions)
    # Complete events on one rank never overlap (one compute stream per rank).
    for rank in range(2):
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in complete if e["pid"] == rank)
        assert all(a[1] <= b[0] + 1e-6 for a, b in pairwise(spans))
    assert max(e["ts"] + e["dur"] for e in complete) == pytest.approx(tl.step_time * 1e3)
    with pytest.raises(ValueError, match="seconds_per_unit"):
        to_chrome_trace(tl, seconds_per_unit=0.0)


# ---------------------------------------------------------------------------------- plot_loss


def test_loss_curve_follows_the_values(tmp_path: Path) -> None:
    losses = [5.0, 4.0, 3.5, 3.25]
    fig = plot_loss(losses, tmp_path / "loss.png", title="demo")
    ax = fig.axes[0]
    (line,) = ax.lines
    assert list(line.get_xdata()) == [0, 1, 2, 3]
    assert list(line.get_ydata()) == losses
    assert [t.get_text() for t in ax.texts] == ["5", "3.25"]
    assert ax.get_title(loc="left") == "demo" and ax.get_ylabel() == "loss"
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="at least one loss"):
        plot_loss([])
