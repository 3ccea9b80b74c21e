"""Mixed precision under the distributed executor (4 gloo processes launched as torchrun does,
pp=2 x dp=2): for bf16 and fp16 and every schedule, the loss and every gathered gradient equal
the unsplit model run replica by replica, microbatch by microbatch under the same autocast
(fp32 parameters, fp32 loss; the replicas' gradients averaged), and differ from the fp32 run;
the same for Hugging Face GPT-2 (tied embedding / LM head across the ranks) and Llama. fp16: an
overflow injected in stage 0 of replica 1 only makes every process skip its optimizer step and
halve its scale (the stage-1 processes found no inf themselves). `reduce_dtype=torch.bfloat16`
averages the replicas' gradients in bf16. With shard="optimizer" (ZeRO-1) and "full" (FSDP2)
the same, then one step of the shard mode's optimizer through `optimizer_step`.

Tolerances as in tests/pipeline/execution/test_precision.py (bitwise gradients; a tied
parameter to one fp32 rounding); the loss to 1e-6 relative, since the distributed executor sums
the microbatch losses in float64 and the reference in fp32. This file is also the worker:
``python <this file> amp OUT_DIR``."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from scheduler import SCHEDULES
from tests.support.distributed import HF_MODULES, all_ok, launch

ROWS = 8  # per replica


def _rows(x: Any, d: int) -> Any:
    if isinstance(x, dict):
        return {k: v[d * ROWS : (d + 1) * ROWS] for k, v in x.items()}
    return x[d * ROWS : (d + 1) * ROWS]


def _check(model: torch.nn.Module, x: Any, y: torch.Tensor, loss_fn: Any,
           cases: list[tuple[torch.dtype, str]], tied: frozenset[str] = frozenset(),
           shard: str | None = None, capture: str = "auto") -> None:
    """Each (dtype, schedule): one step's loss and gathered grads against the reference;
    `capture`: the Pipeline's capture_method."""
    from pipeline import Pipeline
    from pipeline.checkpoint import gather_named
    from tests.support.precision import M, reference

    base = copy.deepcopy(model)  # the pipeline frees the other processes' stages in `model`

    def averaged(dtype: torch.dtype | None, scale: float = 1.0) -> tuple[Any, dict[str, Any]]:
        runs = [reference(base, _rows(x, d), _rows(y, d), dtype, scale=scale, loss_fn=loss_fn)
                for d in range(2)]
        loss = (runs[0][0].double() + runs[1][0].double()) / 2
        return loss, {k: (g + runs[1][1][k]) / 2 for k, g in runs[0][1].items()}

    fp32 = averaged(None)[1]
    tensors = [*model.named_parameters(), *model.named_buffers()]
    initial = {k: t.detach().clone() for k, t in tensors}
    for dtype, schedule in cases:
        label = f"{type(model).__name__} {dtype} {schedule} shard={shard}"
        for k, t in tensors:  # the executor freed the others' stages' tensors
            t.data = initial[k].clone()
        model.zero_grad()
        pipe = Pipeline(model, stages=2, schedule=schedule, microbatches=M, loss_fn=loss_fn,
                        balance="parameters", mixed_precision=dtype, shard=shard,
                        capture_method=capture)
        ctx = pipe.distributed
        assert ctx is not None and ctx.layout.data_parallel == 2
        d = ctx.layout.dp_rank
        loss = pipe.step(_rows(x, d), _rows(y, d))
        scale = pipe.scaler.get_scale() if pipe.scaler is not None else 1.0
        want_loss, want = averaged(dtype, scale)
        torch.testing.assert_close(loss.double(), want_loss, atol=0, rtol=1e-6,
                                   msg=f"{label}: loss")
        grads = gather_named({k: p.grad for k, p in pipe.named_parameters()}, ctx)
        if grads is not None:
            assert sorted(grads) == sorted(want), label
            for k, g in want.items():
                tol = 2e-6 if k in tied else 0.0
                torch.testing.assert_close(grads[k], g, atol=tol * g.abs().max().item(),
                                           rtol=tol, msg=f"{label}: grad of {k}")
            assert max((grads[k] - g).abs().max().item() for k, g in fp32.items()) > 0, label
        if shard is not None:  # the shard mode's optimizer, stepped through optimizer_step
            assert pipe.optimizer_step(pipe.optimizer(torch.optim.SGD, lr=0.1)), label
            state = pipe.state_dict()
            if state is not None:
                for k, p in base.named_parameters():
                    torch.testing.assert_close(state[k], p.detach().add(want[k], alpha=-0.1),
                                               atol=0, rtol=0, msg=f"{label}: stepped {k}")


def _overflow_in_one_replica() -> None:
    """fp16: inf gradients in stage 0 of replica 1 only; every process skips and backs off."""
    import torch.distributed as dist

    from pipeline import Pipeline
    from tests.support.precision import M, float_batch, inject_overflow, mlp_model, mse

    model = mlp_model()
    x, y = float_batch(0, 2 * ROWS)
    pipe = Pipeline(model, stages=2, microbatches=M, loss_fn=mse, balance="uniform",
                    mixed_precision=torch.float16, capture_method="fx")
    ctx = pipe.distributed
    assert ctx is not None and pipe.scaler is not None
    d = ctx.layout.dp_rank
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    pipe.step(_rows(x, d), _rows(y, d))  # plans; a clean step first
    assert pipe.optimizer_step(opt) and pipe.scaler.get_scale() == 2.0**16
    opt.zero_grad()
    handle = None
    if d == 1 and pipe.holds_first_stage:
        handle = inject_overflow(pipe.stage_modules[0])
    pipe.step(_rows(x, d), _rows(y, d))
    if handle is not None:
        handle.remove()
    # Stage 0's replicas share the inf through the gradient average; stage 1's saw none.
    assert pipe.scaler.found_inf == pipe.holds_first_stage, ctx.layout.describe()
    before = [p.detach().clone() for p in pipe.parameters()]
    assert not pipe.optimizer_step(opt), ctx.layout.describe()
    assert all(torch.equal(p, b) for p, b in zip(pipe.parameters(), before, strict=True))
    scales = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(scales, torch.tensor([pipe.scaler.get_scale()]))
    assert [float(s) for s in scales] == [2.0**15] * 4, scales
    opt.zero_grad()
    pipe.step(_rows(x, d), _rows(y, d))
    assert pipe.optimizer_step(opt)  # clean again: every process steps


def _bf16_gradient_average() -> None:
    """reduce_dtype=torch.bfloat16: the replicas' gradients are summed as bf16 (each rounded
    to bf16, the sum rounded once: two replicas), then halved in fp32."""
    from pipeline import Pipeline
    from pipeline.checkpoint import gather_named
    from tests.support.precision import M, float_batch, mse, reference, res_model

    model = res_model()
    base = copy.deepcopy(model)
    x, y = float_batch(0, 2 * ROWS)
    pipe = Pipeline(model, stages=2, microbatches=M, loss_fn=mse, balance="uniform",
                    mixed_precision=torch.bfloat16, reduce_dtype=torch.bfloat16,
                    capture_method="fx")
    ctx = pipe.distributed
    assert ctx is not None
    d = ctx.layout.dp_rank
    pipe.step(_rows(x, d), _rows(y, d))
    runs = [reference(base, _rows(x, r), _rows(y, r), torch.bfloat16)[1] for r in range(2)]

    def bf16(t: torch.Tensor) -> torch.Tensor:
        return t.bfloat16().float()

    want = {k: bf16(bf16(g) + bf16(runs[1][k])) / 2 for k, g in runs[0].items()}
    grads = gather_named({k: p.grad for k, p in pipe.named_parameters()}, ctx)
    if grads is not None:
        for k, g in want.items():
            torch.testing.assert_close(grads[k], g, atol=0, rtol=0, msg=f"bf16 average of {k}")
        assert any(not torch.equal(grads[k], (g + runs[1][k]) / 2)
                   for k, g in runs[0].items()), "the average was not bf16"


def worker_amp(out: Path) -> None:
    import torch.distributed as dist

    from pipeline.planning import planner
    from tests.support.capture_memo import memo_capture
    from tests.support.precision import float_batch, mse, res_model
    from tests.support.real_models import SPECS, build

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    planner.capture = memo_capture()  # type: ignore[assignment]
    x, y = float_batch(0, 2 * ROWS)
    _check(res_model(), x, y, mse,
           [(dtype, s) for dtype in (torch.bfloat16, torch.float16) for s in sorted(SCHEDULES)])
    # ZeRO-1 and FSDP2 under autocast, fp16 unscaled (a new model each: FSDP2 keeps its
    # model). These and the two checks below test what the executor does with the stages'
    # gradients, the same for either capture: fx (0.1 s a Pipeline; torch.export takes
    # seconds a process, and is run above and on the Hugging Face models).
    for shard in ("optimizer", "full"):
        for case in [(torch.bfloat16, "1f1b"), (torch.float16, "zb-h1")]:
            _check(res_model(), x, y, mse, [case], shard=shard, capture="fx")
    _overflow_in_one_replica()
    _bf16_gradient_average()
    for name, cases in [("gpt2", [(torch.bfloat16, "1f1b"), (torch.float16, "interleaved-1f1b")]),
                        ("llama", [(torch.bfloat16, "zb-h1")])]:
        model = build(name).float()
        if name == "llama":
            model.set_attn_implementation("eager")  # see tests/pipeline/execution/test_precision.py
        torch.manual_seed(1)
        xs, ys = SPECS[name].batch(2 * ROWS, 8)
        tied = frozenset({"transformer.wte.weight"}) if name == "gpt2" else frozenset()
        _check(model, xs, ys, SPECS[name].loss_fn, cases, tied)
    dist.destroy_process_group()
    print("worker amp: every check ran")


WORKERS = {"amp": worker_amp}


@pytest.mark.slow
def test_mixed_precision_pp2_dp2(tmp_path: Path) -> None:
    all_ok(launch("amp", 4, tmp_path, deadline=500.0, script=__file__, preload=HF_MODULES), "amp")


if __name__ == "__main__":
    WORKERS[sys.argv[1]](Path(sys.argv[2]))
