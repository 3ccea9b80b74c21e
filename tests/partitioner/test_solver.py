"""The balancing algorithms: exact min-max against brute force on chains and on random DAGs
(hypothesis), stage-count and balance-list errors."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch import fx

from partitioner import (
    Captured,
    Plan,
    UnitCosts,
    capture,
    partition,
    partition_chain,
    split_model,
)
from partitioner.solver import block_partition, evenly


def compositions(n: int, p: int) -> list[list[int]]:
    """Every way to write n as p positive parts, in order."""
    return [
        [b - a for a, b in zip((0, *cuts), (*cuts, n), strict=True)]
        for cuts in itertools.combinations(range(1, n), p - 1)
    ]


def chain_bottleneck(costs: list[int], sizes: list[int]) -> int:
    start, worst = 0, 0
    for size in sizes:
        worst = max(worst, sum(costs[start : start + size]))
        start += size
    return worst


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=12), st.integers(1, 5))
def test_partition_chain_matches_brute_force(costs: list[int], p: int) -> None:
    if p > len(costs):
        with pytest.raises(ValueError, match=f"{len(costs)} nodes"):
            partition_chain(costs, p)
        return
    sizes = partition_chain(costs, p)
    assert len(sizes) == p and sum(sizes) == len(costs) and min(sizes) >= 1
    best = min(chain_bottleneck(costs, c) for c in compositions(len(costs), p))
    assert chain_bottleneck(costs, sizes) == best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 10), min_size=1, max_size=30), st.integers(1, 8))
def test_heuristics_give_valid_sizes(costs: list[float], p: int) -> None:
    if p > len(costs):
        return
    for sizes in (block_partition(costs, p), evenly(len(costs), p)):
        assert len(sizes) == p and sum(sizes) == len(costs) and min(sizes) >= 1


def test_block_heuristic_is_not_min_max_optimal() -> None:
    # Normalised to [0, 1] the costs are six 0s and a 1: equal counts already satisfy the
    # heuristic's stopping rule (largest <= smallest + 1), leaving the heavy node's stage at 13.
    costs = [1, 1, 1, 1, 1, 1, 10]
    assert block_partition(costs, 2) == [3, 4]
    assert partition_chain(costs, 2) == [6, 1]


@pytest.mark.parametrize("stages", [0, -1])
def test_stages_below_one(stages: int) -> None:
    with pytest.raises(ValueError, match=f"stages must be >= 1, got {stages}"):
        partition_chain([1.0, 2.0], stages)


def test_stages_above_nodes_names_node_count() -> None:
    with pytest.raises(ValueError, match="cannot split 3 nodes into 4 stages.*stages <= 3"):
        partition_chain([1.0, 2.0, 3.0], 4)


def test_chain_rejects_negative_costs() -> None:
    with pytest.raises(ValueError, match="finite and >= 0"):
        partition_chain([1.0, -2.0], 1)


# ---- random DAGs -------------------------------------------------------------------------------


def mix(*xs: torch.Tensor) -> torch.Tensor:
    """One DAG node: a cheap function of all its parents."""
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return torch.tanh(total)


def random_dag_module(n: int, rng: random.Random) -> fx.GraphModule:
    """An fx module whose nodes form a random DAG (each node mixes 1-3 earlier values, some far
    back: skip connections) returning the last value and one random earlier value."""
    graph = fx.Graph()
    values = [graph.placeholder("x")]
    for _ in range(n):
        parents = rng.sample(values, min(len(values), rng.randint(1, 3)))
        values.append(graph.call_function(mix, tuple(parents)))
    graph.output((values[-1], rng.choice(values[1:])))
    return fx.GraphModule(torch.nn.Module(), graph)


def brute_force(graph: Captured, p: int, bandwidth: float, cap: float) -> float:
    """The best bottleneck over every contiguous split whose stages fit `cap` (activation bytes
    x (p - k) in-flight microbatches for stage k, as 1F1B holds), from the graph's edges."""
    order = graph.order
    n = len(order)
    index = {v: i for i, v in enumerate(order)}
    # The input's edges and the output's values, which the unit graph keeps apart.
    flat = graph.graph_module.graph
    out_node = next(v for v in flat.nodes if v.op == "output")
    outputs = {a.name for a in out_node.args[0]}
    input_users = {u.name for u in next(iter(flat.nodes)).users}
    compute = [graph.costs[v].forward + graph.costs[v].backward for v in order]

    def crossing(c: int) -> float:
        live = 0.0
        for v in order[:c]:
            later = any(index[u] >= c for u in graph.graph.successors(v)) or v in outputs
            live += graph.nodes[v]["bytes"] if later else 0
        if any(v in input_users for v in order[c:]):
            live += graph.values["x"].bytes
        return live / bandwidth

    best = float("inf")
    for sizes in compositions(n, p):
        bounds = list(itertools.accumulate([0, *sizes]))
        held = [
            sum(graph.nodes[v]["bytes"] for v in order[bounds[k] : bounds[k + 1]]) * (p - k)
            for k in range(p)
        ]
        if max(held) > cap:
            continue
        worst = 0.0
        for k in range(p):
            a, b = bounds[k], bounds[k + 1]
            cost = sum(compute[a:b])
            cost += crossing(a) if a > 0 else 0.0
            cost += crossing(b) if b < n else 0.0
            worst = max(worst, cost)
        best = min(best, worst)
    return best


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(0, 2**31), st.sampled_from([1e9, 300.0]))
def test_random_dags_partition_optimally_and_split_exactly(
    n: int, p: int, seed: int, cap: float
) -> None:
    rng = random.Random(seed)
    gm = random_dag_module(n, rng)
    x = torch.randn(4, dtype=torch.float64)
    graph = capture(gm, (x,))
    graph = graph.with_costs({  # a unit keeps what it hands on for its backward
        v: UnitCosts(forward=float(rng.randint(0, 20)), input_grad=float(rng.randint(0, 20)),
                     activation_bytes=float(graph.nodes[v]["bytes"])) for v in graph.order})
    nodes = len(graph.order)  # mix is traced through: 1-3 graph nodes per DAG node
    if p > nodes:
        with pytest.raises(ValueError, match=f"cannot split {nodes} nodes"):
            partition(graph, p)
        return
    best = brute_force(graph, p, 8.0, cap)
    event(f"feasible={best != float('inf')}")
    if best == float("inf"):
        with pytest.raises(ValueError, match="over its cap of 300"):
            partition(graph, p, bandwidth=8.0, memory_cap=cap)
        return
    # 32-byte float64 tensors cost 4 units each to send
    plan = partition(graph, p, bandwidth=8.0, memory_cap=cap)
    assert max(plan.stage_memory) <= cap
    flat = [v for stage in plan.stages for v in stage]
    assert flat == list(graph.order), "stages are contiguous segments of the order"
    assert all(plan.stages), "no empty stage"
    assert plan.bottleneck == best
    stages = split_model(graph, plan)
    values: tuple[torch.Tensor, ...] = (x,)
    for stage in stages:
        values = stage(*values)
    expected = gm(x)
    assert all(torch.equal(a, b) for a, b in zip(values[0], expected, strict=True))


def test_plan_table_and_dict() -> None:
    gm = random_dag_module(6, random.Random(1))
    graph = capture(gm, (torch.randn(3),))
    plan = partition(graph, 2, "uniform")
    half = len(graph.order) // 2
    assert isinstance(plan, Plan) and plan.sizes == [half, half]
    text = str(plan)
    assert "fwd ms" in text and plan.stages[1][0] in text and plan.stages[1][-1] in text
    as_dict = plan.to_dict()
    assert as_dict["stages"] == plan.stages and as_dict["method"] == "uniform"
