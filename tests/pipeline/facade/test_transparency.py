"""A Pipeline trains exactly as the unsplit model: same loss and same gradient on every parameter
(float64, atol 1e-10) for every schedule x stages x microbatches within the published size
limits (stated here, not read back from the scheduler), with the schedule that ran checked
against the structure each name promises (chunks, split backward, placement, per-rank order in
the measured trace); on a GPT-style model and a model with a skip crossing several stage
boundaries, and on resnet18 (eval mode) at every schedule's deepest split and every size under
1F1B and ZB-H1; plus 20 SGD steps, profile balancing, activation
checkpointing, forward, and a fuzz over random MLPs."""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torchvision
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from pipeline import Pipeline
from pipeline.app.models import GPT, SkipNet
from pipeline.planning import planner
from scheduler import SCHEDULES, Action, Op
from tests.support.capture_memo import memo_capture
from tests.support.models import lm_loss

ATOL = 1e-10
SIZES = [(p, m) for p in (1, 2, 4) for m in (1, 3, 8)]
# What each schedule must run, stated here rather than read back from the generators: chunks
# per rank, whether backward is split into B and W, and the stage -> rank placement.
STRUCTURE: dict[str, tuple[int, bool, Callable[[int, int], int]]] = {
    "gpipe": (1, False, lambda stage, p: stage),
    "1f1b": (1, False, lambda stage, p: stage),
    "1f1b-eager": (1, False, lambda stage, p: stage),
    "interleaved-1f1b": (2, False, lambda stage, p: stage % p),  # Megatron: round robin
    "zb-h1": (1, True, lambda stage, p: stage),
    "zb-h2": (1, True, lambda stage, p: stage),
    "zbv": (2, True, lambda stage, p: min(stage, 2 * p - 1 - stage)),  # V: down then back up
    "dualpipev": (2, True, lambda stage, p: min(stage, 2 * p - 1 - stage)),  # the same V
}


def _size_allowed(name: str, p: int, m: int) -> bool:
    """The published size limits: Megatron's interleaving groups microbatches by p, so m must
    be a multiple of p; ZB-V needs m >= 2p-1 to fill its warm-up; DualPipeV (as torch's) one
    microbatch per stage, m >= 2p. Everything else runs any m."""
    if name == "interleaved-1f1b":
        return m % p == 0
    if name == "zbv":
        return m >= 2 * p - 1
    if name == "dualpipev":
        return m >= 2 * p
    return True


ACCEPTED = [(n, p, m) for n in STRUCTURE for p, m in SIZES if _size_allowed(n, p, m)]
REJECTED = [(n, p, m) for n in STRUCTURE for p, m in SIZES if not _size_allowed(n, p, m)]
# The refusal names the values and the fix.
REJECTION = {
    "interleaved-1f1b": "needs microbatches a multiple of ranks (got microbatches={m}, ranks={p}); "
    "use microbatches=",
    "zbv": "zbv needs microbatches >= 2*ranks-1 = {lo} (got {m}) to fill its warm-up; "
    "use microbatches >= {lo}",
    "dualpipev": "dualpipev needs microbatches >= 2*ranks = {hi} (got {m}), one per stage",
}


def check_ran_as_stated(pipe: Pipeline, name: str, stages: int, microbatches: int) -> None:
    """The schedule that ran has `STRUCTURE[name]`, and the measured trace shows every rank
    running exactly its list, in order, including separate W actions for a split backward."""
    v, split, rank_of = STRUCTURE[name]
    s = pipe.schedule
    assert (s.name, s.num_ranks, s.num_microbatches) == (name, stages, microbatches)
    assert (s.virtual_stages, s.num_stages, s.splits_backward) == (v, v * stages, split)
    assert s.placement == tuple(rank_of(stage, stages) for stage in range(v * stages))
    assert len(pipe.plan.stages) == v * stages
    trace = pipe.trace
    assert trace is not None and trace.splits_backward == split
    ops = (Op.F, Op.B, Op.W) if split else (Op.F, Op.B)
    assert len(trace.events) == len(ops) * v * stages * microbatches
    for rank in range(stages):
        ran = [Action(e.stage, e.op, e.microbatch) for e in trace.for_rank(rank)]
        assert ran == list(s.actions[rank]), f"rank {rank} ran {ran}"


class Case:
    """A model with a batch, a loss and the single-device loss and gradients."""

    def __init__(
        self,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        loss_fn: Callable[[Any, Any], torch.Tensor],
    ) -> None:
        self.model, self.x, self.y, self.loss_fn = model, x, y, loss_fn
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        self.loss = loss.detach()
        self.grads = {n: torch.clone(p.grad) for n, p in model.named_parameters()}  # type: ignore[arg-type]
        model.zero_grad(set_to_none=True)

    def check(self, pipe: Pipeline) -> None:
        self.model.zero_grad(set_to_none=True)
        loss = pipe.step(self.x, self.y)
        torch.testing.assert_close(loss, self.loss, atol=ATOL, rtol=0)
        for name, p in pipe.named_parameters():
            assert p.grad is not None, f"{name} got no gradient"
            torch.testing.assert_close(p.grad, self.grads[name], atol=ATOL, rtol=0, msg=name)


def _gpt() -> Case:
    torch.manual_seed(0)
    model = GPT(vocab=32, dim=16, layers=4, heads=2, max_seq=8).double()
    x = torch.randint(0, 32, (8, 6))
    y = torch.randint(0, 32, (8, 6))
    return Case(model, x, y, lm_loss)


def _resnet() -> Case:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5).double().eval()
    x = torch.randn(8, 3, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 5, (8,))
    return Case(model, x, y, nn.CrossEntropyLoss())


def _skipnet() -> Case:
    torch.manual_seed(0)
    model = SkipNet(dim=8, blocks=6, classes=4).double()
    x = torch.randn(9, 8, dtype=torch.float64)
    y = torch.randint(0, 4, (9,))
    return Case(model, x, y, nn.CrossEntropyLoss())


MODELS = {"gpt": _gpt, "resnet18": _resnet, "skipnet": _skipnet}


@pytest.fixture(scope="module")
def cases() -> dict[str, Case]:
    return {name: make() for name, make in MODELS.items()}


_CAPTURE = memo_capture()  # one memo for the whole matrix


@pytest.fixture
def capture_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The schedule x size matrix runs each model's capture once per example shape (torch.export
    takes ~2 s a call on resnet18, most of this file's time): every Pipeline still partitions,
    splits and runs a copy of the real captured graph (capture has its own tests)."""
    monkeypatch.setattr(planner, "capture", _CAPTURE)


def _resnet_case(schedule: str, stages: int, microbatches: int) -> bool:
    """The resnet18 cases (0.8 s of CPU each, 60 of them were most of this file's time): what
    is particular to the model is its split into p x chunks stages, its microbatches of 4-d
    inputs and, under a split backward, its separate weight-grad pass; the order each
    schedule runs is the same for any model and is checked on the GPT and the skip model at
    every size. So resnet18 runs every schedule at its deepest split (4 ranks, 8 microbatches)
    and every (ranks, microbatches) size under a whole (1F1B) and a split (ZB-H1) backward."""
    return schedule in ("1f1b", "zb-h1") or (stages, microbatches) == (4, 8)


CASES = [(n, p, m, model) for n, p, m in ACCEPTED for model in MODELS
         if model != "resnet18" or _resnet_case(n, p, m)]


@pytest.mark.usefixtures("capture_once")
@pytest.mark.parametrize(("schedule", "stages", "microbatches", "model_name"), CASES)
def test_transparency(
    cases: dict[str, Case], model_name: str, schedule: str, stages: int, microbatches: int
) -> None:
    case = cases[model_name]
    pipe = Pipeline(
        case.model,
        stages,
        schedule=schedule,
        microbatches=microbatches,
        loss_fn=case.loss_fn,
        balance="uniform",
    )
    case.check(pipe)
    check_ran_as_stated(pipe, schedule, stages, microbatches)


def test_every_registered_schedule_is_covered() -> None:
    assert sorted(SCHEDULES) == sorted(STRUCTURE), "add the new schedule to STRUCTURE"


@pytest.mark.parametrize(("schedule", "stages", "microbatches"), REJECTED)
def test_rejected_sizes_raise_before_running(
    cases: dict[str, Case], schedule: str, stages: int, microbatches: int
) -> None:
    case = cases["skipnet"]
    expected = REJECTION[schedule].format(
        m=microbatches, p=stages, lo=2 * stages - 1, hi=2 * stages
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        Pipeline(
            case.model,
            stages,
            schedule=schedule,
            microbatches=microbatches,
            loss_fn=case.loss_fn,
            balance="uniform",
        )


def test_skip_connection_crosses_two_boundaries(cases: dict[str, Case]) -> None:
    case = cases["skipnet"]
    pipe = Pipeline(
        case.model, 4, microbatches=3, loss_fn=case.loss_fn, balance="uniform", example_input=case.x
    )
    stem_out = pipe.stage_modules[0].output_names
    carried = [k for k, s in enumerate(pipe.stage_modules) if set(stem_out) & set(s.input_names)]
    assert len(carried) >= 2, [s.input_names for s in pipe.stage_modules]
    case.check(pipe)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zbv"])
def test_checkpoint_activations(cases: dict[str, Case], schedule: str) -> None:
    case = cases["gpt"]
    pipe = Pipeline(
        case.model,
        2,
        schedule=schedule,
        microbatches=4,
        loss_fn=case.loss_fn,
        balance="uniform",
        checkpoint_activations=True,
    )
    case.check(pipe)
    check_ran_as_stated(pipe, schedule, 2, 4)


def test_profile_balance_and_lazy_plan(cases: dict[str, Case]) -> None:
    case = cases["skipnet"]
    pipe = Pipeline(case.model, 2, loss_fn=case.loss_fn)  # balance="profile", lazy plan
    with pytest.raises(RuntimeError, match="first batch"):
        _ = pipe.plan
    case.check(pipe)
    assert pipe.plan.method == "profile"
    assert pipe.microbatches == 4  # default: 2 x stages, batch 9 allows it
    predicted, measured = pipe.simulate(), pipe.trace
    assert measured is not None
    assert predicted.num_ranks == 2 and len(predicted.events) == len(measured.events)


def test_uneven_microbatches_weight_the_loss(cases: dict[str, Case]) -> None:
    case = cases["skipnet"]  # batch 9 into 4 microbatches: sizes 3, 2, 2, 2
    pipe = Pipeline(case.model, 2, microbatches=4, loss_fn=case.loss_fn, balance="uniform")
    case.check(pipe)


def test_twenty_sgd_steps_match_single_device() -> None:
    torch.manual_seed(1)
    model = GPT(vocab=32, dim=16, layers=2, heads=2, max_seq=8).double()
    twin = copy.deepcopy(model)
    pipe = Pipeline(
        model, 2, schedule="zb-h1", microbatches=4, loss_fn=lm_loss, balance="parameters"
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt_twin = torch.optim.SGD(twin.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(2)
    losses, twin_losses = [], []
    for _ in range(20):
        x = torch.randint(0, 32, (8, 6), generator=gen)
        y = torch.randint(0, 32, (8, 6), generator=gen)
        opt.zero_grad()
        losses.append(pipe.step(x, y))
        opt.step()
        opt_twin.zero_grad()
        loss = lm_loss(twin(x), y)
        loss.backward()
        opt_twin.step()
        twin_losses.append(loss.detach())
    torch.testing.assert_close(torch.stack(losses), torch.stack(twin_losses), atol=ATOL, rtol=0)
    assert losses[-1] < losses[0]  # it trained


def test_forward_equals_model_and_keeps_no_graph(cases: dict[str, Case]) -> None:
    case = cases["resnet18"]
    pipe = Pipeline(
        case.model,
        4,
        schedule="interleaved-1f1b",
        microbatches=4,
        loss_fn=case.loss_fn,
        balance="uniform",
    )
    with torch.no_grad():
        out = pipe(case.x)
        expected = case.model(case.x)
    assert out.grad_fn is None and not out.requires_grad
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    small = case.x[:3]  # fewer samples than microbatches: forward uses 3 microbatches
    with torch.no_grad():
        torch.testing.assert_close(pipe(small), case.model(small), atol=ATOL, rtol=0)


def test_forward_with_grad_stays_connected(cases: dict[str, Case]) -> None:
    case = cases["gpt"]
    pipe = Pipeline(case.model, 2, microbatches=2, loss_fn=case.loss_fn, balance="uniform")
    case.model.zero_grad(set_to_none=True)
    case.loss_fn(pipe(case.x), case.y).backward()
    for name, p in case.model.named_parameters():
        torch.testing.assert_close(p.grad, case.grads[name], atol=ATOL, rtol=0, msg=name)
    case.model.zero_grad(set_to_none=True)


def test_tuple_and_dict_outputs_and_inputs() -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.c = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor, z: torch.Tensor) -> dict[str, torch.Tensor]:
            h = torch.tanh(self.b(torch.tanh(self.a(x)) + z))
            return {"logits": self.c(h), "h": h}

    def loss_fn(out: dict[str, torch.Tensor], y: tuple[torch.Tensor, torch.Tensor]) -> Any:
        return F.cross_entropy(out["logits"], y[0]) + F.mse_loss(out["h"], y[1])

    torch.manual_seed(3)
    model = TwoHeads().double()
    x, z = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    y = (torch.randint(0, 3, (6,)), torch.randn(6, 4, dtype=torch.float64))
    pipe = Pipeline(model, 2, microbatches=3, loss_fn=loss_fn, balance="uniform")
    ref = copy.deepcopy(model)
    ref_loss = loss_fn(ref(x, z), y)
    ref_loss.backward()
    loss = pipe.step({"x": x, "z": z}, y)
    torch.testing.assert_close(loss, ref_loss.detach(), atol=ATOL, rtol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=0, msg=name)
    with torch.no_grad():
        out = pipe((x, z))
    assert set(out) == {"logits", "h"}
    torch.testing.assert_close(out["logits"], ref(x, z)["logits"], atol=ATOL, rtol=0)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    widths=st.lists(st.integers(1, 6), min_size=2, max_size=7),
    schedule=st.sampled_from(sorted(STRUCTURE)),
    stages=st.integers(1, 3),
    microbatches=st.integers(1, 6),
    extra=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_fuzz_random_mlps(
    widths: list[int], schedule: str, stages: int, microbatches: int, extra: int, seed: int
) -> None:
    """Random MLP depth/widths, stage and microbatch counts: transparency holds wherever the
    schedule and partitioner accept the sizes (and they raise ValueError otherwise)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(a, b), nn.Tanh()]
    model = nn.Sequential(*layers).double()
    batch = microbatches + extra
    x = torch.randn(batch, widths[0], dtype=torch.float64)
    y = torch.randn(batch, widths[-1], dtype=torch.float64)
    fits = _size_allowed(schedule, stages, microbatches) and (
        stages * STRUCTURE[schedule][0] <= len(layers)
    )
    build = functools.partial(
        Pipeline,
        model,
        stages,
        schedule=schedule,
        microbatches=microbatches,
        loss_fn=F.mse_loss,
        balance="uniform",
        example_input=x,
    )
    if not fits:
        with pytest.raises(ValueError):
            build()
        return
    pipe = build()
    Case(model, x, y, F.mse_loss).check(pipe)
    check_ran_as_stated(pipe, schedule, stages, microbatches)


class CountForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize(
    ("schedule", "expected"), [("1f1b", [6, 6, 6, 6]), ("zb-h1", [6, 6, 6, 6])]
)
def test_checkpoint_recomputes_in_backward(schedule: str, expected: list[int]) -> None:
    """3 microbatches: each block runs once in F and once more in the backward that needs it,
    also under split backward (a recomputing stage takes its weight grads in B)."""
    torch.manual_seed(0)
    blocks = [CountForward() for _ in range(4)]
    model = nn.Sequential(*blocks).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    pipe = Pipeline(
        model,
        2,
        schedule=schedule,
        microbatches=3,
        loss_fn=F.mse_loss,
        balance="uniform",
        checkpoint_activations=True,
        leaf_modules=(CountForward,),
        example_input=x,
    )
    for block in blocks:
        block.calls = 0
    ref = copy.deepcopy(model)
    expected_loss = F.mse_loss(ref(x), y)
    expected_loss.backward()
    torch.testing.assert_close(pipe.step(x, y), expected_loss.detach(), atol=ATOL, rtol=0)
    assert [b.calls for b in blocks] == expected
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=0)
