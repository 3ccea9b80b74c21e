"""Partition a captured model into pipeline stages and describe the result as a `Plan`.

Stages are contiguous segments of the graph's topological order, so every stage is a valid
sub-module and every cut is a set of tensors. The objective per stage is compute (forward +
backward) / device speed plus the transfer of every value crossing its two boundaries (skip
connections included) at `bandwidth` bytes/s and `latency` s per cut, subject to a per-device
memory cap of parameters x optimizer_factor + activations x in-flight microbatches; the solver
(`solver.min_max_partition`) finds the exact min-max over that order."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from partitioner.captured import Captured
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
    identical unit (same ops and shapes) whose profiled measurement it reuses.
    `activations`: the activation policy per stage when the planner chose them
    (``checkpoint_activations="auto"``), with `activation_peaks`, each pipeline rank's
    predicted peak of held activation bytes under them."""

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
    activations: list[str] | None = None
    activation_peaks: list[float] | None = None

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
        if self.activations is not None and self.activation_peaks is not None:
            rows.append(
                "activations (auto): " + ", ".join(
                    f"stage {k} {p}" for k, p in enumerate(self.activations))
                + "; predicted peak held per rank: "
                + ", ".join(_size(b) for b in self.activation_peaks)
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


class _CostModel:
    """The objective of one partition problem over a captured graph's order: per-unit compute,
    parameters and activations (prefix sums, so a stage's total is one subtraction), per-cut
    transfer and barrier (infinite where a non-tensor value crosses), and per-stage speed,
    memory cap and in-flight microbatches. Stage k spans positions [start, end)."""

    def __init__(
        self,
        captured: Captured,
        p: int,
        *,
        speeds: np.ndarray,
        bandwidth: float | None,
        latency: float,
        caps: np.ndarray,
        flights: np.ndarray,
        optimizer_factor: float,
    ) -> None:
        order = captured.order
        n = len(order)
        self.n, self.p, self.order = n, p, order
        self.speeds, self.caps, self.flights = speeds, caps, flights
        self.optimizer_factor = optimizer_factor
        costs, nodes = captured.costs, captured.nodes
        unit = [costs.get(v) for v in order]
        self.fwd = np.array([0.0 if c is None else c.forward for c in unit])
        self.bwd = np.array([0.0 if c is None else c.backward for c in unit])
        self.params = np.array([float(nodes[v].get("param_bytes", 0.0)) for v in order])
        # Without costs, a unit's output bytes stand in for what it keeps for its backward.
        acts = np.array([float(nodes[v]["bytes"]) if c is None else c.activation_bytes
                         for v, c in zip(order, unit, strict=True)])
        self.compute = self.fwd + self.bwd
        self.cut_size, self.cut_ok = cut_arrays(spans(captured), n)
        transfer = self.cut_size / bandwidth if bandwidth is not None else np.zeros(n + 1)
        self.transfer = np.where(self.cut_size > 0, transfer + latency, 0.0)
        self.transfer[0] = self.transfer[n] = 0.0  # the model's inputs and output go nowhere
        # Only cut where everything crossing is a tensor: other cuts cost infinity.
        self.barrier = np.where(self.cut_ok, 0.0, np.inf)
        self.barrier[0] = self.barrier[n] = 0.0
        self.prefix = {
            "compute": np.concatenate(([0.0], np.cumsum(self.compute))),
            "params": np.concatenate(([0.0], np.cumsum(self.params))),
            "acts": np.concatenate(([0.0], np.cumsum(acts))),
            "count": np.arange(n + 1, dtype=np.float64),
        }

    def memory(self, k: int, end: int, starts: np.ndarray) -> np.ndarray:
        """Bytes stage k holds when it spans [start, end), for each start in `starts`."""
        held_params = self.prefix["params"][end] - self.prefix["params"][starts]
        held_acts = self.prefix["acts"][end] - self.prefix["acts"][starts]
        return held_params * self.optimizer_factor + held_acts * self.flights[k]

    def objective(self, key: str, with_transfer: bool, with_memory: bool) -> Cost:
        """The stage cost `min_max_partition` minimises the maximum of: the `key` total
        (compute over the stage's speed), plus the transfers at both ends if `with_transfer`,
        infinite over the memory cap if `with_memory`."""

        def cost(k: int, end: int, starts: np.ndarray) -> np.ndarray:
            value = self.prefix[key][end] - self.prefix[key][starts]
            if key == "compute":
                value = value / self.speeds[k]
            value = value + self.barrier[starts] + self.barrier[end]
            if with_transfer:
                value = value + self.transfer[starts] + self.transfer[end]
            if with_memory:
                value = np.where(self.memory(k, end, starts) > self.caps[k], np.inf, value)
            return value

        return cost

    def stage_memory(self, sizes: list[int]) -> list[float]:
        bounds = np.cumsum([0, *sizes])
        return [
            float(self.memory(k, int(bounds[k + 1]), np.array([bounds[k]]))[0])
            for k in range(len(sizes))
        ]


Cost = Callable[[int, int, np.ndarray], np.ndarray]


def partition(
    captured: Captured,
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
    """Split a captured (and, for balance="profile", profiled) model into `stages` stages.

    balance: "profile" (exact min-max of profiled time plus transfer), "parameters" (min-max of
    parameter bytes), "uniform" (equal node counts) or an explicit list of node counts per stage.
    device_speeds: relative speed of each stage's device (default all 1). bandwidth: bytes/s
    between stages (None: transfers are free apart from `latency`). memory_cap: bytes per device
    (a number or one per stage); memory = parameter bytes x optimizer_factor (default 4: weights,
    grads and Adam's two moments) + activation bytes x inflight (default p - k, as in 1F1B).
    """
    p = check_stages(stages, len(captured.order))
    speeds, caps, flights = _settings(p, device_speeds, bandwidth, latency, memory_cap, inflight)
    model = _CostModel(
        captured, p, speeds=speeds, bandwidth=bandwidth, latency=latency, caps=caps,
        flights=flights, optimizer_factor=optimizer_factor,
    )
    capped = memory_cap is not None
    if isinstance(balance, str):
        method = _method(captured, balance)
        sizes = _balanced(model, balance, capped)
    else:
        method = "explicit"
        sizes = _explicit(model, balance, capped)
    return _plan(captured, model, sizes, method)


def _settings(
    p: int, device_speeds: Sequence[float] | None, bandwidth: float | None, latency: float,
    memory_cap: float | Sequence[float] | None, inflight: int | Sequence[int] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The per-stage speeds, memory caps and in-flight microbatches (ValueError naming a bad
    setting)."""
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
    return speeds, caps, flights


def _method(captured: Captured, balance: str) -> str:
    """The Plan's name for `balance` (ValueError for an unknown one, or "profile" on a model
    not profiled)."""
    if balance not in METHODS:
        raise ValueError(
            f"unknown balance {balance!r}; use one of {', '.join(METHODS)} or a list of "
            f"node counts per stage"
        )
    if balance != "profile":
        return balance
    if not captured.profiled:
        raise ValueError(
            "balance='profile' needs the units' costs: partition "
            "captured.with_costs(partitioner.profile(captured, model, example_inputs)), or "
            "use balance='parameters' or 'uniform'"
        )
    if any(c.source == "estimate" for c in captured.costs.values()):
        return "profile, estimated on meta: FLOPs + bytes"
    return balance


def _balanced(model: _CostModel, balance: str, capped: bool) -> list[int]:
    """Stage sizes minimising the largest stage's `balance` cost (even counts for "uniform"
    where those cuts are allowed)."""
    n, p = model.n, model.p
    even = evenly(n, p)
    if balance == "uniform" and all(np.isfinite(model.barrier[np.cumsum(even)])):
        if capped and _over_cap(model, even):
            _explain_infeasible(model)
        return even
    key = {"profile": "compute", "parameters": "params", "uniform": "count"}[balance]
    sizes, bottleneck = min_max_partition(
        n, p, model.objective(key, balance == "profile", capped)
    )
    if not math.isfinite(bottleneck):
        _explain_infeasible(model)
    return sizes


def _explicit(model: _CostModel, balance: Sequence[int], capped: bool) -> list[int]:
    """An explicit `balance`, checked: it covers the graph, cuts only where tensors cross and
    fits the memory caps."""
    sizes = _check_balance(balance, model.n, model.p)
    bounds = np.cumsum([0, *sizes])
    bad = [int(c) for c in bounds[1:-1] if not model.cut_ok[c]]
    if bad:
        raise ValueError(
            f"balance {list(sizes)} cuts the graph where a non-tensor value crosses (after "
            f"node(s) {', '.join(model.order[c - 1] for c in bad)}); move those cuts by a node "
            f"or use balance='profile'"
        )
    if capped and _over_cap(model, sizes):
        _explain_over_cap(model, sizes, f"balance {sizes}")
    return sizes


def _plan(captured: Captured, model: _CostModel, sizes: list[int], method: str) -> Plan:
    """The Plan of stage `sizes`, with the cost model's figures for it."""
    p, order, speeds, compute = model.p, captured.order, model.speeds, model.compute
    bounds = np.cumsum([0, *sizes])
    spans_of = [slice(int(bounds[k]), int(bounds[k + 1])) for k in range(p)]
    fwd_s = [float(model.fwd[s].sum()) for s in spans_of]
    bwd_s = [float(model.bwd[s].sum()) for s in spans_of]
    costs = [
        (fwd_s[k] + bwd_s[k]) / float(speeds[k])
        + float(model.transfer[bounds[k]] + model.transfer[bounds[k + 1]])
        for k in range(p)
    ]
    lower = max(float(compute.sum() / speeds.sum()), float(compute.max() / speeds.max()))
    worst, mean = max(costs), sum(costs) / p
    units = captured.costs
    return Plan(
        stages=[list(order[s]) for s in spans_of],
        forward_times=fwd_s,
        backward_times=bwd_s,
        stage_costs=costs,
        stage_memory=model.stage_memory(sizes),
        stage_params=[int(model.params[s].sum()) for s in spans_of],
        cut_bytes=[int(model.cut_size[c]) for c in bounds[1:-1]],
        imbalance=worst / mean if mean > 0 else 1.0,
        bound_ratio=worst / lower if lower > 0 else 1.0,
        lower_bound=lower,
        method=method,
        dynamic_dims=captured.dynamic_dim_names,
        shared={v: str(units[v].measured_as) for v in order
                if v in units and units[v].measured_as is not None},
    )


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


def _over_cap(model: _CostModel, sizes: list[int]) -> bool:
    return any(need > cap for need, cap in zip(model.stage_memory(sizes), model.caps, strict=True))


def _explain_infeasible(model: _CostModel) -> None:
    """No finite partition exists: say whether the cuts or the memory cap are to blame."""
    n, p = model.n, model.p
    _, plain = min_max_partition(n, p, model.objective("count", False, False))
    if not math.isfinite(plain):
        places = int(model.cut_ok[1:n].sum())
        raise ValueError(
            f"the graph can only be cut in {places} places (where every value crossing is a "
            f"tensor) but {p} stages need {p - 1} cuts; use stages <= {places + 1}"
        )

    def overrun(k: int, end: int, starts: np.ndarray) -> np.ndarray:
        over = model.memory(k, end, starts) - model.caps[k]
        return over + model.barrier[starts] + model.barrier[end]

    sizes, _ = min_max_partition(n, p, overrun)
    _explain_over_cap(model, sizes, f"no split into {p} stages fits memory_cap: the best one")


def _explain_over_cap(model: _CostModel, sizes: list[int], what: str) -> None:
    needs, caps = model.stage_memory(sizes), model.caps
    k = int(np.argmax([needs[i] - caps[i] for i in range(len(sizes))]))
    over = needs[k] - caps[k]
    raise ValueError(
        f"{what} still needs {needs[k]:.0f} bytes on stage {k}, {over:.0f} bytes "
        f"({over / 2**20:.2f} MiB) over its cap of {caps[k]:.0f}; raise memory_cap, use more "
        f"stages, or fewer in-flight microbatches"
    )
