"""A failed step leaves no trace: a stuck stage, a timeout or Ctrl-C cancels the workers (the
caller gets the error while a stuck worker still computes, and that worker never writes into
`.grad` afterwards, neither into the restored grads nor into a retried step's); input grads
equal the unsplit model's under every schedule; unclear inputs (a loss_fn returning None or a
str, a binary schedule file, two threads stepping one Pipeline) raise errors naming the value
and the fix, with the parameters' grads unchanged."""

from __future__ import annotations

import copy
import signal
import threading
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipeline import Pipeline
from scheduler import SCHEDULES

ATOL = 1e-10


def _pipeline_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("hybridpipe-")]


class _Gate:
    """`entered` is set when the armed call arrives; that call then waits for `release`."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __deepcopy__(self, memo: dict[int, object]) -> _Gate:
        return _Gate()  # a reference copy of the model never blocks

    def block(self) -> None:
        self.entered.set()
        if not self.release.wait(60):
            raise RuntimeError("the test never released the gate")


class _BlockBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gate: _Gate) -> torch.Tensor:
        ctx.gate = gate
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.gate.block()
        return grad, None


class Blocker(nn.Module):
    """Identity that, once armed, blocks in the backward of its `at`-th call (1-based) until
    the gate opens."""

    def __init__(self) -> None:
        super().__init__()
        self.at, self.calls = 0, 0
        self.gate = _Gate()

    def arm(self, at: int) -> _Gate:
        self.at, self.calls, self.gate = at, 0, _Gate()
        return self.gate

    def blocks_now(self) -> bool:
        self.calls += 1
        return self.calls == self.at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _BlockBackward.apply(x, self.gate) if self.blocks_now() else x


class ForwardBlocker(Blocker):
    """As Blocker, blocking in forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks_now():
            self.gate.block()
        return x


def _model(blocker: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 6), nn.Tanh(), blocker, nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)
    ).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 6, dtype=torch.float64, generator=g)
    return x, torch.randint(0, 3, (8,), generator=g)


def _pipe(model: nn.Module, leaf: type, **kw: Any) -> Pipeline:
    kw = {"schedule": "1f1b", "microbatches": 4, "timeout": 3.0, **kw}
    return Pipeline(model, 2, balance="uniform", loss_fn=nn.CrossEntropyLoss(),
                    leaf_modules=(leaf,), **kw)


def _fill_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)  # grads from an earlier step, to be kept as they are


def _assert_grads_are_sevens(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, torch.full_like(p, 7.0)), name


def _reference_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    nn.CrossEntropyLoss()(ref(x), y).backward()
    return {k: p.grad for k, p in ref.named_parameters()}


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("at", [2, 4], ids=["peer-waits", "no-peer-waits"])
def test_stuck_stage_times_out_and_its_worker_never_writes_grads(at: int) -> None:
    """Stage 0 blocks in the backward of its 2nd call (stage 1 then waits for a forward and
    times out) or of its last call (no rank waits on it: no action starts for `timeout`)."""
    blocker = Blocker()
    model = _model(blocker)
    x, y = _data()
    pipe = _pipe(model, Blocker)
    pipe.step(x, y)  # plan and warm up
    _fill_grads(model)
    own = [id(p) for p in model.parameters()]
    gate = blocker.arm(at)
    with pytest.raises(TimeoutError) as info:
        pipe.step(x, y)
    # The caller got the error while the stuck worker still computes; the note names it.
    assert gate.entered.is_set() and not gate.release.is_set()
    # The model holds its own Parameters again, not the step's private leaves.
    assert [id(p) for p in model.parameters()] == own
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())
    assert any("pipeline rank 0 in 0B" in note for note in info.value.__notes__), info.value
    stale = _pipeline_threads()
    assert [t.name for t in stale] == ["hybridpipe-rank0"]
    _assert_grads_are_sevens(model)
    # A retried step runs on fresh worker state while the stale worker is still stuck.
    model.zero_grad(set_to_none=True)
    expected = _reference_grads(model, x, y)
    pipe.step(x, y)
    # The stale worker finishes its backward now: it must not add into the retried grads.
    gate.release.set()
    stale[0].join(30)
    assert not stale[0].is_alive()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], atol=ATOL, rtol=0, msg=name)
    assert _pipeline_threads() == []


@pytest.mark.timeout(60)
def test_ctrl_c_cancels_the_step_and_leaves_grads_unchanged() -> None:
    blocker = Blocker()
    model = _model(blocker)
    x, y = _data()
    pipe = _pipe(model, Blocker, timeout=30.0)
    _fill_grads(model)
    gate = blocker.arm(2)

    def interrupt() -> None:
        if gate.entered.wait(30):
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    sender = threading.Thread(target=interrupt)
    sender.start()
    with pytest.raises(KeyboardInterrupt):
        pipe.step(x, y)
    sender.join(30)
    stale = _pipeline_threads()
    _assert_grads_are_sevens(model)
    gate.release.set()  # the interrupted worker finishes its backward: no write may follow
    for t in stale:
        t.join(30)
    assert _pipeline_threads() == []
    _assert_grads_are_sevens(model)
    model.zero_grad(set_to_none=True)
    expected = _reference_grads(model, x, y)
    pipe.step(x, y)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_input_grads_equal_the_unsplit_model_under_every_schedule(schedule: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)],
                          nn.Linear(6, 3)).double()
    x, y = _data()
    base = x.clone().requires_grad_(True)
    ref_base = x.clone().requires_grad_(True)
    leaf = x.clone().requires_grad_(True)
    ref_leaf = x.clone().requires_grad_(True)
    ref = copy.deepcopy(model)
    ref_loss = nn.CrossEntropyLoss()(ref(ref_leaf), y) + nn.CrossEntropyLoss()(ref(ref_base * 2), y)
    ref_loss.backward()
    pipe = Pipeline(model, 2, schedule=schedule, microbatches=4, balance="uniform",
                    loss_fn=nn.CrossEntropyLoss())
    pipe.step(leaf, y)  # a leaf input
    pipe.step(base * 2, y)  # a computed input: its grad flows on to `base`
    assert leaf.grad is not None and base.grad is not None
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, atol=ATOL, rtol=0)
    torch.testing.assert_close(base.grad, ref_base.grad, atol=ATOL, rtol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_failed_step_leaves_input_grads_unchanged(schedule: str) -> None:
    calls: list[int] = []

    def fails_on_the_last_microbatch(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 4:
            raise ValueError("loss failed on the last microbatch")
        return nn.functional.cross_entropy(out, target)

    model = _model(nn.Identity())
    x, y = _data()
    pipe = Pipeline(model, 2, schedule=schedule, microbatches=4, balance="uniform",
                    loss_fn=fails_on_the_last_microbatch)
    leaf = x.clone().requires_grad_(True)
    leaf.grad = torch.full_like(leaf, 3.0)
    _fill_grads(model)
    with pytest.raises(ValueError, match="loss failed on the last microbatch"):
        pipe.step(leaf, y)
    assert torch.equal(leaf.grad, torch.full_like(leaf, 3.0))
    _assert_grads_are_sevens(model)


@pytest.mark.parametrize(
    ("value", "shown"), [(None, "None (a NoneType)"), ("loss", "'loss' (a str)")]
)
def test_loss_fn_returning_not_a_tensor_is_named(value: Any, shown: str) -> None:
    model = _model(nn.Identity())
    x, y = _data()

    def no_return(out: torch.Tensor, target: torch.Tensor) -> Any:
        nn.functional.cross_entropy(out, target)
        return value

    pipe = Pipeline(model, 2, microbatches=4, balance="uniform", loss_fn=no_return)
    _fill_grads(model)
    with pytest.raises(TypeError, match=(
        r"loss_fn .*no_return returned " + shown.replace("(", r"\(").replace(")", r"\)")
        + r" for microbatch 0; it must return a scalar tensor.*`return loss`"
    )):
        pipe.step(x, y)
    _assert_grads_are_sevens(model)
    assert _pipeline_threads() == []


@pytest.mark.parametrize("loss_fn", [lambda out: out.sum(), lambda out, y, scale: out.sum()])
def test_loss_fn_of_another_signature_is_refused_at_construction(loss_fn: Any) -> None:
    with pytest.raises(TypeError, match=(
        r"loss_fn <lambda>\(out.*\) cannot be called as loss_fn\(output, targets\).*"
        r"model's output and the targets.*nn.CrossEntropyLoss\(\)"
    )):
        Pipeline(_model(nn.Identity()), 2, loss_fn=loss_fn)
    with pytest.raises(TypeError,
                       match=r"loss_fn must be callable as loss_fn\(output, targets\)"):
        Pipeline(_model(nn.Identity()), 2, loss_fn="cross_entropy")  # type: ignore[arg-type]


def test_error_raised_inside_loss_fn_names_it_and_how_it_is_called() -> None:
    """The error is the user's own (type, message, traceback), with a note saying which
    loss_fn raised it, on which microbatch, with what (the output's and the targets' shapes)
    and the signature."""
    model = _model(nn.Identity())
    x, y = _data()

    def wrong_targets(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out @ target.double()).sum()  # (2, 3) @ (2,): a RuntimeError

    pipe = Pipeline(model, 2, microbatches=4, balance="uniform", loss_fn=wrong_targets)
    _fill_grads(model)
    with pytest.raises(RuntimeError, match=(
        r"loss_fn .*wrong_targets raised RuntimeError on microbatch 0: .*It is called as "
        r"loss_fn\(output, targets\) with the model's output \(a float\w* tensor of shape "
        r"\(\d+, \d+\)\) and that microbatch's targets \(a int64 tensor of shape \(\d+,\)\)"
    )) as caught:
        pipe.step(x, y)
    assert caught.value.__notes__[0].startswith("loss_fn ")  # a note; the message is torch's
    assert "wrong_targets" not in str(caught.value)
    assert "wrong_targets" in "".join(traceback.format_tb(caught.value.__traceback__))
    _assert_grads_are_sevens(model)


def test_binary_schedule_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "schedule.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(ValueError, match=(
        r"schedule file '.*schedule.png' is not text \(byte 0 is b'\\x89', not UTF-8\); "
        r"give a text file with one line of actions per rank"
    )):
        Pipeline(_model(nn.Identity()), 2, schedule=path, loss_fn=nn.CrossEntropyLoss())


@pytest.mark.timeout(60)
def test_second_thread_stepping_the_same_pipeline_is_refused() -> None:
    blocker = ForwardBlocker()
    model = _model(blocker)
    x, y = _data()
    pipe = _pipe(model, ForwardBlocker, timeout=30.0)
    expected = _reference_grads(model, x, y)
    gate = blocker.arm(1)
    losses: list[torch.Tensor] = []
    first = threading.Thread(target=lambda: losses.append(pipe.step(x, y)), name="trainer")
    first.start()
    assert gate.entered.wait(30)
    with pytest.raises(RuntimeError, match=(
        r"Pipeline.step in thread 'MainThread' was called while Pipeline.step in thread "
        r"'trainer' is running; a Pipeline runs one call at a time"
    )):
        pipe.step(x, y)
    with pytest.raises(RuntimeError, match="while Pipeline.step in thread 'trainer'"):
        pipe(x)
    gate.release.set()
    first.join(30)
    assert len(losses) == 1  # the running step was not disturbed
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], atol=ATOL, rtol=0, msg=name)
