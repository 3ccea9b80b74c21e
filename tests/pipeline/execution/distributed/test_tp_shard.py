"""Tensor parallelism with sharded data parallelism on the 2-D (dp, tp) mesh, pp=1 x tp=2 x
dp=2 in 4 gloo processes launched as torchrun does: ``shard="optimizer"`` (ZeRO-1 over the
replicas of tp DTensor parameters) and ``shard="full"`` (FSDP2's ``fully_shard`` over the
"dp" dim, on parameters that are tp DTensors already) for Hugging Face GPT-2 (tied embedding
and LM head, fused qkv split per head) and a Llama (4 heads, 2 kv heads). Two clipped AdamW
steps give the unsplit model's loss, every gradient and updated weight (`full_tensor()`) and
the clipped norm (each gradient counted once) in float64 to 1e-9; each process's AdamW state
is about 1/(tp x dp) of the unsplit model's, as the bytes say.

One launch runs every case. This file is also the worker: ``python <this file> tp_shard OUT``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.distributed import HF_MODULES, all_ok, launch

ATOL = 1e-9
ROWS = 4  # per replica
SEQ = 6
VOCAB = 48
CLIP = 0.05
LR: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1}


def _build(name: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.support.real_models import gpt2

    torch.manual_seed(0)
    if name == "gpt2":
        return gpt2().double()
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )).double()


def _batch(step: int, rows: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(900 + step)
    return ({"input_ids": torch.randint(0, VOCAB, (rows, SEQ), generator=g)},
            torch.randint(0, VOCAB, (rows, SEQ), generator=g))


def _whole(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _check(name: str, shard: str) -> None:
    """Two clipped AdamW steps at pp=1 x tp=2 x dp=2 against the unsplit model."""
    from torch.distributed.tensor import Replicate, Shard

    from pipeline import Pipeline
    from tests.support.models import lm_loss

    ref, model = _build(name), _build(name)
    pipe = Pipeline(model, stages=1, microbatches=2, loss_fn=lm_loss, balance="parameters",
                    tensor_parallel=2, data_parallel=2, shard=shard,
                    example_input=_batch(0, ROWS)[0])
    ctx = pipe.distributed
    assert ctx is not None and ctx.layout.tensor_parallel == 2, name
    d = ctx.layout.dp_rank
    label = f"{name} tp=2 dp=2 shard={shard}"
    opt = pipe.optimizer(torch.optim.AdamW, **LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), **LR)
    want = dict(ref.named_parameters(remove_duplicate=False))
    for step in range(2):
        x, y = _batch(step, 2 * ROWS)
        ref.zero_grad()
        expected = sum(lm_loss(ref(input_ids=xm), ym) * len(xm) / len(y) for xm, ym in zip(
            x["input_ids"].tensor_split(2), y.tensor_split(2), strict=True))
        expected.backward()
        pipe.zero_grad()
        rows = slice(d * ROWS, (d + 1) * ROWS)
        loss = pipe.step({"input_ids": x["input_ids"][rows]}, y[rows])
        torch.testing.assert_close(loss.double(), expected.detach(), atol=ATOL, rtol=0,
                                   msg=f"{label}: loss of step {step}")
        held = list(pipe.named_parameters())
        assert sorted(k for k, _ in held) == sorted(dict(ref.named_parameters())), label
        for k, p in held:
            assert p.grad is not None, f"{label}: {k} has no grad"
            torch.testing.assert_close(_whole(p.grad), want[k].grad, atol=ATOL, rtol=0,
                                       msg=f"{label}: grad of {k}, step {step}")
        torch.testing.assert_close(
            pipe.clip_grad_norm_(CLIP).double(),
            torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP).double(),
            atol=ATOL, rtol=0, msg=f"{label}: gradient norm, step {step}")
        opt.step()
        ref_opt.step()
    for k, p in pipe.named_parameters():
        torch.testing.assert_close(_whole(p.detach()), want[k].detach(), atol=ATOL, rtol=0,
                                   msg=f"{label}: {k} after two steps")
    state = pipe.state_dict()  # whole tensors, on global rank 0 only
    if state is not None:
        assert sorted(state) == sorted(ref.state_dict()), label
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(state[k], v, atol=ATOL, rtol=0, msg=f"{label}: state {k}")
    if shard == "full":  # every parameter on the one (dp, tp) mesh: one optimizer step
        meshes = {p.device_mesh.mesh_dim_names for _, p in pipe.named_parameters()}
        assert meshes == {("dp", "tp")}, f"{label}: {meshes}"
        if name == "gpt2":  # the fused qkv: its weight sharded, its bias kept whole (dp)
            held = dict(pipe.named_parameters())
            attn = "transformer.h.0.attn.c_attn"
            assert held[f"{attn}.weight"].placements[0] == Shard(0), label
            assert held[f"{attn}.bias"].placements[0] == Replicate(), label
    _check_state_bytes(opt, ref_opt, label)


def _check_state_bytes(opt: Any, ref_opt: Any, label: str) -> None:
    """This process's AdamW state against the unsplit model's: about 1/(tp x dp) (what tp
    replicates, norms and row biases, is split over the replicas only), and the 4 processes'
    together hold at least all of it."""
    import torch.distributed as dist

    from pipeline.execution.distributed.optimizers import state_bytes

    mine, whole = state_bytes(opt), state_bytes(ref_opt)
    print(f"{label}: AdamW state {mine} of {whole} bytes ({mine / whole:.3f}x)", flush=True)
    assert 0 < mine <= 0.3 * whole, f"{label}: {mine} of {whole} bytes"
    total = torch.tensor(mine)
    dist.all_reduce(total)
    assert whole <= int(total) <= 1.2 * whole, f"{label}: {int(total)} of {whole} bytes"


def _fsdp_dims() -> None:
    """The dim FSDP2 cuts a tp part along: 0, unless tp strides dim 0 (a fused projection
    split per head); then the next dim the replicas divide, else none (kept whole)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from pipeline.execution.distributed.fsdp_tp import fsdp_dim

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    qkv = _StridedShard(0, split_factor=3)  # dim 0 in 3 chunks, each split over tp
    for shape, placement, want in (((6, 4), Shard(0), 0), ((6, 4), qkv, 1), ((6, 3), qkv, None),
                                   ((6,), qkv, None),
                                   ((4, 6), _StridedShard(1, split_factor=3), 0)):
        t = DTensor.from_local(torch.zeros(shape), mesh, [placement], run_check=False)
        assert fsdp_dim(t, 2) == want, (shape, placement, fsdp_dim(t, 2))
    assert fsdp_dim(torch.zeros(3, 5), 2) == 0


def worker_tp_shard(out: Path) -> None:
    import torch.distributed as dist

    from pipeline.planning import planner
    from tests.support.capture_memo import memo_capture

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    planner.capture = memo_capture()  # type: ignore[assignment]
    for shard in ("full", "optimizer"):
        for name in ("gpt2", "llama"):
            _check(name, shard)
    _fsdp_dims()
    dist.destroy_process_group()
    print("worker tp_shard: every check ran", flush=True)


WORKERS = {"tp_shard": worker_tp_shard}


@pytest.mark.slow
@pytest.mark.timeout(600)  # 158-220 s at load averages of 26-37 here, past 300 s at higher
def test_tp2_sharded_replicas_equal_unsplit(tmp_path: Path) -> None:
    ended = launch("tp_shard", 4, tmp_path, deadline=540.0, script=__file__,
                   preload=HF_MODULES)
    all_ok(ended, "tp_shard")


if __name__ == "__main__":
    WORKERS[sys.argv[1]](Path(sys.argv[2]))
