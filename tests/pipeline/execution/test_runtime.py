"""The action runtime and the local transport on their own: microbatch split/merge, the
on_stage_done hook, the end-of-step buffers check, timed waits, measured events, profiler
labels, custom schedules, and the CPU no-op stream layer."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pipeline import Pipeline
from pipeline.execution import streams
from pipeline.execution.cancel import PipelineAborted
from pipeline.execution.local import LocalTransport, _Mailbox
from pipeline.execution.runtime import RankRuntime
from pipeline.planning.microbatch import (
    batch_size,
    merge_microbatches,
    microbatch_sizes,
    split_microbatches,
)
from scheduler import Op, Recv, Schedule, Send, build_schedule

ATOL = 1e-10


class Stage(nn.Module):
    """Chain-form stage over a slice of a Sequential (StageModule contract)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.layers(x),)


class NoTransport:
    """For runtimes that hold every stage: any cross-rank traffic is a bug."""

    def send(self, send: Send, tensors: tuple[torch.Tensor, ...]) -> None:
        raise AssertionError(f"unexpected {send}")

    def recv(self, recv: Recv) -> tuple[torch.Tensor, ...]:
        raise AssertionError(f"unexpected {recv}")


def test_split_and_merge_keep_structure_and_sizes() -> None:
    batch: dict[str, Any] = {"a": torch.arange(10), "b": (torch.ones(10, 2), torch.zeros(10))}
    parts = split_microbatches(batch, 4)
    assert [p["a"].shape[0] for p in parts] == microbatch_sizes(10, 4) == [3, 3, 2, 2]
    assert isinstance(parts[0]["b"], tuple) and parts[3]["b"][0].shape == (2, 2)
    merged = merge_microbatches(parts)
    assert torch.equal(merged["a"], batch["a"]) and torch.equal(merged["b"][0], batch["b"][0])
    assert batch_size(batch) == 10


def test_split_errors_name_the_values() -> None:
    with pytest.raises(ValueError, match="batch size 2 is smaller than the microbatch count 3"):
        split_microbatches(torch.zeros(2, 1), 3)
    with pytest.raises(ValueError, match="0-dim"):
        batch_size(torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"inputs\['k'\] is a int"):
        batch_size({"k": 3})
    with pytest.raises(ValueError, match="microbatches must be >= 1"):
        split_microbatches(torch.zeros(2, 1), 0)


def _two_stage_runtime(schedule: Schedule, done: list[int]) -> tuple[RankRuntime, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1)).double()
    stages = {0: Stage(list(model[:2])), 1: Stage(list(model[2:]))}
    runtime = RankRuntime(
        0, schedule, stages, NoTransport(), loss_fn=F.mse_loss, on_stage_done=done.append
    )
    return runtime, model


@pytest.mark.parametrize("name", ["zbv", "interleaved-1f1b"])
def test_single_rank_runtime_and_stage_done_hook(name: str) -> None:
    """One rank holding both stages: handoffs stay local; the hook fires once per stage right
    after that stage's last backward action, and the grads are exact."""
    schedule = build_schedule(name, 1, 3)
    assert schedule.placement == (0, 0) and schedule.splits_backward == (name == "zbv")
    done: list[int] = []
    runtime, model = _two_stage_runtime(schedule, done)
    x = torch.randn(6, 3, dtype=torch.float64)
    y = torch.randn(6, 1, dtype=torch.float64)
    xs = [(t,) for t in split_microbatches(x, 3)]
    result = runtime.run_step(xs, split_microbatches(y, 3), [1 / 3] * 3)
    last_op = Op.W if schedule.splits_backward else Op.B
    finals = [a.stage for a in schedule.actions[0] if a.op is last_op and a.microbatch == 2]
    assert sorted(done) == [0, 1] and done == finals
    assert [(e.stage, e.op, e.microbatch) for e in result.events] == [
        (a.stage, a.op, a.microbatch) for a in schedule.actions[0]
    ]
    assert all(e.end >= e.start for e in result.events)
    ref = copy.deepcopy(model)
    F.mse_loss(ref(x), y).backward()
    torch.testing.assert_close(
        sum(result.losses.values()), F.mse_loss(ref(x), y).detach(), atol=ATOL, rtol=0
    )
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=0)


def test_buffers_check_catches_leftovers() -> None:
    schedule = Schedule.from_text("0F0 1F0 1B0")  # stage 0 never runs its backward
    runtime, _ = _two_stage_runtime(schedule, [])
    x, y = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 1, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"leftovers .*stashed activations.*\(0, 0\)"):
        runtime.run_step([(x,)], [y], [1.0])
    # A failed step leaves nothing behind for the next one.
    assert not runtime._stash and not runtime._mail and not runtime._pending_w


def test_runtime_rejects_wrong_stage_set() -> None:
    schedule = build_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match=r"rank 0 runs stages \[0\].*got modules for stages"):
        RankRuntime(0, schedule, {1: Stage([nn.Linear(1, 1)])}, NoTransport())


def test_transport_wait_times_out_with_a_clear_message() -> None:
    transport = LocalTransport(
        1,
        [torch.device("cpu")] * 2,
        [_Mailbox(), _Mailbox()],
        [streams.CPU_STREAM] * 2,
        threading.Event(),
        timeout=0.05,
    )
    with pytest.raises(
        TimeoutError,
        match=r"pipeline rank 1 waited [0-9.]+ s for activations of stage 0 microbatch 0 \(0F0\) "
        r"from pipeline rank 0.*Pipeline\(timeout=\.\.\.\)",
    ):
        transport.recv(Recv(Op.F, 0, 0, peer=0))


def test_transport_wait_stops_on_abort() -> None:
    abort = threading.Event()
    abort.set()
    transport = LocalTransport(
        1,
        [torch.device("cpu")] * 2,
        [_Mailbox(), _Mailbox()],
        [streams.CPU_STREAM] * 2,
        abort,
        timeout=60.0,
    )
    with pytest.raises(PipelineAborted, match="another rank failed"):
        transport.recv(Recv(Op.B, 1, 1, peer=0))


def test_transport_delivers_by_key_in_any_order() -> None:
    boxes = [_Mailbox(), _Mailbox()]
    cpu = [torch.device("cpu")] * 2
    t0 = LocalTransport(0, cpu, boxes, [streams.CPU_STREAM] * 2, threading.Event(), 1.0)
    t1 = LocalTransport(1, cpu, boxes, [streams.CPU_STREAM] * 2, threading.Event(), 1.0)
    a, b = torch.ones(1), torch.zeros(1)
    t0.send(Send(Op.F, 0, 0, peer=1), (a,))
    t0.send(Send(Op.F, 0, 1, peer=1), (b,))
    assert t1.recv(Recv(Op.F, 0, 1, peer=0))[0] is b and t1.recv(Recv(Op.F, 0, 0, peer=0))[0] is a
    t1.send(Send(Op.B, 1, 0, peer=0), (a,))
    assert t0.recv(Recv(Op.B, 1, 0, peer=1))[0] is a
    assert not boxes[0].items and not boxes[1].items


def test_trace_events_and_profiler_labels() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2))
    pipe = Pipeline(
        model, 2, schedule="zb-h1", microbatches=3, loss_fn=F.mse_loss, balance="uniform"
    )
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    assert pipe.trace is None
    # Worker threads are only seen by a profiler that records every thread.
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=config
    ) as prof:
        pipe.step(x, y)
    trace = pipe.trace
    assert trace is not None and trace.num_ranks == 2 and trace.splits_backward
    expected = {(a.stage, a.op, a.microbatch) for rank in pipe.schedule.actions for a in rank}
    assert {(e.stage, e.op, e.microbatch) for e in trace.events} == expected
    for rank in range(2):
        mine = trace.for_rank(rank)
        assert [(e.stage, e.op, e.microbatch) for e in mine] == [
            (a.stage, a.op, a.microbatch) for a in pipe.schedule.actions[rank]
        ]
        assert all(a.end <= b.start for a, b in zip(mine, mine[1:], strict=False))
    labels = {evt.key for evt in prof.key_averages()}
    assert {"hybridpipe 0F0", "hybridpipe 1B2", "hybridpipe 0W1"} <= labels


def test_custom_schedule_object_and_text_file(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    ref = copy.deepcopy(model)
    expected = F.mse_loss(ref(x), y)
    expected.backward()
    text = "0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1\n"
    path = tmp_path / "mine.txt"
    path.write_text(text)
    for spec in (Schedule.from_text(text, name="mine"), path):
        model.zero_grad(set_to_none=True)
        pipe = Pipeline(model, 2, schedule=spec, loss_fn=F.mse_loss, balance="uniform")
        assert pipe.microbatches == 2 and pipe.schedule.name == "mine"
        torch.testing.assert_close(pipe.step(x, y), expected.detach(), atol=ATOL, rtol=0)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=0)


def test_simulate_predicts_every_action() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2))
    pipe = Pipeline(
        model,
        2,
        schedule="zb-h2",
        microbatches=4,
        loss_fn=F.mse_loss,
        balance="parameters",
        example_input=torch.randn(8, 8),
    )
    predicted = pipe.simulate()
    assert len(predicted.events) == sum(len(r) for r in pipe.schedule.actions)
    assert predicted.step_time > 0 and 0 <= predicted.bubble_fraction < 1
    costs = pipe.profiled_costs()  # balance="parameters": profiled on demand
    assert len(costs.forward) == len(costs.backward) == pipe.schedule.num_stages
    assert all(f > 0 for f in costs.forward) and all(b > 0 for b in costs.backward)
    assert set(pipe.captured.order) == {v for stage in pipe.plan.stages for v in stage}
    # Stage 0's split backward is all W (its inputs need no gradient).
    stage0 = [e for e in predicted.events if e.stage == 0]
    assert all(e.duration == 0 for e in stage0 if e.op is Op.B)
    assert all(e.duration > 0 for e in stage0 if e.op is Op.W)


def test_cpu_streams_are_no_ops() -> None:
    cpu = torch.device("cpu")
    stream = streams.new_stream(cpu)
    assert stream is streams.CPU_STREAM is streams.current_stream(cpu)
    assert streams.record_event(stream) is None
    t = torch.ones(2)
    with streams.use_device(cpu), streams.use_stream(stream):
        streams.wait_stream(stream, stream)
        streams.wait_event(stream, None)
        streams.record_stream(t, stream)
    assert torch.equal(t, torch.ones(2))


class _CountBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, calls: list[int]) -> torch.Tensor:
        ctx.calls = calls
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.calls.append(1)
        return grad, None


class CountBackward(nn.Module):
    """Identity on the activation path that counts how often its backward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _CountBackward.apply(x, self.calls)


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2", "zbv"])
def test_split_backward_does_not_rewalk_the_input_grad_path(schedule: str) -> None:
    """B walks the activation-grad path once; W starts from the saved gradients where each
    weight's path leaves it, so an op between two weights runs its backward once per
    microbatch, not twice, and the grads are still exact."""
    torch.manual_seed(0)
    counters = [CountBackward() for _ in range(4)]
    layers: list[nn.Module] = []
    for counter in counters:
        layers += [nn.Linear(4, 4), nn.Tanh(), counter]
    model = nn.Sequential(*layers, nn.Linear(4, 2)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    ref = copy.deepcopy(model)
    expected = F.mse_loss(ref(x), y)
    expected.backward()
    pipe = Pipeline(
        model,
        2,
        schedule=schedule,
        microbatches=3,
        loss_fn=F.mse_loss,
        balance="uniform",
        leaf_modules=(CountBackward,),
        example_input=x,
    )
    for counter in counters:
        counter.calls.clear()
    torch.testing.assert_close(pipe.step(x, y), expected.detach(), atol=ATOL, rtol=0)
    assert [len(c.calls) for c in counters] == [3, 3, 3, 3]
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=0)


def _reference(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, nn.Module, torch.Tensor]:
    """A batch for a 4-in 2-out model, and an unsplit copy that ran it (loss, grads)."""
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    ref = copy.deepcopy(model)
    expected = F.mse_loss(ref(x), y)
    expected.backward()
    return x, y, ref, expected


class Tied(nn.Module):
    """One Linear applied three times (a weight reached through several input-path nodes) and
    a parameter that reaches the output without touching the stage input."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.shared = nn.Linear(4, 4)
        self.offset = nn.Parameter(torch.randn(4))
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h) * self.offset.exp())
        return self.out(self.shared(h))


@pytest.mark.parametrize(("schedule", "stages"), [("zb-h1", 2), ("zb-h2", 3), ("zbv", 2)])
def test_split_backward_with_shared_weights(schedule: str, stages: int) -> None:
    torch.manual_seed(0)
    model = Tied().double()
    x, y, ref, expected = _reference(model)
    for balance in ("uniform", "parameters"):
        model.zero_grad(set_to_none=True)
        pipe = Pipeline(
            model, stages, schedule=schedule, microbatches=3, loss_fn=F.mse_loss, balance=balance
        )
        torch.testing.assert_close(pipe.step(x, y), expected.detach(), atol=ATOL, rtol=0)
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=0, msg=name)


class PositionBias(nn.Module):
    """A bias made from a parameter alone, added in every later block (T5's relative position
    bias), after two plain blocks, so a stage past the first (whose input needs no gradient)
    makes it, uses it and sends it on: its W reaches the weight both through the input-grad
    path and from an output that does not depend on the stage input."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.table = nn.Parameter(torch.randn(4))
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.pre:
            x = torch.tanh(block(x))
        bias = torch.tanh(self.table)
        for block in self.blocks:
            x = torch.tanh(block(x) + bias)
        return self.out(x)


@pytest.mark.parametrize(("schedule", "stages", "balance"), [
    ("zb-h1", 3, [4, 7, 7]), ("zb-h2", 3, [4, 7, 7]), ("zbv", 2, [4, 5, 5, 4]),
])
def test_split_backward_weight_reached_two_ways(
    schedule: str, stages: int, balance: list[int]
) -> None:
    torch.manual_seed(0)
    model = PositionBias().double()
    x, y, ref, expected = _reference(model)
    pipe = Pipeline(model, stages, schedule=schedule, microbatches=3, loss_fn=F.mse_loss,
                    balance=balance, example_input=x)  # 4 units: the pre blocks, stage 0
    holder = [i for i, m in enumerate(pipe.stage_modules)
              if any(n == "table" for n, _ in m.named_parameters())]
    assert holder and holder[0] not in (0, len(pipe.stage_modules) - 1), holder
    torch.testing.assert_close(pipe.step(x, y), expected.detach(), atol=ATOL, rtol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=0, msg=name)


def test_accumulate_grads_sums_a_parameter_listed_twice() -> None:
    from pipeline.execution.grads import accumulate_grads

    p = torch.zeros(3)
    accumulate_grads([p, p], [torch.ones(3), 2 * torch.ones(3)])
    assert p.grad is not None and p.grad.tolist() == [3.0, 3.0, 3.0]
    accumulate_grads([p, p, p], [torch.ones(3), None, torch.ones(3)])
    assert p.grad.tolist() == [5.0, 5.0, 5.0]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_frozen_parameters_after_construction(schedule: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2)).double()
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    pipe = Pipeline(
        model,
        2,
        schedule=schedule,
        microbatches=2,
        loss_fn=F.mse_loss,
        balance="uniform",
        example_input=x,
    )
    pipe.step(x, y)
    model.zero_grad(set_to_none=True)
    for p in (*model[0].parameters(), *model[3].parameters()):
        p.requires_grad_(False)
    ref = copy.deepcopy(model)
    F.mse_loss(ref(x), y).backward()
    pipe.step(x, y)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None) == (not p.requires_grad)
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=0)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_over_the_whole_model(norm_type: float) -> None:
    torch.manual_seed(0)
    model = Tied().double()
    x, y, ref, _ = _reference(model)
    pipe = Pipeline(model, 2, schedule="1f1b", microbatches=3, loss_fn=F.mse_loss,
                    balance="uniform")
    pipe.step(x, y)
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01, norm_type)
    assert float(expected) > 0.01  # the clip scales
    torch.testing.assert_close(pipe.clip_grad_norm_(0.01, norm_type), expected, atol=ATOL, rtol=0)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=0)


def _omp_max_threads() -> int:
    """This thread's OpenMP thread count (torch's build uses GNU OpenMP), read without
    torch's own getter, which would first set it from torch's setting."""
    import ctypes

    return int(ctypes.CDLL("libgomp.so.1").omp_get_max_threads())


def test_rank_threads_take_the_callers_intra_op_threads() -> None:
    # A new thread's OpenMP and MKL thread counts start at every core, not at the caller's
    # torch.set_num_threads: a matrix product there starts an OpenMP team whose spinning
    # workers compete with the other ranks' threads. The workers take the caller's count.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    pipe = Pipeline(model, stages=2, microbatches=2, loss_fn=lambda out, y: out.sum())
    seen: list[int] = []
    x = torch.randn(4, 4)
    pipe.step(x, torch.zeros(4))
    for stage in pipe.stage_modules:
        stage.register_forward_pre_hook(lambda *_: seen.append(_omp_max_threads()))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipe.step(x, torch.zeros(4))
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}, seen


class _Scaled(nn.Module):
    """Two linear layers, each output scaled by a table made from a buffer and the positions
    (as Llama's rotary cos and sin): cut between them, the table crosses with no gradient
    path to it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("freq", torch.linspace(0.1, 1.0, 8, dtype=torch.float64))
        self.a = nn.Linear(8, 8, dtype=torch.float64)
        self.b = nn.Linear(8, 8, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = torch.cos(torch.arange(x.shape[1], dtype=torch.float64)[:, None] * self.freq)
        return self.b(self.a(x) * table) * table


def test_a_table_no_gradient_reaches_crosses_without_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The plan marks the table no gradient reaches (made from a buffer and the positions)
    and the hidden value one does; stage 1 takes the table without grad, its B sends back one
    gradient (the hidden value's), and the step equals the unsplit model's in float64."""
    torch.manual_seed(0)
    model = _Scaled()
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 8, dtype=torch.float64), torch.randn(4, 3, 8, dtype=torch.float64)
    pipe = Pipeline(model, 2, microbatches=2, loss_fn=F.mse_loss, balance="parameters",
                    example_input=x)
    stage = pipe.stage_modules[1]
    assert sorted(stage.input_needs_grad) == [False, True], stage.input_names
    assert stage.input_needs_grad == pipe.stage_modules[0].output_needs_grad
    seen: list[list[bool]] = []
    stage.register_forward_pre_hook(lambda _, args: seen.append([a.requires_grad for a in args]))
    sent = _counting_grad_messages(monkeypatch)
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    F.mse_loss(ref(x), y).backward()
    pipe.step(x, y)
    assert seen == [list(stage.input_needs_grad)] * 2
    assert sent == [1, 1]  # the hidden value's gradient, once per microbatch
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-12, rtol=0, msg=name)


def _counting_grad_messages(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of tensors in each gradient message the local transport sends, from now."""
    sent: list[int] = []
    send = LocalTransport.send

    def counting(self: LocalTransport, ins: Send, tensors: tuple[torch.Tensor, ...]) -> None:
        if ins.key[0] is Op.B:
            sent.append(len(tensors))
        send(self, ins, tensors)

    monkeypatch.setattr(LocalTransport, "send", counting)
    return sent


@pytest.mark.slow
def test_values_no_gradient_reaches_cross_without_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama's rotary cos and sin, made in stage 0 from a buffer and the positions, cross to
    stage 1 as values no gradient reaches (the plan marks them): stage 1 takes them without
    grad, its B computes and sends back a gradient for the hidden state alone, and the step
    equals the unsplit model's in float64."""
    from tests.support.real_models import SPECS, build, check_step

    spec = SPECS["llama"]
    model = build("llama")
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    x, y = spec.batch(4, 8)
    pipe = Pipeline(model, 2, microbatches=2, loss_fn=spec.loss_fn, balance="parameters",
                    example_input=x)
    stage = pipe.stage_modules[1]
    assert stage.input_needs_grad == pipe.stage_modules[0].output_needs_grad
    floats = [i for i, n in enumerate(stage.input_names)
              if pipe.captured.values[n].dtype.startswith("torch.float")]
    crossing = [i for i in floats if stage.input_needs_grad[i]]
    assert len(crossing) == 1 and len(floats) >= 3, (floats, stage.input_needs_grad)
    seen: list[list[bool]] = []
    stage.register_forward_pre_hook(
        lambda _, args: seen.append([args[i].requires_grad for i in floats]))
    sent = _counting_grad_messages(monkeypatch)
    check_step(pipe, model, ref, x, y, atol=1e-12)
    assert seen == [[i in crossing for i in floats]] * 2  # one forward per microbatch
    assert sent == [1, 1]  # the hidden state's gradient, once per microbatch
