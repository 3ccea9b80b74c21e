"""The rule "selective" keeps by (partitioner.selective_keep): within the byte budget, never the
last matmul's output (the recomputation stops before it), the same bytes as the checkpoint
then keeps, exact gradients, a probe that leaves the RNG as it was; and on a Hugging Face
Llama every decoder layer keeps at most half of its "none" bytes while recomputing far fewer
matmul FLOPs than "full"."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from partitioner.saved_bytes import SavedBytes
from partitioner.selective_keep import keep_plan
from pipeline import Pipeline
from pipeline.app.models import TransformerBlock
from pipeline.planning.activation_policies import SELECTIVE_SAVE_OPS
from tests.support import real_models

addmm = torch.ops.aten.addmm.default
torch.manual_seed(0)
_BLOCK = TransformerBlock(16, 2).double()


def _kept(run: object, x: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    """Bytes `run` keeps for its backward, and the grads of its input and parameters."""
    meter = SavedBytes()
    leaf = x.detach().requires_grad_()
    a = leaf.clone()  # as a block's input inside a stage: not a leaf
    with meter.counting():
        out = run(a)  # type: ignore[operator]
    held = float(meter.held)
    return held, list(torch.autograd.grad(out.sum(), [leaf, *_BLOCK.parameters()]))


@pytest.mark.parametrize("budget", [0.5, 0.3, None])
def test_a_transformer_block_keeps_what_its_plan_says(budget: float | None) -> None:
    block = _BLOCK
    x = torch.randn(2, 8, 16, dtype=torch.float64, requires_grad=True)
    rng = torch.get_rng_state()
    plan = keep_plan(block, [x], SELECTIVE_SAVE_OPS, budget)
    assert torch.equal(torch.get_rng_state(), rng)
    # qkv, attention, out-projection, fc1 run again in a recomputation; fc2 (last) does not.
    assert [(c.func, c.recomputed) for c in plan.candidates if c.func is addmm] == [
        (addmm, True), (addmm, True), (addmm, True), (addmm, False)]
    assert 3 not in plan.keep.get(addmm, ())
    none, want = _kept(block, x)
    assert plan.none_bytes == none
    kept, got = _kept(lambda a: checkpoint(block, a, use_reentrant=False, context_fn=plan.contexts,
                                           respect_saved_tensors_hooks=True), x)
    assert kept == plan.kept_bytes
    if budget is None:  # every output a recomputation would use
        assert plan.recompute_flops == 0
    else:
        assert kept <= budget * none
        assert 0 < plan.recompute_flops < plan.full_recompute_flops
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=0)


@pytest.mark.slow
def test_llama_layers_keep_at_most_half_of_none() -> None:
    """The planner's prices (measured with the rule, as the runtime runs it) per layer."""
    spec = real_models.SPECS["llama"]
    torch.manual_seed(0)
    model = spec.build()
    x = spec.batch(4, 16)[0]["input_ids"]
    pipe = Pipeline(model, 2, microbatches=2, loss_fn=spec.loss_fn,
                    checkpoint_activations="auto", memory_limit=1e15, example_input=x)
    priced = [pipe.captured.costs[v].policies for v in pipe.captured.order
              if v.startswith("model_layers_")]
    layers = [p for p in priced if p is not None and p.kept["none"]]
    assert len(layers) == 3
    for layer in layers:
        assert layer.kept["full"] < layer.kept["selective"] <= 0.5 * layer.kept["none"]
        assert 0 < layer.recompute_flops["selective"] < 0.5 * layer.recompute_flops["full"]


@pytest.mark.parametrize("budget", [0.5, None])
def test_the_probe_on_fake_tensors_makes_the_same_plan_and_holds_no_memory(
        budget: float | None) -> None:
    """fake=True (graph-level recompute's probe, run inside a training step): the same plan
    as the real forward, from fake tensors only, so the first step's peak is not raised by
    the block's "none" bytes held for a probe."""
    x = torch.randn(2, 8, 16, dtype=torch.float64, requires_grad=True)
    real = keep_plan(_BLOCK, [x], SELECTIVE_SAVE_OPS, budget)
    made: list[torch.Tensor] = []

    def seen(*args: torch.Tensor) -> torch.Tensor:
        out = _BLOCK(*args)
        made.append(out)
        return out

    fake = keep_plan(seen, [x], SELECTIVE_SAVE_OPS, budget, fake=True)
    assert fake == real and fake.none_bytes > 0
    from torch._subclasses.fake_tensor import FakeTensor

    assert made and all(isinstance(t, FakeTensor) for t in made)
