"""Tensor parallelism on architectures beyond GPT-2 and Llama, each a Hugging Face model built
from a tiny config in float64, one step at tp=2 against the unsplit model (the loss and every
gradient, `full_tensor()` of each sharded one, to 1e-9), with the plan the rules derived:

- Phi-3: gate and up fused in one matmul and chunked in two (split strided, each rank its
  part of both), q / k / v cut out of one projection by uneven slices (replicated);
- Qwen3: a norm of each head's q and k (a reduction within a head keeps the heads split);
- GPT-NeoX: the fused q / k / v viewed per head, then split inside each head (a plain
  column split: each rank holds whole heads with their q, k and v);
- Falcon: projections written ``x @ weight.T`` (``numpy_T``), a multi-query fused
  projection indexed per head (replicated), the MLP split.

Phi-3 and GPT-NeoX run at pp=2 x tp=2, Qwen3 and Falcon at pp=1 x tp=2 x dp=2. One launch
runs every case. This file is also the worker: ``python <this file> models OUT_DIR``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.distributed import HF_MODULES, all_ok, dump, launch

ATOL = 1e-9
ROWS = 4  # per replica
SEQ = 6
VOCAB = 48
_DEC = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
            pad_token_id=0)


def _phi3() -> torch.nn.Module:
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM(Phi3Config(num_key_value_heads=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attention_dropout=0.0, **_DEC))


def _qwen3() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(num_key_value_heads=2, head_dim=8, **_DEC))


def _gpt_neox() -> torch.nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM(GPTNeoXConfig(rotary_pct=0.5, hidden_dropout=0.0,
                                            attention_dropout=0.0, **_DEC))


def _falcon() -> torch.nn.Module:
    from transformers import FalconConfig, FalconForCausalLM

    return FalconForCausalLM(FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0))


# name -> (builder, pp, {parameter: (style, dim, fused chunks)} the plan must give)
CASES: dict[str, tuple[Callable[[], torch.nn.Module], int, dict[str, tuple[str, Any, int]]]] = {
    "phi3": (_phi3, 2, {
        "model.layers.0.mlp.gate_up_proj.weight": ("colwise", 0, 2),
        "model.layers.0.mlp.down_proj.weight": ("rowwise", 1, 1),
        "model.layers.0.self_attn.qkv_proj.weight": ("replicate", None, 1),
        "model.layers.0.self_attn.o_proj.weight": ("replicate", None, 1)}),
    "qwen3": (_qwen3, 1, {
        "model.layers.0.self_attn.q_proj.weight": ("colwise", 0, 1),
        "model.layers.0.self_attn.k_proj.weight": ("colwise", 0, 1),
        "model.layers.0.self_attn.o_proj.weight": ("rowwise", 1, 1),
        "model.layers.0.self_attn.q_norm.weight": ("replicate", None, 1)}),
    "gpt_neox": (_gpt_neox, 2, {
        "gpt_neox.layers.0.attention.query_key_value.weight": ("colwise", 0, 1),
        "gpt_neox.layers.0.attention.dense.weight": ("rowwise", 1, 1)}),
    "falcon": (_falcon, 1, {
        "transformer.h.0.mlp.dense_h_to_4h.weight": ("colwise", 0, 1),
        "transformer.h.0.mlp.dense_4h_to_h.weight": ("rowwise", 1, 1),
        "transformer.h.0.self_attention.query_key_value.weight": ("replicate", None, 1)}),
}


def _build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return CASES[name][0]().double()


def _batch(rows: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return ({"input_ids": torch.randint(0, VOCAB, (rows, SEQ), generator=g)},
            torch.randint(0, VOCAB, (rows, SEQ), generator=g))


def _whole(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _check(name: str) -> None:
    """One step at pp x tp=2 (dp the rest of the world) against the unsplit model, and the
    placements the plan must have chosen."""
    import torch.distributed as dist

    from pipeline import Pipeline
    from tests.support.models import lm_loss

    _, pp, expected_plan = CASES[name]
    ref, model = _build(name), _build(name)
    dp = dist.get_world_size() // (2 * pp)
    label = f"{name} pp={pp} dp={dp} tp=2"
    pipe = Pipeline(model, stages=pp, microbatches=2, loss_fn=lm_loss, balance="parameters",
                    tensor_parallel=2, example_input=_batch(ROWS)[0])
    plan = pipe.tp_plan
    assert plan is not None, label
    for param, (style, dim, chunks) in expected_plan.items():
        got = plan.params[param]
        assert (got.style, got.dim, got.chunks) == (style, dim, chunks), f"{label}: {got}"
    ctx = pipe.distributed
    assert ctx is not None
    d = ctx.layout.dp_rank
    x, y = _batch(ROWS * dp)
    half = ROWS // 2  # the pipeline's microbatches, in the unsplit model's order
    expected = sum(lm_loss(ref(input_ids=x["input_ids"][i:i + half]), y[i:i + half])
                   for i in range(0, ROWS * dp, half)) / (2 * dp)
    expected.backward()
    loss = pipe.step({"input_ids": x["input_ids"][d * ROWS:(d + 1) * ROWS]},
                     y[d * ROWS:(d + 1) * ROWS])
    torch.testing.assert_close(loss.double(), expected.detach(), atol=ATOL, rtol=0, msg=label)
    want = dict(ref.named_parameters(remove_duplicate=False))
    held = list(pipe.named_parameters())
    assert held, label
    for k, p in held:
        assert p.grad is not None, f"{label}: {k} has no grad"
        torch.testing.assert_close(_whole(p.grad), want[k].grad, atol=ATOL, rtol=0,
                                   msg=f"{label}: grad of {k}")
    print(f"{label}: loss and {len(held)} gradients equal the unsplit model's", flush=True)


def worker_models(out: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for name in CASES:
        _check(name)
    dist.destroy_process_group()
    print("worker models: every check ran", flush=True)


def _failing_tp_rank(action: Callable[[], None]) -> None:
    """pp=1 x tp=2 on 2 processes (an MLP whose pair all-reduces in every forward): rank 1
    runs `action` after its second microbatch's forward of step 2, mid-step."""
    import torch.distributed as dist
    from torch import nn

    from pipeline import Pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)).double()
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    pipe = Pipeline(model, stages=1, microbatches=2, loss_fn=nn.functional.mse_loss,
                    balance="parameters", tensor_parallel=2, example_input=x)
    plan = pipe.tp_plan
    assert plan is not None and plan.dim("0.weight") == 0 and plan.dim("2.weight") == 1, plan
    calls = [0]

    def hook(*_: object) -> None:
        calls[0] += 1
        if calls[0] == 2 * 2 + 2:
            action()

    if dist.get_rank() == 1:
        pipe.stage_modules[0].register_forward_hook(hook)
    for _ in range(5):
        pipe.step(x, y)
    raise AssertionError("the steps finished although a rank failed")


def worker_tpkill(out: Path) -> None:
    import os
    import signal

    _failing_tp_rank(lambda: os.kill(os.getpid(), signal.SIGKILL))


def worker_tphang(out: Path) -> None:
    import threading

    _failing_tp_rank(threading.Event().wait)


WORKERS = {"models": worker_models, "tpkill": worker_tpkill, "tphang": worker_tphang}

_MODULES = (*HF_MODULES, "transformers.models.phi3.modeling_phi3",
            "transformers.models.qwen3.modeling_qwen3",
            "transformers.models.gpt_neox.modeling_gpt_neox",
            "transformers.models.falcon.modeling_falcon")


@pytest.mark.slow
def test_tp2_on_more_architectures(tmp_path: Path) -> None:
    all_ok(launch("models", 4, tmp_path, deadline=290.0, script=__file__, preload=_MODULES),
           "models")


@pytest.mark.slow
def test_killed_tp_rank_is_named(tmp_path: Path) -> None:
    ended = launch("tpkill", 2, tmp_path, script=__file__, timeout=5.0, deadline=60.0)
    assert ended[1].returncode == -9, dump(ended)
    assert ended[0].returncode != 0 and "RankFailure" in ended[0].output, dump(ended)
    assert "rank 1" in ended[0].output, dump(ended)


@pytest.mark.slow
def test_hung_tp_rank_is_named_after_the_timeout(tmp_path: Path) -> None:
    ended = launch("tphang", 2, tmp_path, script=__file__, timeout=10.0, deadline=90.0,
                   hangs=1)
    assert ended[0].returncode != 0 and "RankFailure" in ended[0].output, dump(ended)
    assert "rank 1" in ended[0].output and "timeout 10 s" in ended[0].output, dump(ended)


if __name__ == "__main__":
    WORKERS[sys.argv[1]](Path(sys.argv[2]))
