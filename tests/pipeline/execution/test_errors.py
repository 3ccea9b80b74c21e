"""Pipeline failures and bad input: a worker error reaches the caller with its own traceback,
cancels the other workers, leaves no thread and no half-applied gradient, and the next step
works, and the error's notes name the failing action and rank; bad arguments raise exactly
ValueError/TypeError whose whole message names the value and the fix. Also proves the ranks
really run concurrently (a rendezvous a serial executor could never pass)."""

from __future__ import annotations

import copy
import re
import threading
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from partitioner.capture import CaptureError
from pipeline import Pipeline
from scheduler import SCHEDULES

ATOL = 1e-10


def _pipeline_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("hybridpipe-")]


class BoomError(RuntimeError):
    pass


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise BoomError("boom in backward")


class Boom(nn.Module):
    """Identity that, once armed, fails in forward or backward on its `at`-th call."""

    def __init__(self) -> None:
        super().__init__()
        self.mode = ""
        self.at = 0
        self.calls = 0

    def arm(self, mode: str, at: int) -> None:
        self.mode, self.at, self.calls = mode, at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.mode and self.calls == self.at:
            if self.mode == "forward":
                raise BoomError("boom in forward")
            return _FailBackward.apply(x)
        return x


def _model(boom: Boom) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), boom, nn.Tanh(), nn.Linear(6, 3)
    ).double()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["forward", "backward"])
@pytest.mark.parametrize(("schedule", "stages"), [("1f1b", 3), ("zb-h1", 2), ("zbv", 2)])
def test_worker_error_reaches_caller_and_pipeline_recovers(
    mode: str, schedule: str, stages: int
) -> None:
    boom = Boom()
    model = _model(boom)
    x = torch.randn(8, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (8,))
    pipe = Pipeline(
        model,
        stages,
        schedule=schedule,
        microbatches=4,
        balance="uniform",
        loss_fn=nn.CrossEntropyLoss(),
        leaf_modules=(Boom,),
        timeout=120.0,
    )
    pipe.step(x, y)  # a clean first step builds the plan, so the armed call count is per step
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)  # grads from an earlier step, to be kept as they are
    boom.arm(mode, at=2)  # Boom sits in stage 1 (on rank 1); its 2nd call is microbatch 1
    with pytest.raises(BoomError) as info:
        pipe.step(x, y)
    assert type(info.value) is BoomError and str(info.value) == f"boom in {mode}"
    # The worker's own frames are in the traceback, and the notes say which action and rank.
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert ("forward" if mode == "forward" else "backward") in frames
    action = "1F1" if mode == "forward" else "1B1"
    assert info.value.__notes__ == [
        f"while running {action} on pipeline rank 1",
        "raised by pipeline rank 1 on cpu",
    ]
    assert _pipeline_threads() == []
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, torch.full_like(p, 7.0)), name
    # The next step works and is exact.
    boom.arm("", 0)
    model.zero_grad(set_to_none=True)
    ref = copy.deepcopy(model)
    expected = nn.CrossEntropyLoss()(ref(x), y)
    expected.backward()
    loss = pipe.step(x, y)
    torch.testing.assert_close(loss, expected.detach(), atol=ATOL, rtol=0)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=0)
    assert _pipeline_threads() == []


@pytest.mark.timeout(60)
def test_loss_fn_error_reaches_caller() -> None:
    calls = []

    def flaky_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            raise BoomError("boom in loss")
        return F.cross_entropy(out, target)

    model = _model(Boom())
    pipe = Pipeline(model, 2, microbatches=4, balance="uniform", loss_fn=flaky_loss)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    with pytest.raises(BoomError) as info:
        pipe.step(x, y)
    assert str(info.value) == "boom in loss"
    # The loss runs inside the last stage's forward: the third call is microbatch 2's.
    loss_note, *notes = info.value.__notes__
    assert loss_note.startswith("loss_fn test_loss_fn_error_reaches_caller.<locals>.flaky_loss "
                                "raised BoomError on microbatch 2: boom in loss.")
    assert notes == [
        "while running 1F2 on pipeline rank 1",
        "raised by pipeline rank 1 on cpu",
    ]
    assert _pipeline_threads() == []
    assert all(p.grad is None for p in model.parameters())
    expected = F.cross_entropy(model(x[:2]), y[:2])
    for k in range(1, 4):
        expected = expected + F.cross_entropy(model(x[2 * k : 2 * k + 2]), y[2 * k : 2 * k + 2])
    torch.testing.assert_close(pipe.step(x, y), expected.detach() / 4, atol=ATOL, rtol=0)


class Rendezvous(nn.Module):
    """Stage 0 blocks on microbatch 1 until stage 1 has started microbatch 0: a serial executor
    would time out here, only concurrent ranks pass."""

    def __init__(self, role: str, met: threading.Event) -> None:
        super().__init__()
        self.role, self.met, self.armed, self.calls = role, met, False, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.calls += 1
            if self.role == "second":
                self.met.set()
            elif self.calls == 2 and not self.met.wait(timeout=20.0):
                raise TimeoutError("stage 1 never started while stage 0 was running")
        return x * 1.0


@pytest.mark.timeout(60)
def test_ranks_run_concurrently() -> None:
    met = threading.Event()
    first, second = Rendezvous("first", met), Rendezvous("second", met)
    model = nn.Sequential(nn.Linear(4, 4), first, second, nn.Linear(4, 2)).double()
    x = torch.randn(4, 4, dtype=torch.float64)
    pipe = Pipeline(
        model,
        2,
        schedule="gpipe",
        microbatches=4,
        balance=[2, 2],
        loss_fn=F.mse_loss,
        leaf_modules=(Rendezvous,),
        example_input=x,
    )
    first.armed = second.armed = True
    pipe.step(x, torch.zeros(4, 2, dtype=torch.float64))
    assert met.is_set()
    assert pipe.trace is not None
    ranks_of_f = {(e.rank, e.microbatch) for e in pipe.trace.events if e.op.value == "F"}
    assert ranks_of_f == {(r, m) for r in range(2) for m in range(4)}


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def test_batch_smaller_than_microbatches() -> None:
    pipe = Pipeline(_mlp(), 2, microbatches=4, loss_fn=F.mse_loss, balance="uniform")
    with pytest.raises(
        ValueError,
        match=exact(
            "inputs batch size 3 is smaller than the microbatch count 4; give a batch of at "
            "least 4 samples or use microbatches <= 3"
        ),
    ):
        pipe.step(torch.randn(3, 4), torch.randn(3, 2))


def exact(message: str) -> str:
    """A `match=` pattern that accepts only this whole message."""
    return "^" + re.escape(message) + "$"


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (
            {"microbatches": 0},
            ValueError,
            exact("microbatches must be >= 1, got 0; split each batch into at least 1"),
        ),
        (
            {"microbatches": 2.5},
            TypeError,
            exact("microbatches must be an int, got 2.5 (float)"),
        ),
        (
            {"stages": 0},
            ValueError,
            exact("stages must be >= 1, got 0; give the number of pipeline ranks"),
        ),
        (
            {"schedule": "pipedream"},
            ValueError,
            exact(
                f"schedule 'pipedream' is neither a known schedule nor a file; choose one of "
                f"{sorted(SCHEDULES)}, pass a scheduler.Schedule, or a schedule text file's path"
            ),
        ),
        (
            {"schedule": "zbv", "virtual_stages": 3, "microbatches": 4},
            ValueError,
            exact(
                "zbv always places 2 chunks per rank; got virtual_stages=3, use virtual_stages=2"
            ),
        ),
        (
            {"schedule": "interleaved-1f1b", "microbatches": 3},
            ValueError,
            exact(
                "interleaved-1f1b needs microbatches a multiple of ranks (got microbatches=3, "
                "ranks=2); use microbatches=2 or 4"
            ),
        ),
        (
            {"devices": ["cpu"]},
            ValueError,
            exact(
                "devices lists 1 device(s) ['cpu'] for stages=2; give one device per stage "
                "(repeating a device is allowed, e.g. ['cpu'] * stages)"
            ),
        ),
        (
            {"devices": ["cpu", "cpu", "cpu"]},
            ValueError,
            exact(
                "devices lists 3 devices ['cpu', 'cpu', 'cpu'] but stages=2; give exactly one "
                "device per stage, or raise stages to 3"
            ),
        ),
        (
            {"devices": ["cpu", "cuda:7"]},
            ValueError,
            exact(
                f"device 'cuda:7' does not exist: this machine has {torch.cuda.device_count()} "
                "CUDA device(s); name one of 'cpu'"
                + "".join(f", 'cuda:{i}'" for i in range(torch.cuda.device_count()))
            ),
        ),
        (
            {"devices": ["cpu", "warp-drive"]},
            ValueError,
            # The middle is torch's own parse error.
            r"^device 'warp-drive' is not a device name \(.*'warp-drive'.*\); use e\.g\. 'cpu' "
            r"or 'cuda:0'$",
        ),
        (
            {"devices": "cpu"},
            TypeError,
            exact("devices must be a list of devices (one per stage), got 'cpu'"),
        ),
        (
            {"data_parallel": 2},
            ValueError,
            exact(
                "data_parallel=2 needs the distributed executor: launch with torchrun "
                "(torch.distributed initialised), or drop data_parallel"
            ),
        ),
        ({"timeout": 0}, ValueError, exact("timeout must be > 0 seconds (and finite), got 0")),
        (
            {"schedule": 3},
            TypeError,
            exact("schedule must be a name, a path or a scheduler.Schedule, got int"),
        ),
    ],
)
def test_bad_constructor_arguments(kwargs: dict[str, Any], error: type, pattern: str) -> None:
    args = {"stages": 2, "loss_fn": F.mse_loss, "balance": "uniform", **kwargs}
    stages = args.pop("stages")
    with pytest.raises(error, match=pattern) as info:
        Pipeline(_mlp(), stages, **args)
    assert type(info.value) is error


def test_model_not_a_module() -> None:
    with pytest.raises(TypeError, match=exact("model must be a torch.nn.Module, got function")):
        Pipeline(lambda x: x, 2)  # type: ignore[arg-type]


def test_step_without_loss_fn() -> None:
    pipe = Pipeline(_mlp(), 2, microbatches=2, balance="uniform")
    with pytest.raises(
        ValueError,
        match=exact(
            "Pipeline.step needs a loss: pass loss_fn=... (e.g. nn.CrossEntropyLoss()) when "
            "building the Pipeline, or call pipe(x) for forward only"
        ),
    ):
        pipe.step(torch.randn(4, 4), torch.randn(4, 2))


def test_optimizer_class_not_an_optimizer_class() -> None:
    pipe = Pipeline(_mlp(), 2, microbatches=2, balance="uniform")
    with pytest.raises(
        TypeError,
        match=exact(
            "optimizer_class must be a torch.optim.Optimizer subclass, got <class 'str'>; pass "
            "the class itself, e.g. pipe.optimizer(torch.optim.AdamW, lr=1e-3)"
        ),
    ):
        pipe.optimizer(str)  # type: ignore[arg-type]
    made = pipe.optimizer(torch.optim.SGD, lr=0.1)
    assert type(made) is torch.optim.SGD
    assert [p for g in made.param_groups for p in g["params"]] == list(pipe.parameters())


def test_targets_batch_size_differs() -> None:
    pipe = Pipeline(_mlp(), 2, microbatches=2, loss_fn=F.mse_loss, balance="uniform")
    with pytest.raises(
        ValueError,
        match=exact(
            "targets have batch size 5 but inputs have 4; give one target per input sample "
            "(dim 0 of both must match)"
        ),
    ):
        pipe.step(torch.randn(4, 4), torch.randn(5, 2))


def test_inputs_of_different_batch_sizes() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x) + z)

    pipe = Pipeline(Two(), 2, microbatches=2, loss_fn=F.mse_loss, balance="uniform")
    with pytest.raises(
        ValueError,
        match=exact(
            "inputs tensors have different batch sizes {'inputs[0]': 4, 'inputs[1]': 6}; give "
            "every tensor the same dim 0"
        ),
    ):
        pipe.step((torch.randn(4, 4), torch.randn(6, 4)), torch.randn(4, 2))
    with pytest.raises(
        ValueError,
        match=exact(
            "input keys ['w'] are not arguments of Two.forward ['x', 'z']; use its argument "
            "names as keys"
        ),
    ):
        pipe.step({"x": torch.randn(4, 4), "w": torch.randn(4, 4)}, torch.randn(4, 2))
    constant = ("; inputs must be a tensor or a tuple/list/dict of tensors (split along dim 0); "
                "pass a constant argument (a flag such as output_hidden_states=True) through the "
                "model instead: set it in its config, or wrap the model in a module whose forward "
                "passes it")
    with pytest.raises(TypeError, match=exact("inputs[1] is a str, not a tensor" + constant)):
        pipe.step((torch.randn(4, 4), "z"), torch.randn(4, 2))
    with pytest.raises(TypeError, match=exact("inputs['z'] is a bool, not a tensor" + constant)):
        pipe.step({"x": torch.randn(4, 4), "z": True}, torch.randn(4, 2))


def test_stage_output_not_tensors() -> None:
    class Labelled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, str]:
            return self.b(self.a(x)), "label"

    pipe = Pipeline(
        Labelled(),
        2,
        microbatches=2,
        balance="uniform",
        loss_fn=lambda out, y: F.mse_loss(out[0], y),
    )
    with pytest.raises(TypeError) as info:
        pipe.step(torch.randn(4, 4), torch.randn(4, 4))
    assert type(info.value) is TypeError
    assert str(info.value) == (
        "stage 1 output[1] is a str, not a tensor; stage 1 is the last stage: make the model "
        "return a tensor or a tuple/dict of tensors (compute other values outside the model)"
    )
    assert info.value.__notes__ == [
        "while running 1F0 on pipeline rank 1",
        "raised by pipeline rank 1 on cpu",
    ]
    assert _pipeline_threads() == []


def test_more_stages_than_model_nodes() -> None:
    pipe = Pipeline(
        nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)),
        3,
        microbatches=3,
        loss_fn=F.mse_loss,
        balance="uniform",
    )
    with pytest.raises(
        ValueError,
        match=exact(
            "cannot split 2 nodes into 3 stages (every stage needs at least one node); pass "
            "stages <= 2, or capture with fewer leaf modules for more nodes"
        ),
    ):
        pipe.step(torch.randn(6, 4), torch.randn(6, 2))


def test_custom_schedule_file_that_deadlocks(tmp_path: Path) -> None:
    path = tmp_path / "bad.txt"
    path.write_text("0F0 0B0\n1B0 1F0\n")
    with pytest.raises(ValueError) as info:
        Pipeline(_mlp(), 2, schedule=path, loss_fn=F.mse_loss, balance="uniform")
    assert str(info.value) == (
        "schedule 'bad' (2 ranks, 2 stages, 1 microbatches) is invalid: deadlock, the ranks' "
        "orders can never all finish:\n"
        "  rank 0 step 1: 0B0 waits for 1B0 from rank 1 step 0, but rank 1 is itself blocked "
        "at step 0\n"
        "  rank 1 step 0: 1B0 needs 1F0, which rank 1 only runs later, at step 1\n"
        "reorder so every action comes after what it needs\n"
        "step     0    1\n"
        "rank 0  0F0 >0B0<\n"
        "rank 1 >1B0< 1F0"
    )


def test_custom_schedule_rank_count_mismatch() -> None:
    from scheduler import build_schedule

    schedule = build_schedule("1f1b", 3, 3)
    with pytest.raises(
        ValueError, match=exact("schedule '1f1b' has 3 ranks but stages=2; make them equal")
    ):
        Pipeline(_mlp(), 2, schedule=schedule, loss_fn=F.mse_loss, balance="uniform")
    with pytest.raises(
        ValueError,
        match=exact(
            "schedule '1f1b' runs 3 microbatches but microbatches=4; drop microbatches or make "
            "them equal"
        ),
    ):
        Pipeline(_mlp(), 3, schedule=schedule, microbatches=4, loss_fn=F.mse_loss)


def test_plan_and_schedule_before_first_batch_explain() -> None:
    pipe = Pipeline(_mlp(), 2, loss_fn=F.mse_loss, balance="uniform")
    with pytest.raises(
        RuntimeError,
        match=exact(
            "the schedule is built from the first batch because microbatches was not given; "
            "pass microbatches=... or example_input=..., or run step/forward first"
        ),
    ):
        _ = pipe.schedule
    with pytest.raises(
        RuntimeError,
        match=exact(
            "the plan is made from the first batch; pass example_input=... or run step/forward "
            "first"
        ),
    ):
        _ = pipe.plan
    for name in ("graph", "stage_modules", "autoplan"):
        with pytest.raises(RuntimeError, match="^the plan is made from the first batch"):
            getattr(pipe, name)


def test_balance_list_not_matching_node_count() -> None:
    with pytest.raises(
        ValueError,
        match=exact("balance [2, 2] sums to 4 but the graph has 5 nodes; the counts must sum to 5"),
    ):
        Pipeline(_mlp(), 2, microbatches=2, balance=[2, 2], example_input=torch.randn(4, 4))


def test_untraceable_model_names_the_way_out() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            if h.sum() > 0:  # data-dependent control flow: neither export nor fx captures it
                h = -h
            return self.b(h)

    with pytest.raises(CaptureError) as info:
        Pipeline(Branchy(), 2, microbatches=2, balance="uniform", example_input=torch.randn(4, 4))
    assert isinstance(info.value, ValueError)  # CaptureError is the ValueError of capture
    # torch.export's error, then torch.fx's own TraceError text.
    assert re.fullmatch(
        r"torch\.export could not capture Branchy: GuardOnDataDependentSymNode: .+; then "
        r"torch\.fx could not trace the model's own forward \(Branchy\): TraceError: .+\. Two "
        r"ways out: move the untraceable code into a submodule and pass its class in "
        r"leaf_modules to capture/Pipeline, or give a sequential model \(an nn\.Sequential, or "
        r"sequential=True when the model's forward applies its top-level children in order\)",
        str(info.value),
    ), str(info.value)


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)) + y)


def test_input_structure_the_model_rejects_is_refused_before_running() -> None:
    """A one-element list where the model takes a tensor: the unsplit model raises, so must
    the pipeline (before anything runs), at the first batch and at a later one."""
    model = _TwoInputs()
    x, t = torch.randn(8, 4), torch.randn(8, 4)
    with pytest.raises(TypeError):
        model(x, [x])
    pipe = Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss())
    with pytest.raises(CaptureError, match=r"positional argument 1 is a list of 1; pass the "
                                           "structure the model's forward takes"):
        pipe.step((x, [x]), t)
    assert all(p.grad is None for p in model.parameters())
    pipe = Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss())
    pipe.step((x, x), t)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=re.escape(
            "inputs are ((T, [T]), {}) but the model was captured with ((T, T), {})")):
        pipe.step((x, [x]), t)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
