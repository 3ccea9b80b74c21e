"""Capture + split: stage modules run in sequence reproduce the model exactly (float64,
torch.equal) at 2, 3 and 4 stages, share the model's parameters under its own names, and train
it; untraceable models fail with an error naming the construct and both ways out."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torchvision
from torch import nn

from partitioner import CaptureError, StageModule, UnitCosts, capture, partition, split_model
from partitioner.capture import FRONT_ENDS
from pipeline.app.models import GPT, SkipNet, TransformerBlock, mlp_stack


def run_chain(stages: list[StageModule], inputs: tuple[Any, ...]) -> Any:
    values = inputs
    for stage in stages:
        values = stage(*values)
        assert isinstance(values, tuple)
    assert len(values) == 1
    return values[0]


def tiny_vit() -> nn.Module:
    return torchvision.models.VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        mlp_dim=32,
        num_classes=10,
    )


class TupleOut(nn.Module):
    """Returns a dict and a tuple, to check the last stage hands back the model's structure."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = torch.relu(self.a(x))
        g = self.b(h) + x
        return {"logits": self.c(g), "pair": (h, g)}


IMAGE = (2, 3, 32, 32)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[Any, ...]], dict[str, Any]]] = {
    "resnet18": (torchvision.models.resnet18, lambda: (torch.randn(IMAGE),), {}),
    # leaf_modules=() traces into the residual blocks, so cuts go through skip connections.
    "resnet18-traced-blocks": (
        torchvision.models.resnet18,
        lambda: (torch.randn(IMAGE),),
        {"leaf_modules": ()},
    ),
    "resnet50": (torchvision.models.resnet50, lambda: (torch.randn(1, 3, 64, 64),), {}),
    "mobilenet_v3_small": (
        torchvision.models.mobilenet_v3_small,
        lambda: (torch.randn(1, 3, 64, 64),),
        {},
    ),
    "vit": (tiny_vit, lambda: (torch.randn(1, 3, 32, 32),), {}),
    "gpt": (GPT, lambda: (torch.randint(0, 256, (2, 16)),), {}),
    "sequential": (lambda: mlp_stack(4, 16), lambda: (torch.randn(2, 16),), {}),
    "sequential-fallback": (
        lambda: mlp_stack(4, 16),
        lambda: (torch.randn(2, 16),),
        {"sequential": True},
    ),
    "skipnet": (SkipNet, lambda: (torch.randn(2, 32),), {}),
    "dict-output": (TupleOut, lambda: (torch.randn(3, 8),), {}),
}


def _double(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(t.double() if t.is_floating_point() else t for t in inputs)


@pytest.mark.parametrize("name", list(MODELS))
def test_stages_reproduce_the_model_exactly(name: str) -> None:
    make, inputs_of, options = MODELS[name]
    torch.manual_seed(0)
    model = make().double().eval()
    inputs = _double(inputs_of())
    graph = capture(model, inputs, **options)
    expected = model(*inputs)
    for p in (2, 3, 4):
        for balance in ("uniform", "parameters"):
            stages = split_model(graph, partition(graph, p, balance))
            assert len(stages) == p
            assert stages[0].input_names == list(graph.inputs)
            for before, after in zip(stages, stages[1:], strict=False):
                assert after.input_names == before.output_names
            out = run_chain(stages, inputs)
            assert type(out) is type(expected)
            if isinstance(expected, torch.Tensor):
                assert torch.equal(out, expected)
            else:
                assert torch.equal(out["logits"], expected["logits"])
                assert all(map(torch.equal, out["pair"], expected["pair"]))


def test_skip_connection_is_passed_through_middle_stages() -> None:
    model = SkipNet().double()
    x = torch.randn(2, 32, dtype=torch.float64)
    graph = capture(model, (x,))
    stages = split_model(graph, partition(graph, 4, "uniform"))
    skip = "tanh"  # the stem's output, added back before the head
    assert all(skip in s.output_names for s in stages[:-1])
    assert torch.equal(run_chain(stages, (x,)), model(x))


def test_stages_share_parameters_under_original_names_and_train_the_model() -> None:
    torch.manual_seed(0)
    model = GPT(vocab=64, dim=16, layers=3, heads=2, max_seq=8).double()
    idx = torch.randint(0, 64, (2, 8))
    graph = capture(model, (idx,))
    stages = split_model(graph, partition(graph, 3, "uniform"))
    originals = dict(model.named_parameters())
    seen: dict[str, nn.Parameter] = {}
    for stage in stages:
        for name, param in stage.named_parameters():
            assert param is originals[name], name
            seen[name] = param
        for name, buf in stage.named_buffers():
            assert buf is dict(model.named_buffers())[name]
    assert set(seen) == set(originals)

    # One SGD step through the stages moves the model's parameters exactly as one through
    # the model itself does.
    reference = GPT(vocab=64, dim=16, layers=3, heads=2, max_seq=8).double()
    reference.load_state_dict(model.state_dict())
    reference(idx).square().mean().backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    run_chain(stages, (idx,)).square().mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    for name, param in reference.named_parameters():
        assert torch.equal(param, originals[name]), name


class Gate(nn.Module):
    """Data-dependent control flow: fx cannot trace it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x
        return -x


class GatedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.gate = Gate()
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gate(self.inp(x)))


def test_untraceable_model_error_names_construct_and_ways_out() -> None:
    with pytest.raises(CaptureError) as info:
        capture(GatedNet(), (torch.randn(2, 4),))
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "module 'gate' (Gate)" in message
    assert "leaf_modules=(Gate,)" in message and "sequential=True" in message


class TopLevelBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return h if h.sum() > 0 else -h


def test_untraceable_top_level_forward_names_the_model() -> None:
    with pytest.raises(CaptureError, match=r"the model's own forward \(TopLevelBranch\)") as info:
        capture(TopLevelBranch(), (torch.randn(2, 4),))
    assert "leaf_modules" in str(info.value) and "sequential=True" in str(info.value)


@pytest.mark.parametrize(
    "options", [{"leaf_modules": (Gate,)}, {"sequential": True}], ids=["leaf", "sequential"]
)
def test_both_ways_out_work(options: dict[str, Any]) -> None:
    model = GatedNet().double()
    x = torch.randn(2, 4, dtype=torch.float64)
    graph = capture(model, (x,), **options)
    assert torch.equal(
        run_chain(split_model(graph, partition(graph, 3, "uniform")), (x,)), model(x)
    )


def test_untraceable_sequential_falls_back_to_children() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Gate(), nn.Linear(4, 2)).double()
    x = torch.randn(2, 4, dtype=torch.float64)
    graph = capture(model, (x,))
    assert graph.model is model
    assert [graph.nodes[v]["target"] for v in graph.order] == ["0", "1", "2"]
    stages = split_model(graph, partition(graph, 3, "uniform"))
    assert torch.equal(run_chain(stages, (x,)), model(x))
    assert [n for n, _ in stages[1].named_parameters()] == []
    assert [n for n, _ in stages[2].named_parameters()] == ["2.weight", "2.bias"]


def test_default_leaves_keep_blocks_whole() -> None:
    model = GPT(vocab=32, dim=16, layers=2, heads=2, max_seq=8)
    graph = capture(model, (torch.randint(0, 32, (1, 8)),))
    blocks = [v for v in graph.order if graph.nodes[v]["op"] == "call_module" and "blocks" in v]
    assert len(blocks) == 2
    assert all(
        isinstance(model.get_submodule(graph.nodes[v]["target"]), TransformerBlock) for v in blocks
    )


def test_node_and_edge_attributes() -> None:
    model = mlp_stack(2, 8)
    x = torch.randn(3, 8)
    graph = capture(model, (x,))
    first = graph.nodes[graph.order[0]]
    assert first["op"] == "call_module" and first["module"] == "0.ln"
    assert first["shape"] == (3, 8) and first["dtype"] == "torch.float32"
    assert first["bytes"] == 3 * 8 * 4 and first["param_bytes"] == 2 * 8 * 4
    for u, v, data in graph.graph.edges(data=True):
        assert data["bytes"] == graph.nodes[u]["bytes"], (u, v)


def test_bad_inputs_to_capture() -> None:
    with pytest.raises(TypeError, match="wrap a single input as"):
        capture(nn.Linear(2, 2), torch.randn(1, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="torch.nn.Module"):
        capture(lambda x: x, (torch.randn(1),))  # type: ignore[arg-type]


def test_deepcopy_of_a_stage_keeps_its_interface_and_owns_its_parameters() -> None:
    model = SkipNet().double()
    x = torch.randn(2, 32, dtype=torch.float64)
    graph = capture(model, (x,))
    stages = split_model(graph, partition(graph, 3, "uniform"))
    copied = copy.deepcopy(stages[1])
    assert isinstance(copied, StageModule)
    assert copied.input_names == stages[1].input_names
    assert copied.output_names == stages[1].output_names
    inputs = stages[0](x)
    assert all(map(torch.equal, copied(*inputs), stages[1](*inputs)))
    originals = {id(p) for p in model.parameters()}
    assert not any(id(p) in originals for p in copied.parameters())


@pytest.mark.parametrize("method", ["export", "fx", "sequential"])
def test_every_front_end_returns_the_same_record(method: str) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    captured = capture(model, (x,), sequential=True) if method == "sequential" else capture(
        model, (x,), method=method
    )
    assert captured.method == method and method in FRONT_ENDS
    assert captured.model is model and len(captured.inputs) == 1
    # Per-unit attributes on the nodes only; everything else is a typed field.
    assert captured.graph.graph == {}
    assert list(captured.graph.nodes) == list(captured.order) and len(captured) > 1
    assert [captured.nodes[v]["index"] for v in captured.order] == list(range(len(captured)))
    value = captured.values[captured.inputs[0]]
    assert value.bytes == x.numel() * 8 and value.tensor and value.shape == (3, 4)
    assert (captured.dynamic_dim_names is None) == (method != "export")
    with pytest.raises(dataclasses.FrozenInstanceError):
        captured.order = ()  # type: ignore[misc]
    costed = captured.with_costs(dict.fromkeys(captured.order, UnitCosts(forward=1.0)))
    assert costed.profiled and not captured.profiled and not captured.costs
    assert costed.graph is captured.graph and "forward" not in captured.nodes[captured.order[0]]
    stages = split_model(captured, partition(captured, 2, "uniform"))
    assert torch.equal(run_chain(stages, (x,)), model(x))
