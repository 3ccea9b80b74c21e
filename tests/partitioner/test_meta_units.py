"""The parts of building on the meta device that need no Pipeline: materialising with the
modules' own init (seeded by name, so layout-independent; uninitialised tensors named), the
cost estimate on meta (FLOPs and bytes), `retarget` of positional devices, and the sandbox
that copies only the parameters a measured forward writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from partitioner import capture, partition
from partitioner.estimate import estimate
from partitioner.exported import retarget
from partitioner.sandbox import sandbox
from pipeline.execution.materialize import materialize, meta_tensors
from tests.support.real_models import llama


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.LayerNorm(4))


def test_materialize_is_seeded_by_name_and_layout_independent() -> None:
    with torch.device("meta"):
        whole, halves = _mlp(), _mlp()
    materialize(whole, [whole], torch.device("cpu"), seed=5)
    # Two "stages" materialised separately, in the other order, with the RNG moved between.
    materialize(halves, [halves[2], halves[3]], torch.device("cpu"), seed=5)
    torch.rand(100)
    materialize(halves, [halves[0]], torch.device("cpu"), seed=5)
    for (name, a), b in zip(whole.state_dict().items(), halves.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    with torch.device("meta"):
        other = _mlp()
    materialize(other, [other], torch.device("cpu"), seed=6)
    assert not torch.equal(other[0].weight, whole[0].weight)
    assert meta_tensors(whole, [whole]) == []


def test_materialize_only_the_held_tensors() -> None:
    with torch.device("meta"):
        model = _mlp()
    names = materialize(model, [model[2]], torch.device("cpu"), seed=0)
    assert names == ["2.bias", "2.weight"]
    assert model[0].weight.is_meta and not model[2].weight.is_meta
    assert meta_tensors(model, [model]) == ["0.bias", "0.weight", "3.bias", "3.weight"]


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))  # nothing initialises it: no reset_parameters
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


def test_uninitialised_tensors_are_named() -> None:
    with torch.device("meta"):
        model = _Scaled()
    with pytest.raises(ValueError, match=r"left 2 tensor.*scale, steps.*init_fn="):
        materialize(model, [model], torch.device("cpu"))

    def init(module: nn.Module) -> None:
        if isinstance(module, _Scaled):
            module.scale.fill_(2.0)
            module.steps.zero_()
        elif isinstance(module, nn.Linear):
            module.reset_parameters()

    materialize(model, [model], torch.device("cpu"), init_fn=init)
    assert torch.equal(model.scale, torch.full((4,), 2.0))


def test_llama_rotary_buffers_after_a_state_dict() -> None:
    """Loaded weights stay as loaded; the non-persistent rotary inv_freq gets its real value
    from Hugging Face's own init (the default for a Hugging Face model)."""
    torch.manual_seed(0)
    real = llama()
    with torch.device("meta"):
        model = llama()
    model.load_state_dict(real.state_dict(), assign=True)
    assert model.model.rotary_emb.inv_freq.is_meta
    names = materialize(model, [model], torch.device("cpu"), seed=1)
    assert names == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    assert torch.equal(model.model.rotary_emb.inv_freq, real.model.rotary_emb.inv_freq)
    for key, value in real.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    ids = torch.randint(0, 48, (2, 6))
    assert torch.equal(model(input_ids=ids).logits, real(input_ids=ids).logits)


def test_estimate_counts_flops_on_meta() -> None:
    with torch.device("meta"):
        model = _mlp()
    x = torch.randn(3, 8)
    graph = capture(model, (x.to("meta"),))
    graph = graph.with_costs(estimate(graph, (x,), rates=(1e9, 1e30)))  # FLOPs only
    first = graph.costs[graph.order[0]]
    assert first.forward_flops == 2 * 3 * 8 * 16
    # Backward of a Linear: input grad 2*3*16*8, weight grad 2*16*3*8 FLOPs.
    assert first.backward_flops == 2 * (2 * 3 * 8 * 16)
    assert first.forward == pytest.approx(2 * 3 * 8 * 16 / 1e9)
    plan = partition(graph, 2, "profile")
    assert "estimated on meta" in str(plan)
    assert not any(p.device.type != "meta" for p in model.parameters())
    with pytest.raises(ValueError, match="meta device"):
        estimate(capture(_mlp(), (x,)), (x,))


def test_estimate_on_meta_with_a_parameter_used_raw() -> None:
    """A parameter read directly in forward (the demo GPT's position table) is a unit whose
    output is the parameter itself: estimating it on meta must not fail."""
    from pipeline.app.models import GPT

    with torch.device("meta"):
        model = GPT(vocab=32, dim=16, layers=2, heads=2, max_seq=6)
    ids = torch.randint(0, 32, (2, 6))
    graph = capture(model, (ids.to("meta"),))
    costs = estimate(graph, (ids,))
    assert all(costs[n].source == "estimate" for n in graph.order)
    assert sum(costs[n].forward_flops or 0.0 for n in graph.order) > 0


class _ExpBlock(nn.Module):
    """A unit whose backward saves its own output (exp) after a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.lin(x))


def test_estimate_leaves_no_graph_holding_the_weights() -> None:
    """The estimate's backward graphs are freed with it: the weights can then be swapped in
    place (materialising keeps the Parameter objects an optimizer holds)."""
    with torch.device("meta"):
        model = nn.Sequential(_ExpBlock(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    graph = capture(model, (x.to("meta"),), leaf_modules=(_ExpBlock,))
    estimate(graph, (x,))
    weight = model[0].lin.weight
    torch.utils.swap_tensors(weight, nn.Parameter(torch.zeros(4, 4)))
    assert not weight.is_meta


def test_retarget_rewrites_positional_devices() -> None:
    class Moves(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.ops.aten.to.device(torch.ones(3), torch.device("meta"), x.dtype)

    gm = torch.fx.symbolic_trace(Moves())
    retarget(gm, torch.device("cpu"))
    assert torch.equal(gm(torch.zeros(3)), torch.ones(3))


class _WritesItself(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.big = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.fc.weight.mul_(2.0)  # a forward that writes its own weight
        return self.fc(x)


def test_sandbox_copies_only_written_parameters() -> None:
    model = _WritesItself()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with sandbox(model) as box:
        model(torch.randn(2, 4))
    assert box.copied == 1  # fc.weight only: no copy of the whole model
    for key, value in model.state_dict().items():
        assert torch.equal(before[key], value), key


def test_meta_pipeline_in_one_process_equals_the_unsplit_model() -> None:
    """A Llama built on meta, initialised by the Pipeline at 2 stages (balanced by the FLOP
    estimate), trains exactly as the same model materialised whole."""
    from pipeline import Pipeline
    from tests.support.models import lm_loss

    torch.manual_seed(7)
    ids, target = torch.randint(0, 48, (4, 6)), torch.randint(0, 48, (4, 6))
    with torch.device("meta"):
        model = llama().double()
    pipe = Pipeline(model, stages=2, loss_fn=lm_loss, microbatches=2,
                    init_fn="reset_parameters")
    loss = pipe.step({"input_ids": ids}, target)
    assert "estimated on meta" in str(pipe.plan)
    with torch.device("meta"):
        ref = llama().double()
    materialize(ref, [ref], torch.device("cpu"), seed=7)
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    ref_loss = lm_loss(ref(input_ids=ids), target)
    ref_loss.backward()
    assert float(loss) == pytest.approx(float(ref_loss.detach()), abs=1e-10)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and torch.allclose(p.grad, q.grad, atol=1e-10), name


def test_meta_tensor_at_a_step_is_named() -> None:
    from pipeline import Pipeline

    with torch.device("meta"):
        model = _mlp().double()
    pipe = Pipeline(model, stages=2, loss_fn=nn.MSELoss(), microbatches=2)
    x = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"meta device: 0\.bias, 0\.weight.*init_fn="):
        pipe.step(x, torch.randn(4, 4, dtype=torch.float64))
    pipe.load_state_dict(_mlp().double().state_dict())
    pipe.step(x, torch.randn(4, 4, dtype=torch.float64))


def test_in_place_grad_accumulation_keeps_one_copy() -> None:
    from pipeline import Pipeline

    torch.manual_seed(0)
    model = _mlp().double()
    ref = _mlp().double()
    ref.load_state_dict(model.state_dict())
    pipe = Pipeline(model, stages=2, loss_fn=nn.MSELoss(), microbatches=2,
                    grad_accumulation="in_place")
    batches = [(torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64))
               for _ in range(2)]
    pipe.step(*batches[0])
    grads = [p.grad for p in model.parameters()]
    pipe.step(*batches[1])
    # The same tensors: the second step added into them (no second copy, no swap).
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
    for x, y in batches:
        nn.MSELoss()(ref(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-12), name
    with pytest.raises(ValueError, match="grad_accumulation="):
        Pipeline(model, stages=2, grad_accumulation="lazy")
    with pytest.raises(ValueError, match="init_fn='reset_parameters' initialises a model built"):
        Pipeline(model, stages=2, init_fn="reset_parameters")
    with pytest.raises(ValueError, match="init_fn=3"):
        Pipeline(model, stages=2, init_fn=3)  # type: ignore[arg-type]


def test_profiling_copy_is_made_on_the_target_device() -> None:
    """Profiling on another device copies the unit module's tensors straight there (checked
    with CPU as the target: new storage, same values, parameters still parameters)."""
    from partitioner.profile import _copy_to

    model = _mlp()
    graph = capture(model, (torch.randn(2, 8),))
    gm = graph.unit_module
    copied = _copy_to(gm, torch.device("cpu"))
    pairs = list(zip(gm.parameters(), copied.parameters(), strict=True))
    assert pairs and all(isinstance(b, nn.Parameter) for _, b in pairs)
    assert all(a.data_ptr() != b.data_ptr() and torch.equal(a, b) for a, b in pairs)
    x = torch.randn(2, 8)
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(gm(x)), tree_leaves(copied(x)),
                                                strict=True))


def test_rebalance_after_meta_init_uses_the_real_weights() -> None:
    from pipeline import Pipeline

    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)]).double()
    pipe = Pipeline(model, stages=2, loss_fn=nn.MSELoss(), microbatches=2,
                    init_fn="reset_parameters")
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    for _ in range(3):
        pipe.step(x, y)
    pipe.rebalance(threshold=-1.0)  # re-split whatever the gain
    own = {id(p) for p in model.parameters()}
    held = [p for m in pipe.stage_modules for p in m.parameters()]
    assert held and all(id(p) in own and not p.is_meta for p in held)
    pipe.zero_grad()
    loss = pipe.step(x, y)
    assert float(loss) == pytest.approx(float(nn.MSELoss()(model(x), y).detach()), abs=1e-12)


@pytest.mark.slow
def test_meta_llama_from_a_checkpoint_of_another_layout(tmp_path: Path) -> None:
    """A checkpoint saved at 2 stages loads into a meta-built Llama at 3: the loaded weights
    as saved, the rotary inv_freq (in no checkpoint) from Hugging Face's init; same loss."""
    from pipeline import Pipeline
    from tests.support.models import lm_loss

    torch.manual_seed(3)
    ids, target = torch.randint(0, 48, (4, 6)), torch.randint(0, 48, (4, 6))
    real = llama().double()
    saved = Pipeline(real, stages=2, loss_fn=lm_loss, microbatches=2,
                     example_input={"input_ids": ids})
    saved.save_checkpoint(tmp_path / "ckpt")
    with torch.device("meta"):
        model = llama().double()
    pipe = Pipeline(model, stages=3, loss_fn=lm_loss, microbatches=2,
                    example_input={"input_ids": ids})
    pipe.load_checkpoint(tmp_path / "ckpt")
    assert torch.equal(model.model.rotary_emb.inv_freq, real.model.rotary_emb.inv_freq)
    loss = pipe.step({"input_ids": ids}, target)
    expected = lm_loss(real(input_ids=ids), target).detach()
    assert float(loss) == pytest.approx(float(expected), abs=1e-10)


def test_hugging_face_parent_inits_run_as_in_hugging_face() -> None:
    """GPT-2's _init_weights rescales c_proj.weight when called on the attention module (a
    parent): children first, then parents, as model.apply does."""
    from tests.support.real_models import gpt2

    with torch.device("meta"):
        model = gpt2()
    materialize(model, [model], torch.device("cpu"), seed=0)
    attn = model.transformer.h[0].attn
    scaled = 0.02 / (2 * model.config.n_layer) ** 0.5
    assert float(attn.c_proj.weight.detach().std()) == pytest.approx(scaled, rel=0.25)
    assert float(attn.c_attn.weight.detach().std()) == pytest.approx(0.02, rel=0.25)


def test_simulate_after_meta_init_profiles_the_real_model() -> None:
    from pipeline import Pipeline

    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]).double()
    pipe = Pipeline(model, stages=2, loss_fn=nn.MSELoss(), microbatches=2,
                    balance="parameters", init_fn="reset_parameters",
                    example_input=torch.randn(4, 8, dtype=torch.float64))
    assert pipe.simulate().step_time > 0  # profiled now, on the materialised model
