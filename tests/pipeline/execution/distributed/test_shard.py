"""Sharded data parallelism (``Pipeline(..., shard="optimizer" | "full")``) at pp=2 x dp=2 in 4
gloo processes launched as torchrun does, against the unsplit model in float64: every step's
loss, every gathered gradient, the clipped gradient norm and the weights after AdamW steps
equal the single-process run, for several schedules, on a GPT and on Hugging Face GPT-2 with
its tied embedding / LM head (tied across ranks under 1F1B, on one rank under ZB-V); the
optimizer state (ZeRO-1) or everything (FSDP2) is really sharded. Checkpoints across layouts
and modes: FSDP2 at pp=2 x dp=2 -> ZeRO-1 at pp=1 x dp=4 -> unsharded at pp=4 -> FSDP2 again
(into DTensor shards), each run continuing the reference's losses; a whole state dict loads
into shards (pipe(x) then equals the reference), and into a meta model's stages, which are
sharded then. Under bf16 mixed precision each mode gives the unsharded run's losses and
weights. A plain optimizer where it would be wrong (shard="full") is an error, where it would
be unsharded (shard="optimizer") a warning; bad shard values are rejected. This file is also
the worker: ``python <this file> shard OUT_DIR``."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.support.distributed import HF_MODULES, all_ok, launch
from tests.support.models import global_batch, lm_loss, make_model

ATOL = 1e-9
ROWS = 16  # global batch rows, split over the replicas
CLIP = 0.05
LR: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1}

Batch = Callable[[int], tuple[Any, torch.Tensor]]


def _gpt_batch(step: int) -> tuple[Any, torch.Tensor]:
    return global_batch(step, ROWS)


def _gpt2_batch(step: int) -> tuple[Any, torch.Tensor]:
    from tests.support.real_models import SPECS

    torch.manual_seed(500 + step)
    return SPECS["gpt2"].batch(ROWS, 8)


def _rows(x: Any, d: int, dp: int) -> Any:
    n = ROWS // dp
    if isinstance(x, dict):
        return {k: v[d * n : (d + 1) * n] for k, v in x.items()}
    return x[d * n : (d + 1) * n]


def _call(model: nn.Module, x: Any) -> Any:
    return model(**x) if isinstance(x, dict) else model(x)


class Run:
    """A Pipeline and the unsplit reference, stepped together with AdamW and clipping."""

    def __init__(self, pipe: Any, ref: nn.Module, batch: Batch, loss_fn: Any, label: str) -> None:
        self.pipe, self.ref, self.batch, self.loss_fn = pipe, ref, batch, loss_fn
        ctx = pipe.distributed
        assert ctx is not None
        self.ctx, self.dp, self.d = ctx, ctx.layout.data_parallel, ctx.layout.dp_rank
        self.label = f"{label} pp={ctx.layout.stages} dp={self.dp} shard={pipe.shard}"
        self.opt = pipe.optimizer(torch.optim.AdamW, **LR)
        self.ref_opt = torch.optim.AdamW(ref.parameters(), **LR)

    def step(self, step: int) -> None:
        from pipeline.checkpoint import gather_named

        x, y = self.batch(step)
        self.ref.zero_grad()
        expected = self.loss_fn(_call(self.ref, x), y)
        expected.backward()
        self.pipe.zero_grad()
        loss = self.pipe.step(_rows(x, self.d, self.dp), _rows(y, self.d, self.dp))
        torch.testing.assert_close(loss.double(), expected.detach(), atol=ATOL, rtol=0,
                                   msg=f"{self.label}: loss of step {step}")
        grads = gather_named({k: p.grad for k, p in self.pipe.named_parameters()}, self.ctx)
        if grads is not None:
            want = dict(self.ref.named_parameters())
            assert sorted(grads) == sorted(want), f"{self.label}: {sorted(grads)}"
            for k, g in grads.items():
                torch.testing.assert_close(g, want[k].grad, atol=ATOL, rtol=0,
                                           msg=f"{self.label}: grad of {k}, step {step}")
        torch.testing.assert_close(
            self.pipe.clip_grad_norm_(CLIP).double(),
            torch.nn.utils.clip_grad_norm_(self.ref.parameters(), CLIP).double(),
            atol=ATOL, rtol=0, msg=f"{self.label}: gradient norm, step {step}")
        self.opt.step()
        self.ref_opt.step()

    def check_weights(self) -> None:
        state = self.pipe.state_dict()
        if state is not None:
            want = self.ref.state_dict()
            assert sorted(state) == sorted(want), f"{self.label}: {sorted(state)}"
            for k, v in want.items():
                torch.testing.assert_close(state[k], v, atol=ATOL, rtol=0,
                                           msg=f"{self.label}: weight {k} after the steps")

    def check_forward(self) -> None:
        """pipe(x) (no graph) equals the reference on the last stage's processes."""
        x, _ = self.batch(0)
        with torch.no_grad():
            out = self.pipe(_rows(x, self.d, self.dp))
            want = _call(self.ref, _rows(x, self.d, self.dp))
        if self.pipe.holds_last_stage:
            torch.testing.assert_close(out, want, atol=ATOL, rtol=0, msg=f"{self.label}: pipe(x)")
        else:
            assert out is None, self.label

    def check_sharded(self) -> None:
        """Each replica holds about half of the state the shard mode shards, and the replicas'
        parts make up the whole: ZeRO's inner optimizer owns a disjoint share of this rank's
        parameters; under FSDP2 each parameter is a DTensor whose local shards add up."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        from pipeline.execution.distributed.optimizers import local_optimizer

        params = dict(self.pipe.named_parameters())
        if self.pipe.shard == "optimizer":
            names = {id(p): k for k, p in params.items()}
            owned = {names[id(p)] for g in local_optimizer(self.opt).param_groups
                     for p in g["params"]}
            assert owned and owned != set(params), f"{self.label}: owns {sorted(owned)}"
            assert set(local_optimizer(self.opt).state) <= {params[k] for k in owned}
            seen: list[Any] = [None] * self.dp
            dist.all_gather_object(seen, sorted(owned), group=self.ctx.dp_group)
            assert sum(map(len, seen)) == len(params), f"{self.label}: {seen}"
            assert set().union(*map(set, seen)) == set(params), f"{self.label}: {seen}"
        else:
            assert all(isinstance(p, DTensor) for p in params.values()), self.label
            mine = torch.tensor([p.to_local().numel() for p in params.values()])
            total = mine.clone()
            dist.all_reduce(total, group=self.ctx.dp_group)
            assert total.tolist() == [p.numel() for p in params.values()], self.label
            assert mine.sum() < total.sum(), f"{self.label}: nothing is sharded"


def _pipe(model: nn.Module, stages: int, schedule: str, shard: str | None, loss_fn: Any,
          x: Any, dp: int = 2) -> Any:
    """fx capture for the GPT (0.1 s; export ~2 s a process); GPT-2 needs torch.export."""
    from pipeline import Pipeline

    return Pipeline(model, stages=stages, schedule=schedule, microbatches=4, loss_fn=loss_fn,
                    balance="parameters", shard=shard, data_parallel=dp,
                    example_input=_rows(x, 0, dp),
                    capture_method="fx" if isinstance(x, torch.Tensor) else "auto")


def _restorer(model: nn.Module) -> Callable[[], None]:
    """Puts back the model's own parameter objects and initial values (a Pipeline empties
    other stages' tensors and shard="full" replaces parameters by DTensors), so one model
    object, captured once per process, serves several cases."""
    slots = [(m, k, t, t.detach().clone()) for m in model.modules()
             for store in (m._parameters, m._buffers) for k, t in store.items() if t is not None]

    def restore() -> None:
        for m, k, t, value in slots:
            t.data = value.clone()
            if k in m._parameters:
                m._parameters[k] = t  # type: ignore[assignment]
            else:
                m._buffers[k] = t

    return restore


def _equal_runs() -> None:
    """GPT and the tied GPT-2 at pp=2 x dp=2: every loss, grad, norm and updated weight."""
    from tests.support.real_models import SPECS, build

    gpt2 = SPECS["gpt2"]
    model = build("gpt2")
    restore = _restorer(model)
    for shard in ("optimizer", "full"):
        for schedule in ("gpipe", "1f1b", "zb-h1", "zbv"):
            run = Run(_pipe(make_model(), 2, schedule, shard, lm_loss, _gpt_batch(0)[0]),
                      make_model(), _gpt_batch, lm_loss, f"GPT {schedule}")
            for step in range(2):
                run.step(step)
            run.check_weights()
            run.check_sharded()
        for schedule in ("1f1b", "zbv"):  # the tie across ranks, then on one rank
            restore()
            run = Run(_pipe(model, 2, schedule, shard, gpt2.loss_fn, _gpt2_batch(0)[0]),
                      build("gpt2"), _gpt2_batch, gpt2.loss_fn, f"GPT-2 {schedule}")
            for step in range(2):
                run.step(step)
            run.check_weights()


def _checkpoint_across_layouts(out: Path) -> None:
    """FSDP2 pp=2 x dp=2 -> ZeRO-1 pp=1 x dp=4 -> unsharded pp=4 -> FSDP2 pp=2 x dp=2: each
    run continues the reference run (AdamW state and hyper-parameters come from the
    checkpoint); a whole state dict loaded into FSDP2 shards."""
    ref = make_model()
    a = Run(_pipe(make_model(), 2, "1f1b", "full", lm_loss, _gpt_batch(0)[0]), ref,
            _gpt_batch, lm_loss, "GPT checkpoint")
    for step in range(2):
        a.step(step)
    a.pipe.save_checkpoint(out / "full", optimizer=a.opt, extra={"step": 2})
    b = Run(_pipe(make_model(seed=7), 1, "1f1b", "optimizer", lm_loss, _gpt_batch(0)[0], dp=4),
            ref, _gpt_batch, lm_loss, "GPT resumed")
    b.ref_opt = a.ref_opt
    b.opt.param_groups[0]["lr"] = 0.5
    assert b.pipe.load_checkpoint(out / "full", optimizer=b.opt) == {"step": 2}
    assert b.opt.param_groups[0]["lr"] == LR["lr"], b.opt.param_groups[0]
    for step in range(2, 4):
        b.step(step)
    b.pipe.save_checkpoint(out / "zero", optimizer=b.opt)
    c = Run(_pipe(make_model(seed=8), 4, "1f1b", None, lm_loss, _gpt_batch(0)[0], dp=1), ref,
            _gpt_batch, lm_loss, "GPT resumed again")
    c.ref_opt = a.ref_opt
    c.pipe.load_checkpoint(out / "zero", optimizer=c.opt)
    for step in range(4, 6):
        c.step(step)
    c.check_weights()
    c.pipe.save_checkpoint(out / "plain", optimizer=c.opt)
    d = Run(_pipe(make_model(seed=9), 2, "zb-h1", "full", lm_loss, _gpt_batch(0)[0]), ref,
            _gpt_batch, lm_loss, "GPT resumed sharded")
    d.ref_opt = a.ref_opt
    d.pipe.load_checkpoint(out / "plain", optimizer=d.opt)  # into DTensor shards
    for step in range(6, 8):
        d.step(step)
    d.check_weights()
    d.check_forward()
    e = Run(_pipe(make_model(seed=10), 2, "1f1b", "full", lm_loss, _gpt_batch(0)[0]), ref,
            _gpt_batch, lm_loss, "GPT state dict into shards")
    e.pipe.load_state_dict(ref.state_dict())  # whole tensors: each process takes its shard
    e.check_weights()
    e.check_forward()
    # A meta model is sharded once its weights are loaded; its optimizer can only come after.
    with torch.device("meta"):
        meta_model = make_model()
    pipe = _pipe(meta_model, 2, "1f1b", "full", lm_loss, _gpt_batch(0)[0].to("meta"))
    with pytest.raises(ValueError, match="meta device"):
        pipe.optimizer(torch.optim.AdamW)
    pipe.load_state_dict(ref.state_dict())
    f = Run(pipe, ref, _gpt_batch, lm_loss, "GPT from meta")  # fresh AdamW on both
    f.step(8)
    f.check_weights()


def _wrong_optimizers() -> None:
    """A plain optimizer built before shard="full" replaced the parameters: ValueError at its
    step; a plain one under shard="optimizer": a warning; pipe.optimizer before the plan."""
    from pipeline import Pipeline

    x, y = _gpt_batch(0)
    for shard in ("full", "optimizer"):
        model = make_model()
        pipe = Pipeline(model, stages=2, microbatches=4, loss_fn=lm_loss, balance="parameters",
                        shard=shard, capture_method="fx")  # export: seconds, checks nothing here
        with pytest.raises(ValueError, match="needs the plan"):
            pipe.optimizer(torch.optim.AdamW)
        early = torch.optim.AdamW(pipe.parameters())  # before the plan: the whole model's
        pipe.step(_rows(x, 0, 2), _rows(y, 0, 2))
        if shard == "full":
            with pytest.raises(ValueError, match="replaced by sharded DTensors"):
                early.step()
        else:
            with pytest.warns(UserWarning, match="keeps the whole optimizer state"):
                torch.optim.AdamW(pipe.parameters()).step()
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                pipe.optimizer(torch.optim.AdamW).step()


def _mixed_precision() -> None:
    """Under bf16 autocast (fp32 master weights) each shard mode gives the unsharded hybrid
    run's losses and updated weights."""
    from pipeline import Pipeline

    x0 = _rows(_gpt_batch(0)[0], 0, 2)
    runs: dict[str | None, tuple[Any, torch.optim.Optimizer, list[float]]] = {}
    for shard in (None, "optimizer", "full"):
        torch.manual_seed(0)
        pipe = Pipeline(make_model().float(), stages=2, microbatches=4, loss_fn=lm_loss,
                        balance="parameters", shard=shard, capture_method="fx",
                        mixed_precision=torch.bfloat16, example_input=x0)
        runs[shard] = (pipe, pipe.optimizer(torch.optim.AdamW, **LR), [])
    d = runs[None][0].distributed.layout.dp_rank
    for step in range(2):
        x, y = _gpt_batch(step)
        for pipe, opt, losses in runs.values():
            pipe.zero_grad()
            losses.append(float(pipe.step(_rows(x, d, 2), _rows(y, d, 2))))
            opt.step()
    states = {shard: run[0].state_dict() for shard, run in runs.items()}
    for shard in ("optimizer", "full"):
        assert runs[shard][2] == runs[None][2], (shard, runs[shard][2], runs[None][2])
        if states[None] is not None:
            for k, v in states[None].items():
                torch.testing.assert_close(states[shard][k], v, atol=1e-6, rtol=0, msg=k)


def worker_shard(out: Path) -> None:
    import torch.distributed as dist

    from pipeline.planning import planner
    from tests.support.capture_memo import memo_capture

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    planner.capture = memo_capture()
    _equal_runs()
    _checkpoint_across_layouts(out)
    _wrong_optimizers()
    _mixed_precision()
    dist.destroy_process_group()
    print("worker shard: every check ran")


WORKERS = {"shard": worker_shard}


@pytest.mark.slow
def test_sharded_runs_equal_the_unsharded_model(tmp_path: Path) -> None:
    ended = launch("shard", 4, tmp_path, deadline=500.0, script=__file__, preload=HF_MODULES)
    all_ok(ended, "shard")


def test_bad_shard_values_are_rejected() -> None:
    from pipeline import Pipeline

    with pytest.raises(ValueError, match="shard='zero' is not a sharding mode"):
        Pipeline(make_model(), stages=2, shard="zero")
    with pytest.raises(TypeError, match="shard must be None, 'optimizer' or 'full', got 1"):
        Pipeline(make_model(), stages=2, shard=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="launch with torchrun"):
        Pipeline(make_model(), stages=2, shard="full")
    pipe = Pipeline(make_model(), stages=2, loss_fn=lm_loss)
    assert type(pipe.optimizer(torch.optim.AdamW, lr=0.1)) is torch.optim.AdamW
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        pipe.optimizer(torch.optim.AdamW(make_model().parameters()))  # type: ignore[arg-type]


if __name__ == "__main__":
    WORKERS[sys.argv[1]](Path(sys.argv[2]))
