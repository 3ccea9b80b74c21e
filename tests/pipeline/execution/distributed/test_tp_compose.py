"""Tensor parallelism composed with what else wraps a stage, at pp=2 x tp=2 (4 gloo processes
launched as torchrun does), against the unsplit model with the same microbatching:

- every activation policy: "full" and "selective" (a per-stage list) on a Hugging Face Llama
  (1F1B), "selective" and "offload" on GPT-2 (tied embedding, fused qkv) under ZB-H1 (B and
  W split), and "auto" under a tight memory limit on residual MLP blocks with BatchNorm:
  loss, every gradient (`full_tensor()` of each sharded one) and every held buffer equal to
  1e-9 in float64; the recomputed blocks re-run their tp collectives in the backward, and
  BatchNorm's running statistics are updated once per microbatch;
- `pipe.eval()` / `pipe.evaluate(...)` (the stages' code captured again in eval mode) equal
  the unsplit model's eval() losses (the BatchNorm model, whose eval mode reads the running
  statistics);
- ``mixed_precision=torch.bfloat16`` (CPU autocast): the loss and every gradient are within
  bf16's tolerance of the unsplit model under the same autocast, nearer to it than to the
  fp32 model, and the last stage's output is bf16 (a dropped autocast fails);
- loss parallelism: Llama's cross entropy (lm_loss) runs on the logits split by class under
  torch's loss_parallel, exact as above; a cross entropy with label smoothing (which
  loss_parallel does not take) falls back to the gathered logits, exact, the plan saying why;
- ``compile=`` (the regions of a tensor-parallel stage compiled by torch.compile with
  inductor, DTensors and their collectives traced) on residual MLP blocks under 1F1B, two
  steps: loss and every gradient equal to 1e-9 in float64 to the unsplit model compiled, no
  region eager, and the compiled code ran (a backend counting the calls of inductor's code:
  a silent eager fallback fails); a split-backward schedule with it is refused by name.

One launch runs every case. This file is also the worker: ``python <this file> mix OUT_DIR``."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.support.distributed import HF_MODULES, all_ok, launch

ATOL = 1e-9
ROWS = 4
SEQ = 6
VOCAB = 48
M = 4  # microbatches


def _llama(init: float) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, initializer_range=init,
    )
    return LlamaForCausalLM(config)


class _Normed(nn.Module):
    """Residual MLP blocks (a column/row-parallel pair each), each followed by a BatchNorm1d
    whose running statistics a recomputation must not update twice."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"up": nn.Linear(8, 16), "down": nn.Linear(16, 8),
                           "norm": nn.BatchNorm1d(8)}) for _ in range(2))
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b["norm"](h + b["down"](torch.relu(b["up"](h))))
        return self.out(h)


class _MLP(nn.Module):
    """Residual MLP blocks (a column/row-parallel pair each): the tiniest tp model."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"up": nn.Linear(8, 16), "down": nn.Linear(16, 8)}) for _ in range(2))
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = h + b["down"](torch.relu(b["up"](h)))
        return self.out(h)


TABULAR = ("normed", "mlp")  # tensors in, class labels out (the others: token ids)


def _build(name: str, dtype: torch.dtype = torch.float64, init: float = 0.02) -> nn.Module:
    from tests.support.real_models import gpt2

    torch.manual_seed(0)
    models = {"gpt2": gpt2, "normed": _Normed, "mlp": _MLP}
    model = models[name]() if name in models else _llama(init)
    return model.to(dtype)


def _batch(name: str, step: int, dtype: torch.dtype = torch.float64) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(900 + step)
    if name in TABULAR:  # two rows a microbatch: BatchNorm needs more than one
        return (torch.randn(2 * ROWS, 4, generator=g).to(dtype),
                torch.randint(0, 3, (2 * ROWS,), generator=g))
    return ({"input_ids": torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)},
            torch.randint(0, VOCAB, (ROWS, SEQ), generator=g))


def _whole(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _smoothed(out: Any, target: torch.Tensor) -> torch.Tensor:
    """A cross entropy with label smoothing: torch's loss_parallel does not take it (it
    raises), so the logits are gathered."""
    logits = getattr(out, "logits", out)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                             target.reshape(-1), label_smoothing=0.1)


def _loss(name: str) -> Callable[..., torch.Tensor]:
    from tests.support.models import lm_loss

    return torch.nn.functional.cross_entropy if name in TABULAR else \
        _smoothed if name == "llama smoothed" else lm_loss


def _reference(name: str, ref: nn.Module, x: Any, y: torch.Tensor, train: bool = True,
               autocast: AbstractContextManager[Any] | None = None) -> torch.Tensor:
    """The unsplit model microbatch by microbatch (the sum of loss_m * n_m / n, each
    microbatch's backward when `train`), the loss in fp32 or float64 as the pipeline's."""
    xs = x.tensor_split(M) if name in TABULAR else [
        {"input_ids": t} for t in x["input_ids"].tensor_split(M)]
    total = torch.zeros((), dtype=torch.float64)
    for xm, ym in zip(xs, y.tensor_split(M), strict=True):
        with autocast or nullcontext():
            out = ref(xm) if name in TABULAR else ref(**xm)
        logits = getattr(out, "logits", out)
        if logits.dtype == torch.bfloat16:
            logits = logits.float()
        loss = _loss(name)(logits, ym) * len(ym) / len(y)
        if train:
            loss.backward()
        total += loss.detach().double()
    return total


def _recomputed_blocks(pipe: Any) -> int:
    """How many block calls of the last step ran under a recompute policy (their forward run
    again in the backward, tp collectives included)."""
    from pipeline.execution.activations.graph import GraphRecomputed

    runs = [getattr(run, "inner", run) for run in pipe._executor.runtime._runs.values()]
    return sum(r.graph_calls + r.checkpointed_calls for run in runs
               if isinstance(run, GraphRecomputed) for r in run.runners)


def _pipeline(name: str, model: nn.Module, schedule: str, **options: Any) -> Any:
    from pipeline import Pipeline

    return Pipeline(model, stages=2, schedule=schedule, microbatches=M, loss_fn=_loss(name),
                    balance="parameters", tensor_parallel=2,
                    example_input=_batch(name, 0)[0], **options)


def _check(name: str, schedule: str = "1f1b", steps: int = 1, evaluate: bool = False,
           **options: Any) -> Any:
    """`steps` SGD steps of a pp=2 x tp=2 Pipeline against the unsplit model (compiled by
    torch.compile under ``compile=``): the loss, every gradient and every buffer this process
    holds, to 1e-9 in float64; a recompute policy recomputed blocks; with `evaluate`, then
    an evaluation in eval mode."""
    start = time.perf_counter()
    ref, model = _build(name), _build(name)
    run = torch.compile(ref) if options.get("compile") else ref
    label = f"{name} {schedule} {options}"
    pipe = _pipeline(name, model, schedule, **options)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    want = dict(ref.named_parameters(remove_duplicate=False))
    for step in range(steps):
        x, y = _batch(name, step)
        ref.zero_grad()
        expected = _reference(name, run, x, y)
        pipe.zero_grad()
        loss = pipe.step(x, y)
        torch.testing.assert_close(loss.double(), expected, atol=ATOL, rtol=0,
                                   msg=f"{label}: loss of step {step}")
        for k, p in pipe.named_parameters():
            assert p.grad is not None, f"{label}: {k} has no grad"
            torch.testing.assert_close(_whole(p.grad), want[k].grad, atol=ATOL, rtol=0,
                                       msg=f"{label}: grad of {k}, step {step}")
        opt.step()
        ref_opt.step()
    if pipe.distributed.layout.pp_rank == 1:  # the last stage: how the loss met the logits
        used = "gathered" if name in TABULAR or name == "llama smoothed" else "parallel"
        assert pipe.tp_plan.loss.used == used, f"{label}: {pipe.tp_plan.loss}"
    policy = pipe.plan.activations or options.get("checkpoint_activations", "none")
    if isinstance(policy, list):  # one stage per pipeline rank: the one this process holds
        policy = policy[pipe.distributed.layout.pp_rank]
    if policy in ("full", "selective"):
        assert _recomputed_blocks(pipe) > 0, f"{label}: no block was recomputed"
    buffers = dict(ref.named_buffers())
    for k, b in model.named_buffers():  # those of the stage this process holds
        if b.numel():
            torch.testing.assert_close(b, buffers[k], atol=ATOL, rtol=0, msg=f"{label}: {k}")
    if evaluate:
        x, y = _batch(name, 9)
        pipe.eval()
        ref.eval()
        with torch.no_grad():
            expected = _reference(name, ref, x, y, train=False)
        torch.testing.assert_close(pipe.evaluate(x, y).double(), expected, atol=ATOL, rtol=0,
                                   msg=f"{label}: evaluate in eval mode")
        pipe.train()
    print(f"{label}: exact ({time.perf_counter() - start:.1f} s)", flush=True)
    return pipe


def _policies_and_eval() -> None:
    _check("llama", checkpoint_activations=["full", "selective"])  # loss parallel
    pipe = _check("llama smoothed", steps=2)  # loss_parallel raises: the logits gathered
    if pipe.distributed.layout.pp_rank == 1:
        assert "label_smoothing" in pipe.tp_plan.loss.why or "raised" in \
            pipe.tp_plan.loss.why, pipe.tp_plan.loss
    _check("gpt2", "zb-h1", checkpoint_activations=["selective", "offload"])
    # "auto" under a tight limit recomputes; BatchNorm's statistics stay exact, and eval
    # mode (another capture) reads them.
    pipe = _check("normed", steps=2, evaluate=True, checkpoint_activations="auto",
                  memory_limit=12_500)
    assert {"full", "selective"} & set(pipe.plan.activations), pipe.plan.activations


def _bf16() -> None:
    """bf16 autocast: the loss within 1e-3 of the unsplit model's under the same autocast and
    at least 4x nearer to it than to the fp32 model's (a dropped autocast fails), every
    gradient (fp32) within 10% of its largest value of the autocast run's (tp rounds the
    row-parallel partial products to bf16 apart: measured up to 5%, as far as bf16 is from
    fp32 here), and the last stage's output bf16."""
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    # Weights large enough that the logits (so the loss) feel bf16's rounding.
    ref, fp32, model = (_build("llama", torch.float32, init=0.3) for _ in range(3))
    pipe = _pipeline("llama", model, "1f1b", mixed_precision=torch.bfloat16)
    x, y = _batch("llama", 0)
    want = _reference("llama", ref, x, y, autocast=bf16)
    full = _reference("llama", fp32, x, y)
    loss = pipe.step(x, y).double()
    gap, off = float((loss - want).abs()), float((loss - full).abs())
    assert gap < 1e-3 and off > 4 * gap, f"bf16: loss {float(loss)}, autocast {float(want)}, " \
        f"fp32 {float(full)}"
    grads = dict(ref.named_parameters(remove_duplicate=False))
    for k, p in pipe.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, k  # fp32 masters
        scale = float(grads[k].grad.abs().max())
        torch.testing.assert_close(_whole(p.grad), grads[k].grad, atol=0.1 * scale, rtol=0,
                                   msg=f"bf16: grad of {k}")
    _, out = pipe.evaluate(x, y, return_outputs=True)
    if out is not None:  # the last stage's processes
        assert out.logits.dtype == torch.bfloat16, out.logits.dtype
    print(f"bf16: loss off the unsplit autocast run {gap:.1e}, off fp32 {off:.1e}", flush=True)


COMPILED = [0]  # calls of the code inductor compiled for this process's regions


def _counting(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    """inductor, counting the calls of the code it compiled."""
    from torch._inductor.compile_fx import compile_fx

    compiled = compile_fx(gm, example_inputs)

    def run(*args: Any) -> Any:
        COMPILED[0] += 1
        return compiled(*args)

    return run


def _compiled() -> None:
    """compile=: exact against the unsplit model compiled, every region compiled (none
    eager) and the compiled code run in each step."""
    before = COMPILED[0]
    pipe = _check("mlp", steps=2, compile={"backend": _counting})
    stats = pipe.compile_stats
    assert stats is not None and stats.graphs > 0 and stats.eager == {}, stats
    assert COMPILED[0] > before, "no compiled code ran"
    with pytest.raises(ValueError, match=r"compile=.*split-backward"):
        _pipeline("mlp", _build("mlp"), "zb-h1", compile=True)


def worker_mix(out: Path) -> None:
    import torch.distributed as dist

    from pipeline.planning import planner
    from tests.support.capture_memo import memo_capture

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    planner.capture = memo_capture()  # type: ignore[assignment]
    _policies_and_eval()
    _bf16()
    _compiled()
    dist.destroy_process_group()
    print("worker mix: every check ran", flush=True)


WORKERS = {"mix": worker_mix}


@pytest.fixture(scope="module")
def mix_run(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    return launch("mix", 4, tmp_path_factory.mktemp("mix"), deadline=540.0, script=__file__,
                  preload=HF_MODULES)


@pytest.mark.slow
@pytest.mark.timeout(600)  # it runs the launch (262 s at a load average of 60 here)
def test_tp_composes_with_policies_precision_and_eval(mix_run: list[Any]) -> None:
    all_ok(mix_run, "mix")


if __name__ == "__main__":
    WORKERS[sys.argv[1]](Path(sys.argv[2]))
