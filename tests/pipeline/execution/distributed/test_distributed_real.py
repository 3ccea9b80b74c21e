"""Hugging Face GPT-2 with its tied embedding / LM head under the distributed executor (4 gloo
processes launched as torchrun does): at pp=2 x dp=2 for every schedule and at pp=4 for each
placement of the tie (loop, interleaved, V), an SGD step
(two for 1F1B) gives the single-process loss and every gathered gradient (float64, 1e-9), the
whole model's gradient norm from `clip_grad_norm_`, and the gathered state_dict has the model's
own keys and values (so the tied copies stayed equal and the clipped steps matched).
The same for T5 (an embedding tied three ways, a split backward) at pp=4 zbv and pp=2 x dp=2
zb-h1, and for ALBERT (one layer called 6 times, one unit per call, its weights on every rank)
at pp=4 1F1B and pp=2 x dp=2 zb-h1.

One launch runs every case of both tests (starting a process with torch costs seconds), on
one model per family given back its initial tensors before each case, so each process exports
each model once (`tests.support.capture_memo`: both pipeline sizes capture on the same two-row
microbatch; export took most of this test's time). This file is also the worker:
``python <this file> real OUT_DIR``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from scheduler import SCHEDULES
from tests.support.distributed import HF_MODULES, Ended, all_ok, dump, launch

ATOL = 1e-9
ROWS = 8  # per replica
CLIP = 0.05  # below every step's gradient norm here, so clipping scales


def _batch(name: str, step: int, rows: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    from tests.support.real_models import SPECS

    torch.manual_seed(500 + step)
    return SPECS[name].batch(rows, 8)


def _tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


def _check_model(name: str, cases: dict[int, list[tuple[str, int]]]) -> None:
    """`cases[pp]`: (schedule, SGD steps) run on one model, given back its initial tensors
    before each case; every loss, gathered gradient and the gathered state against the
    single-process model."""
    from pipeline import Pipeline
    from pipeline.checkpoint import gather_named
    from tests.support.real_models import SPECS, build

    loss_fn = SPECS[name].loss_fn
    model = build(name)
    initial = {k: t.detach().clone() for k, t in _tensors(model)}
    for pp, schedules in cases.items():
        for schedule, steps in schedules:
            label = f"{name} pp={pp} {schedule}"
            ref = build(name)
            for k, t in _tensors(model):  # the executor freed the others' stages' tensors
                t.data = initial[k].clone()
            pipe = Pipeline(model, stages=pp, schedule=schedule, microbatches=2 * pp,
                            loss_fn=loss_fn, balance="parameters")
            ctx = pipe.distributed
            assert ctx is not None
            dp, d = ctx.layout.data_parallel, ctx.layout.dp_rank
            opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
            for step in range(steps):
                x, y = _batch(name, step, ROWS * dp)
                ref.zero_grad()
                expected = loss_fn(ref(**x), y)
                expected.backward()
                pipe.zero_grad()
                mine = {k: v[d * ROWS : (d + 1) * ROWS] for k, v in x.items()}
                loss = pipe.step(mine, y[d * ROWS : (d + 1) * ROWS])
                torch.testing.assert_close(loss.double(), expected.detach(), atol=ATOL, rtol=0,
                                           msg=f"{label}: loss of step {step}")
                grads = gather_named({k: p.grad for k, p in pipe.named_parameters()}, ctx)
                if grads is not None:
                    want = dict(ref.named_parameters())
                    assert sorted(grads) == sorted(want), f"{label}: {sorted(grads)}"
                    for k, g in grads.items():
                        torch.testing.assert_close(g, want[k].grad, atol=ATOL, rtol=0,
                                                   msg=f"{label}: grad of {k}, step {step}")
                # Clipping by the whole model's norm: the same norm on every process (a
                # tied parameter counted once) and the same scaled gradients.
                torch.testing.assert_close(
                    pipe.clip_grad_norm_(CLIP).double(),
                    torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP).double(),
                    atol=ATOL, rtol=0, msg=f"{label}: gradient norm, step {step}")
                opt.step()
                ref_opt.step()
            if name == "albert":  # the shared layer's calls (and weights) on several ranks
                calls = [any("albert_layers_0" in v for v in s) for s in pipe.plan.stages]
                assert sum(calls) >= 2, f"{label}: {pipe.plan}"
            state = pipe.state_dict()
            if state is not None:
                assert sorted(state) == sorted(ref.state_dict()), f"{label}: {sorted(state)}"
                for k, v in ref.state_dict().items():
                    torch.testing.assert_close(state[k], v, atol=ATOL, rtol=0,
                                               msg=f"{label}: state {k}")


def worker_real(out: Path) -> None:
    import torch.distributed as dist

    from pipeline.planning import planner
    from tests.support.capture_memo import memo_capture

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    planner.capture = memo_capture()  # type: ignore[assignment]
    # GPT-2: pp=2 x dp=2 runs every schedule (1F1B two steps); at pp=4 one schedule per
    # placement of the tie: loop (1f1b), interleaved, V (stage 0 and the last on one rank).
    _check_model("gpt2", {
        2: [(s, 2 if s == "1f1b" else 1) for s in sorted(SCHEDULES)],
        4: [("1f1b", 2), ("interleaved-1f1b", 1), ("zbv", 1)],
    })
    # T5: one embedding tied three ways (encoder, decoder, head) over the ranks, and a
    # relative position bias each stack's first stage makes and sends on, under a split
    # backward.
    _check_model("t5", {4: [("zbv", 1)], 2: [("zb-h1", 1)]})
    print("worker tied: every check ran", flush=True)
    # ALBERT's one layer called 6 times: one unit per call, spread by parameters over the
    # ranks, so the layer's weights live on every rank and are handled as a tie.
    _check_model("albert", {4: [("1f1b", 2)], 2: [("zb-h1", 1)]})
    dist.destroy_process_group()
    print("worker shared: every check ran")


WORKERS = {"real": worker_real}


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> list[Ended]:
    """One launch for both tests: each checks the part of the run its marker ends."""
    return launch("real", 4, tmp_path_factory.mktemp("real"), deadline=290.0, script=__file__,
                  preload=HF_MODULES)


@pytest.mark.slow
def test_tied_gpt2_every_schedule(real_run: list[Ended]) -> None:
    assert all("worker tied: every check ran" in e.output for e in real_run), dump(real_run)


@pytest.mark.slow
def test_shared_layer_calls_on_several_ranks(real_run: list[Ended]) -> None:
    all_ok(real_run, "shared")


if __name__ == "__main__":
    WORKERS[sys.argv[1]](Path(sys.argv[2]))
