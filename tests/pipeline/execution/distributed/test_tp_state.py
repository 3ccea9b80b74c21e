"""State across tensor-parallel layouts, on 4 gloo processes launched as torchrun does, with a
Hugging Face GPT-2 in float64 (tied embedding / LM head, a fused qkv held as a
``_StridedShard`` per head at tp=2) trained by AdamW, every loss against the uninterrupted
unsplit run's to 1e-9:

- a DCP checkpoint saved at pp=2 x tp=2 records the fused qkv's strided shards as chunks of
  the one tensor (3 per rank), and loads at pp=4 x tp=1 (model and AdamW state) continuing
  with the same losses; saved there, it loads back at pp=2 x tp=2 into a model built on meta
  (each process reads and keeps only its shards), and again the same losses; one process
  loads the pp=2 x tp=2 checkpoint whole (pp=1, tp=1) with the same losses too, and
  ``Checkpointer.resume`` (the elastic restart's load) resumes it at pp=1 x tp=2 x dp=2;
- a model built on meta with ``init_fn`` at pp=2 x tp=2: each process's shards equal the
  unsplit model's initial values, and the parameter bytes a process holds are about
  1/(pp x tp) of the model's;
- ``pipe.rebalance()`` at pp=2 x tp=2 moves units between pipeline ranks with their shards,
  gradients and AdamW state, and the next steps keep the unsplit run's losses.

One launch runs every case. This file is also the worker: ``python <this file> tpstate OUT``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.distributed import HF_MODULES, all_ok, launch

ATOL = 1e-9
ROWS = 4  # the global batch
SEQ = 6
VOCAB = 48
LR = 1e-2
STEPS = 6  # the reference run; the layouts take 2 steps each
_ALIVE: list[torch.nn.Module] = []  # the memoised capture knows models by id: none is reused


def _gpt2(seed: int = 0, width: int = 16, layers: int = 3) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=8, n_embd=width, n_layer=layers, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).double()
    _ALIVE.append(model)
    return model


def _batch(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(900 + step)
    return ({"input_ids": torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)},
            torch.randint(0, VOCAB, (ROWS, SEQ), generator=g))


def _reference() -> list[float]:
    """The uninterrupted unsplit run's losses (AdamW, STEPS steps)."""
    from tests.support.models import lm_loss

    ref = _gpt2()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        loss = lm_loss(ref(**x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _pipe(model: torch.nn.Module, pp: int, tp: int, **options: Any) -> Any:
    from pipeline import Pipeline
    from tests.support.models import lm_loss

    options.setdefault("balance", "parameters")
    options.setdefault("microbatches", 4)
    return Pipeline(model, stages=pp, tensor_parallel=tp, loss_fn=lm_loss,
                    example_input=_batch(0)[0], **options)


def _train(pipe: Any, opt: torch.optim.Optimizer, steps: range, want: list[float],
           label: str) -> None:
    layout = pipe.distributed.layout if pipe.distributed is not None else None
    dp, d = (layout.data_parallel, layout.dp_rank) if layout is not None else (1, 0)
    n = ROWS // dp
    for step in steps:
        x, y = _batch(step)
        pipe.zero_grad()
        loss = pipe.step({"input_ids": x["input_ids"][d * n:(d + 1) * n]}, y[d * n:(d + 1) * n])
        opt.step()
        torch.testing.assert_close(float(loss), want[step], atol=ATOL, rtol=0,
                                   msg=f"{label}: loss of step {step}")


def _check_strided_chunks(ckpt: Path) -> None:
    """The fused qkv weight and its AdamW moments are recorded as 6 chunks (3 per tp rank)
    that tile the tensor, under the model's keys only."""
    from torch.distributed.checkpoint import FileSystemReader

    from pipeline.checkpoint.files import _live_version

    version = ckpt / str(_live_version(ckpt))
    stored = FileSystemReader(version).read_metadata().state_dict_metadata
    assert not [k for k in stored if "@strided" in k], sorted(stored)
    for key in ("model.transformer.h.0.attn.c_attn.weight",
                "optim.state.transformer.h.0.attn.c_attn.weight.exp_avg"):
        item: Any = stored[key]
        cols = item.size[1]
        starts = sorted(c.offsets[1] for c in item.chunks)
        assert len(item.chunks) == 6, (key, item.chunks)
        assert starts == [j * cols // 6 for j in range(6)], (key, starts)


def _held_bytes(pipe: Any) -> tuple[int, int]:
    """(bytes of the parameters this process holds: its shards, each tensor once; bytes of
    the whole model's parameters)."""
    from torch.distributed.tensor import DTensor

    held = {id(p): p for p in pipe.parameters()}
    mine = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in held.values())
    whole = sum(p.numel() * p.element_size() for p in pipe.module.parameters())
    return mine, whole


def _checkpoints_across_tp(out: Path, want: list[float]) -> int:
    """pp=2 x tp=2 -> pp=4 x tp=1 -> (built on meta) pp=2 x tp=2, model and AdamW state.
    Returns the number of units."""
    import torch.distributed as dist

    from pipeline import Checkpointer

    tp2, tp1 = out / "ckpt-pp2-tp2", out / "ckpt-pp4-tp1"
    pipe = _pipe(_gpt2(), 2, 2)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    _train(pipe, opt, range(0, 2), want, "pp=2 x tp=2")
    Checkpointer(pipe, tp2, opt).save(2)
    if dist.get_rank() == 0:
        _check_strided_chunks(tp2)
    units = sum(pipe.plan.sizes)

    pipe = _pipe(_gpt2(seed=5), 4, 1)  # other initial weights: the load must replace them
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    pipe.load_checkpoint(tp2, optimizer=opt)
    _train(pipe, opt, range(2, 4), want, "tp2 -> pp=4 x tp=1")
    pipe.save_checkpoint(tp1, optimizer=opt)

    with torch.device("meta"):
        model = _gpt2()
    pipe = _pipe(model, 2, 2)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)  # over the meta shards: kept by the load
    pipe.load_checkpoint(tp1, optimizer=opt)
    mine, whole = _held_bytes(pipe)
    print(f"loaded on meta at pp=2 x tp=2: {mine} of {whole} parameter bytes", flush=True)
    _train(pipe, opt, range(4, 6), want, "tp1 -> meta pp=2 x tp=2")

    # The elastic restart's load: Checkpointer.resume at another layout with tp (the
    # pp=2 x tp=2 checkpoint at pp=1 x tp=2 x dp=2, each replica half the batch).
    pipe = _pipe(_gpt2(seed=5), 1, 2, microbatches=2)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    resumed = Checkpointer(pipe, tp2, opt).resume()
    assert resumed is not None and resumed.step == 2, resumed
    assert resumed.saved_layout == {"stages": 2, "data_parallel": 1}, resumed
    assert resumed.layout == {"stages": 1, "data_parallel": 2}, resumed
    _train(pipe, opt, range(resumed.step, 4), want, "tp2 resumed at pp=1 x tp=2 x dp=2")
    print("worker tpstate: checkpoints across tp", flush=True)
    return units


def _rebalance(units: int, want: list[float]) -> None:
    """pp=2 x tp=2 from a lopsided plan (two units on pipeline rank 0): pipe.rebalance() moves
    units to rank 0, each tp rank its shards with their grads and AdamW state, and the next
    steps keep the unsplit run's losses."""
    from torch.distributed.tensor import DTensor

    # rebalance=True: global rank 0 profiles the units before the model is split
    pipe = _pipe(_gpt2(), 2, 2, balance=[2, units - 2], rebalance=True)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    _train(pipe, opt, range(0, 2), want, "pp=2 x tp=2 lopsided")
    before = pipe.plan.sizes
    report = pipe.rebalance(threshold=-1.0)  # whatever it predicts: the units move
    print(f"rebalanced at pp=2 x tp=2: {report}", flush=True)
    assert report.applied and pipe.plan.sizes != before, (report, before)
    assert pipe.plan.sizes[0] > before[0], (report, before)
    held = dict(pipe.named_parameters())
    assert all(isinstance(p, DTensor) for p in held.values()), held
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {
        id(p) for p in held.values()}, "the optimizer holds what the stages run"
    _train(pipe, opt, range(2, 4), want, "pp=2 x tp=2 after the rebalance")


def _meta_init() -> None:
    """A model built on meta at pp=2 x tp=2 with init_fn: each process holds its shards of
    the unsplit model's initial values, about 1/(pp x tp) of the parameter bytes."""
    from torch.distributed.tensor import DTensor

    from pipeline.execution.materialize import materialize

    width, layers = 64, 4
    with torch.device("meta"):
        model = _gpt2(width=width, layers=layers)
    pipe = _pipe(model, 2, 2, init_fn="reset_parameters")
    with torch.device("meta"):
        whole = _gpt2(width=width, layers=layers)
    materialize(whole, [whole], torch.device("cpu"), init_fn="reset_parameters",
                seed=torch.initial_seed())
    want = dict(whole.named_parameters())
    for name, p in pipe.named_parameters():
        assert not p.is_meta, name
        assert isinstance(p, DTensor), name
        torch.testing.assert_close(p.full_tensor(), want[name], atol=0, rtol=0,
                                   msg=f"meta pp=2 x tp=2: initial {name}")
    mine, total = _held_bytes(pipe)
    share = mine / total
    print(f"meta init at pp=2 x tp=2: {mine} of {total} parameter bytes ({share:.3f})",
          flush=True)
    assert 0.85 / 4 <= share <= 1.15 / 4, share  # about 1/(pp x tp)


def worker_tpstate(out: Path) -> None:
    import torch.distributed as dist

    from pipeline.planning import planner
    from tests.support.capture_memo import memo_capture

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    planner.capture = memo_capture()  # type: ignore[assignment]
    want = _reference()
    units = _checkpoints_across_tp(out, want)
    _rebalance(units, want)
    _meta_init()
    dist.destroy_process_group()
    print("worker tpstate: every check ran", flush=True)


WORKERS = {"tpstate": worker_tpstate}


@pytest.fixture(scope="module")
def tpstate_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    out = tmp_path_factory.mktemp("tpstate")
    return out, launch("tpstate", 4, out, deadline=500.0, script=__file__, preload=HF_MODULES)


@pytest.mark.slow
@pytest.mark.timeout(600)  # it runs the launch (115-120 s at load averages of 25 here)
def test_tp_state_across_layouts(tpstate_run: tuple[Path, list[Any]]) -> None:
    all_ok(tpstate_run[1], "tpstate")


@pytest.mark.slow
def test_tp2_checkpoint_loads_in_one_process(tpstate_run: tuple[Path, list[Any]]) -> None:
    """The pp=2 x tp=2 checkpoint (after 2 steps) loaded whole in one process (pp=1): the
    next steps keep the unsplit run's losses."""
    out, _ = tpstate_run
    want = _reference()
    pipe = _pipe(_gpt2(seed=5), 1, 1)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    pipe.load_checkpoint(out / "ckpt-pp2-tp2", optimizer=opt)
    _train(pipe, opt, range(2, 4), want, "tp2 -> one process")


if __name__ == "__main__":
    WORKERS[sys.argv[1]](Path(sys.argv[2]))
