"""Profiling (sandboxed: state, .training and RNG untouched) and the graph partitioner's cost
model: skewed costs, memory caps, heterogeneous devices, transfer costs and bad input."""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest
import torch
from torch import nn

from partitioner import Captured, UnitCosts, capture, partition, partition_chain, profile
from pipeline import Pipeline
from pipeline.app.models import GPT, mlp_stack, skewed_model


class Noisy(nn.Module):
    """BatchNorm (running stats change in training), dropout (draws random numbers) and a
    submodule left in eval mode: everything a careless profiler would disturb."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.5)
        self.frozen = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.2))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.frozen(self.drop(torch.relu(self.bn(self.fc(x))))))


def test_profile_is_sandboxed_and_fills_costs() -> None:
    torch.manual_seed(0)
    model = Noisy()
    model.frozen.eval()
    x = torch.randn(6, 8)
    graph = capture(model, (x,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modes = {name: m.training for name, m in model.named_modules()}
    rng = torch.get_rng_state()

    costs = profile(graph, model, (x,), repeats=2, warmup=1)

    assert not graph.costs  # the record is left as it was: profiling returns the costs
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert {name: m.training for name, m in model.named_modules()} == modes
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert set(costs) == set(graph.order)
    for v in graph.order:
        unit = costs[v]
        assert unit.forward > 0 and unit.backward >= 0 and unit.source == "profile"
        assert unit.activation_bytes >= 0
    fc = costs["fc"]
    assert fc.backward > 0 and fc.input_grad > 0 and fc.weight_grad >= 0
    # Linear keeps its input (6x8 float32) for the weight gradient; parameters are not counted.
    assert fc.activation_bytes == 6 * 8 * 4


def test_profile_reports_progress() -> None:
    model = mlp_stack(2, 8)
    x = torch.randn(2, 8)
    graph = capture(model, (x,))
    seen: list[tuple[int, int, str]] = []
    profile(graph, model, (x,), repeats=1, warmup=0, progress=lambda *a: seen.append(a))
    assert [d for d, _, _ in seen] == list(range(1, len(graph) + 1))
    assert {t for _, t, _ in seen} == {len(graph)}


def test_identical_layers_cost_the_same_and_split_evenly() -> None:
    """8 x Linear(256) (docs/planning.md's example) and 12 x (Linear + GELU) at 4 stages: each
    kind of layer is measured once, after a warm-up, and shared by every layer of that kind
    (the first one too, which reads the model's input where the others read an item of the
    unit before's outputs), so the split is even in every run, through the partitioner's API
    and through Pipeline. A first layer timed apart and cold cost 2-3x the others and split
    [1, 2, 2, 3] in some runs."""
    torch.manual_seed(0)
    x = torch.randn(16, 256)
    linear = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    gelu = nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(256, 256), nn.GELU())])
    for model, kinds, even in ((linear, 1, [2, 2, 2, 2]), (gelu, 2, [6, 6, 6, 6])):
        captured = capture(model, (x,))
        order = captured.order
        for _ in range(2):
            costs = profile(captured, model, (x,), repeats=1)
            for k, v in enumerate(order):
                assert costs[v].measured_as == (None if k < kinds else order[k % kinds]), v
                assert costs[v] == dataclasses.replace(costs[order[k % kinds]],
                                                       measured_as=costs[v].measured_as)
            plan = partition(captured.with_costs(costs), stages=4, memory_cap=8 * 2**20)
            assert plan.sizes == even, plan


def test_pipeline_splits_identical_layers_evenly() -> None:
    """The same through Pipeline's profile balance (its units measured as one)."""
    torch.manual_seed(0)
    x = torch.randn(16, 256)
    pipe = Pipeline(nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]), stages=4,
                    example_input=x)
    assert pipe.plan.sizes == [2, 2, 2, 2], pipe.plan
    assert set(pipe.plan.shared.values()) == {pipe.captured.order[0]}


def skewed_graph() -> Captured:
    """The skewed model with synthetic costs: a fixed per-op overhead plus work proportional
    to parameters, as on a CPU with small layers (deterministic, unlike a measurement)."""
    model = skewed_model(dim=16, cheap_blocks=8, head_hidden=512)
    graph = capture(model, (torch.randn(4, 16),))
    nodes = graph.nodes

    def unit(v: str) -> UnitCosts:  # a unit keeps what it hands on for its backward
        forward = 1.0 + nodes[v]["param_bytes"] / 4096
        return UnitCosts(forward=forward, input_grad=2.0 * forward,
                         activation_bytes=float(nodes[v]["bytes"]))

    return graph.with_costs({v: unit(v) for v in graph.order})


@pytest.mark.parametrize("p", [2, 4])
def test_profile_balance_is_optimal_where_heuristics_are_not(p: int) -> None:
    graph = skewed_graph()
    costs = [graph.costs[v].forward + graph.costs[v].backward for v in graph.order]
    sizes = partition_chain(costs, p)
    optimum = max(sum(costs[a:b]) for a, b in itertools.pairwise(itertools.accumulate([0, *sizes])))
    ours = partition(graph, p, "profile")
    assert ours.bottleneck <= 1.05 * optimum
    for baseline in ("uniform", "parameters"):
        assert partition(graph, p, baseline).bottleneck > 1.05 * optimum, baseline
    assert ours.lower_bound <= ours.bottleneck and ours.bound_ratio >= 1.0


def test_faster_device_gets_more_work() -> None:
    graph = skewed_graph()
    even = partition(graph, 2)
    skewed = partition(graph, 2, device_speeds=[3.0, 1.0])
    assert len(skewed.stages[0]) > len(even.stages[0])
    assert skewed.bottleneck < even.bottleneck


def test_transfer_costs_move_cuts_to_small_tensors() -> None:
    model = skewed_model(dim=16, cheap_blocks=2, head_hidden=4096)
    graph = capture(model, (torch.randn(4, 16),))
    graph = graph.with_costs({v: UnitCosts(forward=1.0, activation_bytes=graph.nodes[v]["bytes"])
                              for v in graph.order})
    free = partition(graph, 2)
    costly = partition(graph, 2, bandwidth=100.0, latency=1.0)
    # The head's hidden activation (4x4096 floats) is expensive to send: never cut there.
    assert max(costly.cut_bytes) <= 4 * 16 * 4 * 2
    assert costly.bottleneck >= free.bottleneck
    for k, cost in enumerate(costly.stage_costs):
        compute = costly.forward_times[k] + costly.backward_times[k]
        assert cost == pytest.approx(compute + costly.cut_bytes[0] / 100.0 + 1.0)


def test_memory_cap_is_respected() -> None:
    graph = skewed_graph()
    free = partition(graph, 3, optimizer_factor=2.0, inflight=1)
    cap = 0.9 * max(free.stage_memory)
    capped = partition(graph, 3, memory_cap=cap, optimizer_factor=2.0, inflight=1)
    assert max(capped.stage_memory) <= cap
    assert capped.bottleneck >= free.bottleneck


def test_memory_cap_nothing_meets_names_stage_and_overrun() -> None:
    graph = skewed_graph()
    n, p, cap = len(graph.order), 3, 100_000.0
    with pytest.raises(ValueError, match="no split into 3 stages fits memory_cap") as info:
        partition(graph, p, memory_cap=cap)
    found = re.search(r"on stage (\d+), (\d+) bytes .* over its cap of 100000", str(info.value))
    assert found, str(info.value)
    # The overrun reported is the smallest any split achieves (brute force over all splits).
    best = min(
        max(m - cap for m in partition(graph, p, list(s)).stage_memory) for s in _compositions(n, p)
    )
    assert int(found.group(2)) == round(best)


def _compositions(n: int, p: int) -> list[list[int]]:
    return [
        [b - a for a, b in itertools.pairwise((0, *cuts, n))]
        for cuts in itertools.combinations(range(1, n), p - 1)
    ]


def test_partition_bad_inputs() -> None:
    model = GPT(vocab=32, dim=16, layers=2, heads=2, max_seq=8)
    # fx keeps idx.size(1) as a Python int (torch.export's symbolic sizes never block a cut).
    graph = capture(model, (torch.randint(0, 32, (1, 8)),), method="fx")
    n = len(graph.order)
    with pytest.raises(ValueError, match="stages must be >= 1, got 0"):
        partition(graph, 0, "uniform")
    with pytest.raises(ValueError, match=f"cannot split {n} nodes into {n + 1} stages"):
        partition(graph, n + 1, "uniform")
    with pytest.raises(ValueError, match=f"sums to {n - 1} but the graph has {n} nodes"):
        partition(graph, 2, [1, n - 2])
    with pytest.raises(ValueError, match="has 3 entries but stages=2"):
        partition(graph, 2, [1, 1, n - 2])
    with pytest.raises(ValueError, match="unknown balance 'flops'; use one of profile"):
        partition(graph, 2, "flops")
    with pytest.raises(ValueError, match=r"captured.with_costs\(partitioner.profile"):
        partition(graph, 2)
    with pytest.raises(ValueError, match="device_speeds must be .* list of 2 numbers"):
        partition(graph, 2, "uniform", device_speeds=[1.0])
    with pytest.raises(TypeError, match="stages must be an int"):
        partition(graph, 2.0, "uniform")  # type: ignore[arg-type]
    # GPT slices the position table with idx.size(1), an int: no cut may separate the two.
    order = graph.order
    size_at = next(i for i, v in enumerate(order) if graph.nodes[v]["target"] == "size")
    with pytest.raises(ValueError, match="non-tensor value crosses"):
        partition(graph, 2, [size_at + 1, n - size_at - 1])


def test_explicit_balance_over_memory_cap_names_stage() -> None:
    graph = skewed_graph()
    n = len(graph.order)
    with pytest.raises(ValueError, match=r"balance \[1, .*\] still needs \d+ bytes on stage 1"):
        partition(graph, 2, [1, n - 1], memory_cap=50_000.0, inflight=1)
