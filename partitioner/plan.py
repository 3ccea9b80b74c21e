"""Partition a captured graph into pipeline stages and describe the result as a `Plan`.

Stages are contiguous segments of the graph's topological order, so every stage is a valid
sub-module and every cut is a set of tensors. The objective per stage is compute (forward +
backward) / device speed plus the transfer of every value crossing its two boundaries (skip
connections included) at `bandwidth` bytes/s and `latency` s per cut, subject to a per-device
memory cap of parameters x optimizer_factor + activations x in-flight microbatches; the solver
(`solver.min_max_partition`) finds the exact min-max over that order."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import networkx as nx
import numpy as np

from partitioner.cuts import cut_arrays, spans
from partitioner.solver import check_stages, evenly, min_max_partition

METHODS = ("profile", "parameters", "uniform")


@dataclass
class Plan:
    """A partition: node names per stage and what the cost model predicts for it.

    Times are seconds; bytes are bytes. `stage_costs[k]` = (forward + backward) / speed + the
    transfer at both boundaries; `lower_bound` = max(total compute / total speed, heaviest node /
    fastest speed); `bound_ratio` = max(stage_costs) / lower_bound; `imbalance` = max / mean.
    `dynamic_dims`: the captured inputs' dynamic dims as "name[dim]" (torch.export; every other
    dim is static; None for a torch.fx capture, which keeps no shapes). `shared`: unit -> the
    identical unit (same ops and shapes) whose profiled measurement it reuses."""

    stages: list[list[str]]
    forward_times: list[float]
    backward_times: list[float]
    stage_costs: list[float]
    stage_memory: list[float]
    stage_params: list[int]
    cut_bytes: list[int]
    imbalance: float
    bound_ratio: float
    lower_bound: float
    method: str
    dynamic_dims: list[str] | None = None
    shared: dict[str, str] = field(default_factory=dict)

    @property
    def sizes(self) -> list[int]:
        """Nodes per stage (a valid `balance` list that reproduces this plan)."""
        return [len(s) for s in self.stages]

    @property
    def bottleneck(self) -> float:
        """The slowest stage's predicted time: what bounds the pipeline's throughput."""
        return max(self.stage_costs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        header = (
            f"{'stage':>5}  {'first node':<20} {'last node':<20} {'nodes':>5} {'params':>10} "
            f"{'fwd ms':>9} {'bwd ms':>9} {'bytes out':>10} {'pred ms':>9}"
        )
        rows = [f"Plan ({self.method}): {len(self.stages)} stages", header]
        for k, names in enumerate(self.stages):
            out = self.cut_bytes[k] if k < len(self.cut_bytes) else 0
            rows.append(
                f"{k:>5}  {names[0][:20]:<20} {names[-1][:20]:<20} {len(names):>5} "
                f"{_size(self.stage_params[k]):>10} {1e3 * self.forward_times[k]:>9.3f} "
                f"{1e3 * self.backward_times[k]:>9.3f} {_size(out):>10} "
                f"{1e3 * self.stage_costs[k]:>9.3f}"
            )
        rows.append(
            f"bottleneck {1e3 * self.bottleneck:.3f} ms, lower bound {1e3 * self.lower_bound:.3f}"
            f" ms, bound ratio {self.bound_ratio:.3f}, imbalance {self.imbalance:.3f}"
        )
        if self.dynamic_dims is not None:
            rows.append(
                f"dynamic dims: {', '.join(self.dynamic_dims) or 'none'} (others static; a "
                "later batch that changes one is captured again with it dynamic)"
            )
        if self.shared:
            measured = sorted(set(self.shared.values()))
            rows.append(
                f"{len(self.shared)} units reuse the measurement of an identical unit: "
                + "; ".join(
                    f"{', '.join(u for u, m in self.shared.items() if m == first)} as {first}"
                    for first in measured
                )
            )
        return "\n".join(rows)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _per_stage(value: object, stages: int, name: str, default: float | None) -> np.ndarray:
    """Broadcast a scalar or check a per-stage list."""
    if value is None:
        return np.full(stages, np.inf if default is None else default)
    if isinstance(value, int | float):
        return np.full(stages, float(value))
    if isinstance(value, Sequence) and len(value) == stages:
        return np.asarray(value, dtype=np.float64)
    raise ValueError(
        f"{name} must be a number or a list of {stages} numbers (one per stage), got {value!r}"
    )


def _node_array(graph: nx.DiGraph, order: list[str], key: str, fallback: str | None) -> np.ndarray:
    nodes = graph.nodes
    if fallback is None:
        return np.array([float(nodes[v].get(key, 0.0)) for v in order])
    return np.array([float(nodes[v].get(key, nodes[v][fallback])) for v in order])


def partition(
    graph: nx.DiGraph,
    stages: int,
    balance: str | Sequence[int] = "profile",
    *,
    device_speeds: Sequence[float] | None = None,
    bandwidth: float | None = None,
    latency: float = 0.0,
    memory_cap: float | Sequence[float] | None = None,
    inflight: int | Sequence[int] | None = None,
    optimizer_factor: float = 4.0,
) -> Plan:
    """Split a captured (and, for balance="profile", profiled) graph into `stages` stages.

    balance: "profile" (exact min-max of profiled time plus transfer), "parameters" (min-max of
    parameter bytes), "uniform" (equal node counts) or an explicit list of node counts per stage.
    device_speeds: relative speed of each stage's device (default all 1). bandwidth: bytes/s
    between stages (None: transfers are free apart from `latency`). memory_cap: bytes per device
    (a number or one per stage); memory = parameter bytes x optimizer_factor (default 4: weights,
    grads and Adam's two moments) + activation bytes x inflight (default p - k, as in 1F1B).
    """
    order: list[str] = graph.graph["order"]
    n = len(order)
    p = check_stages(stages, n)
    speeds = _per_stage(device_speeds, p, "device_speeds", 1.0)
    if np.any(speeds <= 0):
        raise ValueError(f"device_speeds must all be > 0, got {list(speeds)}")
    if bandwidth is not None and bandwidth <= 0:
        raise ValueError(
            f"bandwidth must be > 0 bytes/s (or None for free transfer), got {bandwidth}"
        )
    if latency < 0:
        raise ValueError(f"latency must be >= 0 seconds, got {latency}")
    caps = _per_stage(memory_cap, p, "memory_cap", None)
    flights = (
        np.arange(p, 0, -1, dtype=np.float64)
        if inflight is None
        else _per_stage(inflight, p, "inflight", None)
    )

    profiled = all("forward_time" in graph.nodes[v] for v in order)
    fwd = _node_array(graph, order, "forward_time", None)
    bwd = _node_array(graph, order, "backward_time", None)
    params = _node_array(graph, order, "param_bytes", None)
    acts = _node_array(graph, order, "activation_bytes", "bytes")
    compute = fwd + bwd

    cut_size, cut_ok = cut_arrays(spans(graph), n)
    transfer = cut_size / bandwidth if bandwidth is not None else np.zeros(n + 1)
    transfer = np.where(cut_size > 0, transfer + latency, 0.0)
    transfer[0] = transfer[n] = 0.0  # the model's inputs and output are not sent anywhere
    # Only cut where everything crossing is a tensor: other cuts cost infinity.
    barrier = np.where(cut_ok, 0.0, np.inf)
    barrier[0] = barrier[n] = 0.0

    prefix = {
        "compute": np.concatenate(([0.0], np.cumsum(compute))),
        "params": np.concatenate(([0.0], np.cumsum(params))),
        "acts": np.concatenate(([0.0], np.cumsum(acts))),
        "count": np.arange(n + 1, dtype=np.float64),
    }

    def memory(k: int, end: int, starts: np.ndarray) -> np.ndarray:
        held_params = prefix["params"][end] - prefix["params"][starts]
        held_acts = prefix["acts"][end] - prefix["acts"][starts]
        return held_params * optimizer_factor + held_acts * flights[k]

    def objective(key: str, with_transfer: bool, with_memory: bool) -> Any:
        def cost(k: int, end: int, starts: np.ndarray) -> np.ndarray:
            value = prefix[key][end] - prefix[key][starts]
            if key == "compute":
                value = value / speeds[k]
            value = value + barrier[starts] + barrier[end]
            if with_transfer:
                value = value + transfer[starts] + transfer[end]
            if with_memory:
                value = np.where(memory(k, end, starts) > caps[k], np.inf, value)
            return value

        return cost

    method: str
    if isinstance(balance, str):
        if balance not in METHODS:
            raise ValueError(
                f"unknown balance {balance!r}; use one of {', '.join(METHODS)} or a list of "
                f"node counts per stage"
            )
        method = balance
        if balance == "profile" and graph.graph.get("costs") == "estimate":
            method = "profile, estimated on meta: FLOPs + bytes"
        if balance == "profile" and not profiled:
            raise ValueError(
                "balance='profile' needs forward/backward times on the graph: call "
                "partitioner.profile(graph, model, example_inputs) first, or use "
                "balance='parameters' or 'uniform'"
            )
        with_memory = memory_cap is not None
        if balance == "uniform" and all(np.isfinite(barrier[np.cumsum(evenly(n, p))])):
            sizes = evenly(n, p)
            bottleneck = 0.0
            if with_memory:
                bottleneck = _check_memory_of(sizes, memory, caps)
        else:
            key = {"profile": "compute", "parameters": "params", "uniform": "count"}[balance]
            sizes, bottleneck = min_max_partition(
                n, p, objective(key, balance == "profile", with_memory)
            )
        if not math.isfinite(bottleneck):
            _explain_infeasible(n, p, objective, memory, caps, barrier, cut_ok)
    else:
        method = "explicit"
        sizes = _check_balance(balance, n, p)
        bounds = np.cumsum([0, *sizes])
        bad = [int(c) for c in bounds[1:-1] if not cut_ok[c]]
        if bad:
            raise ValueError(
                f"balance {list(sizes)} cuts the graph where a non-tensor value crosses (after "
                f"node(s) {', '.join(order[c - 1] for c in bad)}); move those cuts by a node or "
                f"use balance='profile'"
            )
        if memory_cap is not None and not math.isfinite(_check_memory_of(sizes, memory, caps)):
            _explain_over_cap(sizes, memory, caps, f"balance {sizes}")

    bounds = np.cumsum([0, *sizes])
    stage_nodes = [order[bounds[k] : bounds[k + 1]] for k in range(p)]
    fwd_s = [float(fwd[bounds[k] : bounds[k + 1]].sum()) for k in range(p)]
    bwd_s = [float(bwd[bounds[k] : bounds[k + 1]].sum()) for k in range(p)]
    costs = [
        (fwd_s[k] + bwd_s[k]) / float(speeds[k])
        + float(transfer[bounds[k]] + transfer[bounds[k + 1]])
        for k in range(p)
    ]
    mem = [float(memory(k, int(bounds[k + 1]), np.array([bounds[k]]))[0]) for k in range(p)]
    lower = max(float(compute.sum() / speeds.sum()), float(compute.max() / speeds.max()))
    worst, mean = max(costs), sum(costs) / p
    return Plan(
        stages=stage_nodes,
        forward_times=fwd_s,
        backward_times=bwd_s,
        stage_costs=costs,
        stage_memory=mem,
        stage_params=[int(params[bounds[k] : bounds[k + 1]].sum()) for k in range(p)],
        cut_bytes=[int(cut_size[c]) for c in bounds[1:-1]],
        imbalance=worst / mean if mean > 0 else 1.0,
        bound_ratio=worst / lower if lower > 0 else 1.0,
        lower_bound=lower,
        method=method,
        dynamic_dims=dynamic_dims(graph),
        shared={v: graph.nodes[v]["measured_as"] for v in order if "measured_as" in graph.nodes[v]},
    )


def dynamic_dims(graph: nx.DiGraph) -> list[str] | None:
    """The captured inputs' dynamic dims as "name[dim]" (None when the capture kept no
    shapes: torch.fx)."""
    dims: list[tuple[Any, ...] | None] = graph.graph.get("input_dims", [])
    if all(d is None for d in dims):
        return None
    return [
        f"{name}[{k}]"
        for name, want in zip(graph.graph["inputs"], dims, strict=True)
        for k, size in enumerate(want or ())
        if not isinstance(size, int)
    ]


def _check_balance(balance: object, n: int, p: int) -> list[int]:
    if not isinstance(balance, Sequence) or not all(
        isinstance(b, int | np.integer) and not isinstance(b, bool) for b in balance
    ):
        raise TypeError(
            f"balance must be 'profile', 'parameters', 'uniform' or a list of ints, got {balance!r}"
        )
    sizes = [int(b) for b in balance]
    if len(sizes) != p:
        raise ValueError(
            f"balance has {len(sizes)} entries but stages={p}; give one node count per stage"
        )
    if any(b < 1 for b in sizes):
        raise ValueError(f"balance {sizes} has an empty stage; every count must be >= 1")
    if sum(sizes) != n:
        raise ValueError(
            f"balance {sizes} sums to {sum(sizes)} but the graph has {n} nodes; the counts must "
            f"sum to {n}"
        )
    return sizes


def _check_memory_of(sizes: list[int], memory: Any, caps: np.ndarray) -> float:
    bounds = np.cumsum([0, *sizes])
    for k in range(len(sizes)):
        if memory(k, int(bounds[k + 1]), np.array([bounds[k]]))[0] > caps[k]:
            return math.inf
    return 0.0


def _explain_infeasible(
    n: int,
    p: int,
    objective: Any,
    memory: Any,
    caps: np.ndarray,
    barrier: np.ndarray,
    cut_ok: np.ndarray,
) -> None:
    """No finite partition exists: say whether the cuts or the memory cap are to blame."""
    _, plain = min_max_partition(n, p, objective("count", False, False))
    if not math.isfinite(plain):
        places = int(cut_ok[1:n].sum())
        raise ValueError(
            f"the graph can only be cut in {places} places (where every value crossing is a "
            f"tensor) but {p} stages need {p - 1} cuts; use stages <= {places + 1}"
        )

    def overrun(k: int, end: int, starts: np.ndarray) -> np.ndarray:
        over = memory(k, end, starts) - caps[k]
        return over + barrier[starts] + barrier[end]

    sizes, _ = min_max_partition(n, p, overrun)
    _explain_over_cap(
        sizes, memory, caps, f"no split into {p} stages fits memory_cap: the best one"
    )


def _explain_over_cap(sizes: list[int], memory: Any, caps: np.ndarray, what: str) -> None:
    p = len(sizes)
    bounds = np.cumsum([0, *sizes])
    needs = [float(memory(k, int(bounds[k + 1]), np.array([bounds[k]]))[0]) for k in range(p)]
    k = int(np.argmax([needs[i] - caps[i] for i in range(p)]))
    over = needs[k] - caps[k]
    raise ValueError(
        f"{what} still needs {needs[k]:.0f} bytes on stage {k}, {over:.0f} bytes "
        f"({over / 2**20:.2f} MiB) over its cap of {caps[k]:.0f}; raise memory_cap, use more "
        f"stages, or fewer in-flight microbatches"
    )
