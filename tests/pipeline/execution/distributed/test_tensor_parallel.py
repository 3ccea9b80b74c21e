"""Tensor parallelism inside every pipeline stage, under the distributed executor (4 gloo
processes launched as torchrun does): Hugging Face GPT-2 (tied embedding / LM head, fused qkv
split per head) and a Llama (grouped-query attention, 4 heads and 2 kv heads, sharded by
heads) at pp=2 x tp=2 under 1F1B and ZB-H1 (GPT-2 under interleaved 1F1B too), and at pp=1 x
tp=2 x dp=2: two SGD steps give the unsplit model's loss, every gradient (`full_tensor()` of
each sharded one) and the whole model's gradient norm from `clip_grad_norm_`, in float64 to
1e-9, each tp rank sending 1/tp of each stage boundary's bytes (its slice, all-gathered by the
next stage's tp ranks), and `pipe.state_dict()` the unsplit model's whole tensors. The
collectives of one forward of a tp=2 stage are counted with CommDebugMode: one all-reduce per
row-parallel matmul (2 per transformer block) plus the vocab-parallel embedding's, no
all-gather (the LM head's logits stay split by class: the cross entropy runs under loss
parallelism), no weight gathered; with sequence_parallel=True (Llama at
pp=2, GPT-2 under ZB-H1) the same exactness, and 2 reduce-scatters and at most 2 all-gathers
per block instead.

One launch runs every case. This file is also the worker: ``python <this file> tp OUT_DIR``."""

from __future__ import annotations

import dataclasses
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


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    return LlamaForCausalLM(config)


def _build(name: str) -> torch.nn.Module:
    from tests.support.real_models import gpt2

    torch.manual_seed(0)
    return (gpt2() if name == "gpt2" else _llama()).double()


def _batch(step: int, rows: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    return ({"input_ids": torch.randint(0, VOCAB, (rows, SEQ), generator=g)},
            torch.randint(0, VOCAB, (rows, SEQ), generator=g))


def _whole(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _check(name: str, pp: int, schedule: str, sequence_parallel: bool = False) -> Any:
    """Two clipped SGD steps of a tp=2 Pipeline against the unsplit model."""
    import torch.distributed as dist

    from pipeline import Pipeline
    from tests.support.models import lm_loss

    ref, model = _build(name), _build(name)
    dp = 4 // (2 * pp)
    # The plan made at construction: the optimizer takes the sharded parameters.
    pipe = Pipeline(model, stages=pp, schedule=schedule, microbatches=2 * pp, loss_fn=lm_loss,
                    balance="parameters", tensor_parallel=2,
                    sequence_parallel=sequence_parallel, example_input=_batch(0, ROWS)[0])
    ctx = pipe.distributed
    assert ctx is not None and ctx.layout.tensor_parallel == 2
    assert ctx.layout.data_parallel == dp
    d = ctx.layout.dp_rank
    label = f"{name} pp={pp} dp={dp} tp=2 {schedule}{' sp' if sequence_parallel else ''}"
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    want = dict(ref.named_parameters(remove_duplicate=False))
    for step in range(2):
        x, y = _batch(step, ROWS * dp)
        ref.zero_grad()
        expected = sum(lm_loss(ref(input_ids=xm), ym) * len(xm) / len(y) for xm, ym in zip(
            x["input_ids"].tensor_split(2 * pp), y.tensor_split(2 * pp), strict=True))
        expected.backward()
        pipe.zero_grad()
        mine = {"input_ids": x["input_ids"][d * ROWS:(d + 1) * ROWS]}
        before = dataclasses.replace(pipe._executor.transport.bytes)
        loss = pipe.step(mine, y[d * ROWS:(d + 1) * ROWS])
        if pp > 1:
            _check_boundary_bytes(pipe, before, ref, label)
        torch.testing.assert_close(loss.double(), expected.detach(), atol=ATOL, rtol=0,
                                   msg=f"{label}: loss of step {step}")
        held = list(pipe.named_parameters())
        assert held, label
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
    for k, p in pipe.named_parameters():  # the steps moved every shard as the unsplit model
        torch.testing.assert_close(_whole(p.detach()), want[k].detach(), atol=ATOL, rtol=0,
                                   msg=f"{label}: {k} after two steps")
    state = pipe.state_dict()  # whole tensors, on global rank 0 only
    assert (state is not None) == (dist.get_rank() == 0), label
    if state is not None:
        assert sorted(state) == sorted(ref.state_dict()), label
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(state[k], v, atol=ATOL, rtol=0, msg=f"{label}: state {k}")
    return pipe


def _check_boundary_bytes(pipe: Any, before: Any, ref: Any, label: str) -> None:
    """Each tp rank put 1/tp of the boundary tensors of the step on the wire (its slice; the
    next stage's tp ranks all-gather them): never tp whole copies. Every rank sends the hidden
    state of each microbatch at least (stage 0 its activations, the last its gradients)."""
    after = pipe._executor.transport.bytes
    whole, sent = after.whole - before.whole, after.sent - before.sent
    hidden = ref.config.hidden_size * SEQ * ROWS * 8  # float64, the microbatches together
    assert whole >= hidden and sent * 2 == whole, f"{label}: {before} -> {after}"
    if pipe.distributed.layout.dp_rank == 0:
        print(f"{label}: boundary bytes of a step, whole {whole}, sent {sent}", flush=True)


def _count_collectives(pipe: Any, layers: int, label: str,
                       sequence_parallel: bool = False) -> None:
    """One forward of the held (whole-model) stage under CommDebugMode."""
    from torch.distributed.tensor.debug import CommDebugMode

    stage = pipe._executor.held()[0]
    x, _ = _batch(0, ROWS)
    with CommDebugMode() as comm:
        stage(x["input_ids"])
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    reduces = counts.get("allreduce_", 0) + counts.get("all_reduce", 0)
    # The loss_fn (lm_loss: cross entropy) ran under loss parallelism: the LM head's logits
    # leave this last stage split by class, not all-gathered (they were, before it).
    assert pipe.tp_plan.loss.used == "parallel", f"{label}: {pipe.tp_plan.loss}"
    if sequence_parallel:  # 2 reduce-scatters per block, 2 all-gathers (not before the
        # first block's attention, whose input comes whole from the embedding), none of the
        # logits
        assert counts.get("reduce_scatter_tensor", 0) == 2 * layers, f"{label}: {counts}"
        assert counts.get("all_gather_into_tensor", 0) <= 2 * layers, f"{label}: {counts}"
        assert reduces == 1, f"{label}: {counts}"  # the embedding's only
        print(f"{label}: collectives of one forward {counts}", flush=True)
        return
    assert reduces == 1 + 2 * layers, f"{label}: {counts}"  # embedding + 2 per block
    assert counts.get("all_gather_into_tensor", 0) == 0, f"{label}: {counts}"  # no logits
    assert set(counts) <= {"allreduce_", "all_reduce", "all_gather_into_tensor"}, counts
    print(f"{label}: collectives of one forward {counts}", flush=True)


def _stale_optimizer() -> None:
    """An optimizer built before the plan holds the parameters the pass replaced: its first
    step is a ValueError naming the fix, not a silent no-op."""
    from pipeline import Pipeline
    from tests.support.models import lm_loss

    pipe = Pipeline(_build("llama"), stages=1, tensor_parallel=2, microbatches=2,
                    loss_fn=lm_loss, balance="parameters")
    early = torch.optim.SGD(pipe.parameters(), lr=0.1)
    x, y = _batch(0, ROWS)
    pipe.step(x, y)
    with pytest.raises(ValueError, match="replaced by their shards .* example_input"):
        early.step()
    # A composition not built yet is refused by name before anything is sharded.
    # (compile= with tp composes since; a split-backward schedule with both does not yet.)
    with pytest.raises(ValueError, match="with compile= does not compose with a split-backward"):
        Pipeline(_build("llama"), stages=1, tensor_parallel=2, microbatches=2,
                 schedule="zb-h1", loss_fn=lm_loss, balance="parameters", compile=True,
                 example_input=x)


def worker_tp(out: Path) -> None:
    import torch.distributed as dist

    from pipeline.planning import planner
    from tests.pipeline.execution.distributed.test_tp_auto import auto_layout_case
    from tests.support.capture_memo import memo_capture
    from tests.support.models import lm_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    planner.capture = memo_capture()  # type: ignore[assignment]
    for name in ("llama", "gpt2"):
        for schedule in ("1f1b", "zb-h1"):
            _check(name, 2, schedule)
    _check("gpt2", 2, "interleaved-1f1b")  # 2 stages per rank, the tied weight on both ranks
    print("worker pp2: every check ran", flush=True)
    for name, layers in (("llama", 2), ("gpt2", 3)):
        pipe = _check(name, 1, "1f1b")
        plan = pipe.tp_plan
        assert plan is not None and plan.sharded, plan
        if name == "llama":  # attention sharded by heads, kv heads too (2 of them, tp=2)
            for proj in ("q_proj", "k_proj", "v_proj"):
                assert plan.style(f"model.layers.0.self_attn.{proj}.weight") == "colwise", plan
            assert plan.style("model.layers.0.self_attn.o_proj.weight") == "rowwise", plan
        else:  # the fused qkv split per chunk, each rank its heads of q, k and v
            assert plan.chunks("transformer.h.0.attn.c_attn.weight") == 3, plan
            assert plan.style("transformer.h.0.attn.c_proj.weight") == "rowwise", plan
        _count_collectives(pipe, layers, name)
    _stale_optimizer()
    # Sequence parallelism: norms and residuals on half the tokens each, exact all the same.
    _check("llama", 2, "1f1b", sequence_parallel=True)
    pipe = _check("gpt2", 1, "zb-h1", sequence_parallel=True)
    _count_collectives(pipe, 3, "gpt2 sp", sequence_parallel=True)
    print(f"worker tp auto: {auto_layout_case(_build, _batch, lm_loss)}", flush=True)
    print(f"worker tp=2 auto: {auto_layout_case(_build, _batch, lm_loss, 2)}", flush=True)
    dist.destroy_process_group()
    print("worker tp: every check ran", flush=True)


WORKERS = {"tp": worker_tp}


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    return launch("tp", 4, tmp_path_factory.mktemp("tp"), deadline=500.0, script=__file__,
                  preload=HF_MODULES)


@pytest.mark.slow
@pytest.mark.timeout(600)  # it runs the launch (258-300 s at load averages of 30-90 here)
def test_pp2_tp2_equals_unsplit(tp_run: list[Any]) -> None:
    assert all("worker pp2: every check ran" in e.output for e in tp_run), \
        "\n".join(e.output[-3000:] for e in tp_run)


@pytest.mark.slow
def test_tp2_with_replicas_and_collectives(tp_run: list[Any]) -> None:
    all_ok(tp_run, "tp")


@pytest.mark.slow
def test_auto_layout_chooses_tp_and_trains_exactly(tp_run: list[Any]) -> None:
    """stages="auto" with tensor_parallel="auto", then with tensor_parallel=2
    (test_tp_auto.auto_layout_case)."""
    assert all("worker tp auto: chose" in e.output and "worker tp=2 auto: chose tp=2" in e.output
               for e in tp_run), \
        "\n".join(e.output[-3000:] for e in tp_run)


if __name__ == "__main__":
    WORKERS[sys.argv[1]](Path(sys.argv[2]))
