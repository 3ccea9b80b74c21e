"""Capture that is fast and partitions well (issue 32): only the batch dim is captured dynamic
(a window-partitioning vision model builds with static image dims; a later batch of another
sequence length is captured again with that dim dynamic, on the same stages); a module called
several times (ALBERT's shared layer, a plain loop over one block) is one unit per call, so
its calls are balanced across stages and the shared weights live on several stages, exact in
float64; identical blocks are profiled once; 0-dim outputs (a router's auxiliary loss) come
back through pipe(x); a unit named like an nn.Module method (a final ``.to``) runs as itself."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from partitioner import Captured, UnitCosts, capture, partition, profile
from pipeline import Pipeline
from pipeline.planning.microbatch import merge_microbatches
from tests.support.real_models import SPECS, VOCAB, build, check_step, lm_loss
from tests.support.real_models import albert as real_albert

ATOL = 1e-9


def albert(layers: int = 12) -> nn.Module:
    return real_albert(layers).double()


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class Loop(nn.Module):
    """A plain loop over one block (a universal transformer's recurrence)."""

    def __init__(self, dim: int = 8, steps: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.block = Block(dim)
        self.out = nn.Linear(dim, 3)
        self.steps = steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(self.steps):
            h = self.block(h)
        return self.out(h)


def _predictable_costs(graph: Captured, heavy: str) -> Captured:
    """Cost 1 for each call of the `heavy` module, 0.05 for every other unit."""
    def unit(v: str) -> UnitCosts:
        cost = 1.0 if (graph.nodes[v]["module"] or "").split("@")[0] == heavy else 0.05
        return UnitCosts(forward=cost / 3, input_grad=2 * cost / 3)

    return graph.with_costs({v: unit(v) for v in graph.order})


def _stages_reading(pipe: Pipeline, param: nn.Parameter) -> list[int]:
    return [k for k, s in enumerate(pipe.stage_modules)
            if any(p is param for p in s.parameters())]


# -- one unit per call ------------------------------------------------------------------------


@pytest.mark.parametrize("name", [pytest.param("albert", marks=pytest.mark.slow), "loop"])
def test_each_call_of_a_shared_module_is_a_unit_and_balances(name: str) -> None:
    model = albert() if name == "albert" else Loop(steps=12).double()
    heavy = "albert.encoder.albert_layer_groups.0.albert_layers.0" if name == "albert" else "block"
    x = torch.randint(0, VOCAB, (2, 8)) if name == "albert" else torch.randn(2, 4).double()
    graph = capture(model, (x,))
    calls = [v for v in graph.order
             if (graph.nodes[v]["module"] or "").split("@")[0] == heavy]
    assert len(calls) == 12, calls
    assert len({graph.nodes[v]["module"] for v in calls}) == 12  # one unit per call
    graph = _predictable_costs(graph, heavy)
    plan = partition(graph, 4, "profile")
    # The optimum is at least max(total / 4, heaviest unit): within 1.2 of it. One unit
    # holding all 12 calls (the grouping before) was 12 / 3.2 = 3.8 times it.
    assert plan.bound_ratio <= 1.2, plan
    per_stage = [sum(v in calls for v in stage) for stage in plan.stages]
    assert all(n >= 2 for n in per_stage), per_stage


@pytest.mark.parametrize(("name", "schedule"), [("albert", "1f1b"), ("loop", "1f1b"),
                                              ("albert", "zb-h1")])
def test_shared_layer_on_several_stages_is_exact(name: str, schedule: str) -> None:
    """The shared weights are read by several stages (a tie, as GPT-2's embedding and head):
    loss and every gradient equal the unsplit model's in float64."""
    torch.manual_seed(0)
    if name == "albert":
        model = albert(layers=6)
        x, y = SPECS["albert"].batch(5, 8)
        shared = model.albert.encoder.albert_layer_groups[0].albert_layers[0].ffn.weight
    else:
        model = Loop(steps=6).double()
        x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
        shared = model.block.ff[0].weight
    loss_fn = lm_loss if name == "albert" else nn.functional.mse_loss
    ref = copy.deepcopy(model)
    # Each call counts the shared weights it reads, so balancing by parameters spreads the
    # calls over the stages.
    pipe = Pipeline(model, 4, schedule=schedule, microbatches=4, loss_fn=loss_fn,
                    balance="parameters")
    check_step(pipe, model, ref, x, y)
    assert len(_stages_reading(pipe, shared)) >= 3, pipe.plan
    check_step(pipe, model, ref, x, y)  # and again: the copies stay one parameter


# -- identical blocks profiled once -----------------------------------------------------------


def test_identical_blocks_share_one_measurement() -> None:
    model = build("gpt2")
    x, _ = SPECS["gpt2"].batch(4, 8)
    graph = capture(model, (), x)
    graph = graph.with_costs(
        profile(graph, model, (x["input_ids"], x["attention_mask"]), repeats=1, warmup=0))
    plan = partition(graph, 2, "profile")
    assert plan.shared["transformer_h_1"] == plan.shared["transformer_h_2"] == "transformer_h_0"
    assert "transformer_h_0" not in plan.shared and "lm_head" not in plan.shared
    for unit in ("transformer_h_1", "transformer_h_2"):
        assert graph.costs[unit].forward == graph.costs["transformer_h_0"].forward
    assert "reuse the measurement" in str(plan)


def test_albert_calls_share_one_measurement() -> None:
    model = albert(layers=4)
    graph = capture(model, (torch.randint(0, VOCAB, (2, 8)),))
    graph = graph.with_costs(
        profile(graph, model, (torch.randint(0, VOCAB, (2, 8)),), repeats=1, warmup=0))
    first = "albert_encoder_albert_layer_groups_0_albert_layers_0"
    shared = {v: m for v, m in partition(graph, 2, "profile").shared.items() if m == first}
    assert len(shared) == 3, shared


# -- dynamic dims -----------------------------------------------------------------------------


@pytest.mark.slow
def test_only_the_batch_dim_is_dynamic_and_a_new_sequence_length_recaptures() -> None:
    model = build("gpt2").double()
    ref = copy.deepcopy(model)
    spec = SPECS["gpt2"]
    pipe = Pipeline(model, 2, microbatches=2, loss_fn=spec.loss_fn, balance="parameters")
    x, y = spec.batch(4, 8)
    check_step(pipe, model, ref, x, y)
    assert pipe.plan.dynamic_dims == ["input_ids[0]", "attention_mask[0]"]
    assert "dynamic dims: input_ids[0], attention_mask[0]" in str(pipe.plan)
    blocks = [[v for v in stage if v.startswith("transformer_h")] for stage in pipe.plan.stages]
    x2, y2 = spec.batch(7, 5)  # another batch size and sequence length
    check_step(pipe, model, ref, x2, y2)
    assert sorted(pipe.plan.dynamic_dims or []) == [
        "attention_mask[0]", "attention_mask[1]", "input_ids[0]", "input_ids[1]"]
    # The blocks are the same units (the size arithmetic around them differs).
    assert [[v for v in s if v.startswith("transformer_h")] for s in pipe.plan.stages] == blocks
    check_step(pipe, model, ref, *spec.batch(3, 8))  # the first shape still runs


def test_named_dynamic_dims_are_dynamic_from_the_start() -> None:
    spec = SPECS["gpt2"]
    x, _ = spec.batch(4, 8)
    pipe = Pipeline(build("gpt2"), 2, microbatches=2, balance="parameters", example_input=x,
                    dynamic_dims=(1,))
    assert sorted(pipe.plan.dynamic_dims or []) == [
        "attention_mask[0]", "attention_mask[1]", "input_ids[0]", "input_ids[1]"]
    with pytest.raises(ValueError, match=r"dynamic_dims must be a tuple of dims >= 1"):
        Pipeline(build("gpt2"), 2, dynamic_dims=(0,))


def _torchvision(name: str) -> nn.Module:
    from torchvision.models import MaxVit, SwinTransformer

    torch.manual_seed(0)
    if name == "swin":
        model: nn.Module = SwinTransformer(
            patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 2],
            window_size=[4, 4], stochastic_depth_prob=0.0, num_classes=5,
        )
    else:
        model = MaxVit(
            input_size=(32, 32), stem_channels=8, partition_size=2, block_channels=[8, 16],
            block_layers=[1, 1], head_dim=4, stochastic_depth_prob=0.0, num_classes=5,
        )
    return model.double().eval()


@pytest.mark.parametrize("name", ["swin", "maxvit"])
def test_window_partitioning_models_capture_only_the_batch_dim(name: str) -> None:
    """torchvision Swin and MaxViT reshape by their image sizes (windows); with every dim
    dynamic their export took minutes. Only the batch dim is dynamic here, so the image dims
    are plain numbers in the graph; a later batch of another size runs on the same stages."""
    model = _torchvision(name)
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    pipe = Pipeline(model, 2, microbatches=2, balance="parameters", example_input=x)
    assert pipe.captured.method == "export"
    assert pipe.plan.dynamic_dims == ["x[0]"]
    dims = pipe.captured.input_dims[0]
    assert not isinstance(dims[0], int) and dims[1:] == (3, 32, 32)
    with torch.no_grad():
        for rows in (4, 7):
            batch = torch.randn(rows, 3, 32, 32, dtype=torch.float64)
            torch.testing.assert_close(pipe(batch), model(batch), atol=ATOL, rtol=0)


# -- forward outputs of every kind ------------------------------------------------------------


class WithAux(nn.Module):
    """Returns a 0-dim mean (like a router's auxiliary loss) and a 0-dim count."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.a(x)
        return {"out": self.b(h), "aux": h.pow(2).mean(), "count": (h > 0).sum()}


def test_zero_dim_outputs_through_pipe_call() -> None:
    torch.manual_seed(0)
    model = WithAux().double()
    pipe = Pipeline(model, 2, microbatches=3, balance="uniform")
    x = torch.randn(7, 4, dtype=torch.float64)  # 3 + 2 + 2 rows
    with torch.no_grad():
        out, expected = pipe(x), model(x)
    torch.testing.assert_close(out["out"], expected["out"], atol=ATOL, rtol=0)
    # A 0-dim float is each microbatch's value times its share of the batch: for a mean over
    # rows, the whole batch's value.
    torch.testing.assert_close(out["aux"], expected["aux"], atol=ATOL, rtol=0)
    counts = [model(part)["count"] for part in x.tensor_split(3)]
    assert torch.equal(out["count"], torch.stack(counts))  # other 0-dim leaves are stacked


def test_mixture_of_experts_aux_loss_through_pipe_call() -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32, output_router_logits=True,
    )
    torch.manual_seed(0)
    model = MixtralForCausalLM._from_config(config, experts_implementation="batched_mm")
    model = model.double().eval()
    x = {"input_ids": torch.randint(0, VOCAB, (4, 8))}
    pipe = Pipeline(model, 2, microbatches=2, balance="parameters")
    with torch.no_grad():
        out, expected = pipe(x), model(**x)
    torch.testing.assert_close(out["logits"], expected["logits"], atol=ATOL, rtol=0)
    # Mixtral's load-balancing loss is not a mean over rows: the pipeline gives the
    # microbatches' losses weighted by their share.
    parts = [model(input_ids=part)["aux_loss"] for part in x["input_ids"].tensor_split(2)]
    torch.testing.assert_close(out["aux_loss"], sum(parts) / 2, atol=ATOL, rtol=0)
    assert out["aux_loss"].dim() == 0


def test_mixture_of_experts_eager_loop_error_names_both_failures() -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32,
    )
    model = MixtralForCausalLM._from_config(config, experts_implementation="eager")
    with pytest.raises(ValueError, match=r"torch.export could not capture .*then torch.fx"):
        capture(model, (), {"input_ids": torch.randint(0, VOCAB, (2, 8))})


def test_outputs_whose_rows_interact_are_named() -> None:
    parts = [{"logits_per_image": torch.zeros(3, 3)}, {"logits_per_image": torch.zeros(2, 2)}]
    with pytest.raises(ValueError, match=r"output\['logits_per_image'\] has per-microbatch "
                                         r"shapes \[\(3, 3\), \(2, 2\)\]"):
        merge_microbatches(parts)


@pytest.mark.slow
def test_recapture_errors_name_dynamic_dims() -> None:
    """An explicit balance that no longer fits the re-captured units, and a process that holds
    only its stages (torch.distributed), cannot capture again: both errors name the fix."""
    from torch.utils._pytree import tree_flatten

    from pipeline.planning.decision import Coordination, decide_alone
    from pipeline.planning.microbatch import Microbatches
    from pipeline.planning.planner import Planner
    from pipeline.planning.settings import PipelineSettings

    spec = SPECS["gpt2"]
    x, _ = spec.batch(4, 8)
    sizes = Pipeline(build("gpt2"), 2, microbatches=2, balance="uniform",
                     example_input=x).plan.sizes
    pipe = Pipeline(build("gpt2"), 2, microbatches=2, loss_fn=spec.loss_fn, balance=sizes,
                    example_input=x)
    with pytest.raises(ValueError, match=r"input_ids\[1\].*no longer fits: build the Pipeline "
                                         r"with dynamic_dims=\(1,\)"):
        pipe.step(*spec.batch(4, 6))

    planner = Planner(build("gpt2"), PipelineSettings(2, microbatches=2, balance="parameters"))
    leaves, call_spec = tree_flatten(((), x))
    local = Coordination(True, decide_alone, torch.device("cpu"), keeps_whole_model=True)
    decision = planner.plan(tuple(leaves), call_spec, local)
    split = Coordination(True, decide_alone, torch.device("cpu"), keeps_whole_model=False)
    longer = tree_flatten(((), spec.batch(4, 10)[0]))[0]
    with pytest.raises(ValueError, match=r"under torch.distributed .* dynamic_dims=\(1,\)"):
        planner.recaptured(decision, Microbatches.split(tuple(longer), 2), split)
    same = Microbatches.split(tuple(leaves), 2)
    assert planner.recaptured(decision, same, split) is decision  # nothing changed


class CastOut(nn.Module):
    """Ends in a top-level ``.to(dtype)``: torch.export names that op's node (and so its unit)
    "to", as nn.Module names its own method."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).to(torch.float64)


def test_a_unit_named_like_a_module_method_runs_as_itself() -> None:
    model = CastOut()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randn(8, 8, dtype=torch.float64)
    pipe = Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss())
    loss = pipe.step(x, y)
    assert "to_unit" in pipe.captured.order
    want = sum(nn.MSELoss()(ref(xm), ym) / 2 for xm, ym in
               zip(x.tensor_split(2), y.tensor_split(2), strict=True))
    want.backward()
    torch.testing.assert_close(loss, want.detach(), atol=0, rtol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=0, rtol=0, msg=name)
