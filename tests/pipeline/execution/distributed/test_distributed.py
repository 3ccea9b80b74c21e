"""The distributed executor over torch.distributed: CPU processes (gloo, 1 thread each) launched
the way torchrun launches them (a store hosted by the launcher, RANK/WORLD_SIZE/MASTER_* in the
environment), checked against the single-process run in float64 (atol 1e-10): loss and every
gathered gradient, 10-step loss curves, a batch-shape change, forward, the gathered trace,
checkpoint resharding (pp=2 dp=2 -> pp=4 dp=1 -> one process), and failures (a rank that
raises, a rank killed with SIGKILL) ending every process with a message naming the failed rank.

Each launch runs many checks, because starting a process with torch costs seconds here, and
captures with torch.fx (0.1 s; torch.export takes seconds a process, and is what
test_distributed_real.py runs), except the model built on the meta device. This file is also
the worker: ``python <this file> WORKER OUT_DIR`` (run by `launch`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.support.distributed import (
    ATOL,
    BATCH,
    Checker,
    all_ok,
    dump,
    init_worker,
    launch,
)
from tests.support.models import global_batch, lm_loss, make_model

# ---------------------------------------------------------------------------------------------
# Workers (run in the launched processes)
# ---------------------------------------------------------------------------------------------


def _bn_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8),
                         nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).double()


def _check_batchnorm_replicas() -> None:
    """pp=2 dp=2, BatchNorm, each replica on its own data: the loss and gradients equal the
    unsplit model run microbatch by microbatch over the global batch; after the step, and
    after a forward in train mode, every replica holds replica 0's running statistics (as
    DDP's broadcast_buffers), which equal the unsplit model run on replica 0's data."""
    import torch.distributed as dist

    from pipeline import Pipeline
    from pipeline.checkpoint import gather_named

    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g,
                                                                          dtype=torch.float64)
    pipe = Pipeline(_bn_model(), stages=2, microbatches=2, loss_fn=F.mse_loss,
                    balance="parameters", capture_method="fx")
    ctx = pipe.distributed
    assert ctx is not None and ctx.layout.data_parallel == 2
    d = ctx.layout.dp_rank
    loss = pipe.step(x[4 * d : 4 * d + 4], y[4 * d : 4 * d + 4])
    ref = _bn_model()
    expected = sum(F.mse_loss(ref(xm), ym) * 2 / 8
                   for xm, ym in zip(x.split(2), y.split(2), strict=True))
    assert isinstance(expected, torch.Tensor)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), atol=ATOL, rtol=0)
    grads = gather_named({k: p.grad for k, p in pipe.named_parameters()}, ctx)
    if grads is not None:
        for k, p in ref.named_parameters():
            torch.testing.assert_close(grads[k], p.grad, atol=ATOL, rtol=0, msg=k)
    replica0 = _bn_model()  # replica 0's microbatches: the step's, then the forward's below
    for xm in (*x[:4].split(2), *x[:4].split(2)):
        replica0(xm)
    with torch.no_grad():
        pipe(x[4 * d : 4 * d + 4])  # train mode: BatchNorm updates its running statistics
    mine = torch.cat([b.double().reshape(-1) for s in pipe.stage_modules for b in s.buffers()])
    seen = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(seen, mine, group=ctx.dp_group)
    assert torch.equal(seen[0], seen[1]), "replicas hold different BatchNorm statistics"
    state = pipe.state_dict()
    if state is not None:
        for k, v in replica0.state_dict().items():
            torch.testing.assert_close(state[k].double(), v.double(), atol=ATOL, rtol=0, msg=k)


def worker_matrix(out: Path) -> None:
    """world 4: pp=2 dp=2, pp=4 dp=1, pp=1 dp=4 x gpipe, 1f1b, zb-h1; a world size that does not
    divide; BatchNorm's running statistics across replicas; checkpoint resharding pp=2 dp=2 ->
    pp=4 dp=1 (-> one process, in the test)."""
    import torch.distributed as dist

    from pipeline import Pipeline

    init_worker()
    for pp in (2, 4, 1):
        for schedule in ("gpipe", "1f1b", "zb-h1"):
            Checker(pp, schedule).train(10)
    try:
        Pipeline(make_model(), stages=3, loss_fn=lm_loss)
    except ValueError as err:
        assert "world size 4" in str(err) and "stages=3" in str(err), err
    else:
        raise AssertionError("stages=3 in a world of 4 was accepted")
    # Replicas start from replica 0's weights even when the processes seeded differently.
    odd = Pipeline(make_model(seed=100 + dist.get_rank()), stages=2, schedule="1f1b",
                   microbatches=4, loss_fn=lm_loss, balance="parameters",
                   capture_method="fx", example_input=global_batch(0, BATCH)[0])
    assert odd.distributed is not None
    flat = torch.cat([p.detach().reshape(-1) for p in odd.parameters()])
    seen = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(seen, flat, group=odd.distributed.dp_group)
    assert torch.equal(seen[0], seen[1]), "data-parallel replicas start from different weights"
    _check_batchnorm_replicas()
    # simulate() works on every rank: the costs rank 0 profiled travel with the plan.
    profiled = Pipeline(make_model(), stages=2, schedule="1f1b", microbatches=4,
                        loss_fn=lm_loss, balance="profile", capture_method="fx",
                        example_input=global_batch(0, BATCH)[0])
    predicted = [0.0] * dist.get_world_size()
    dist.all_gather_object(predicted, profiled.simulate().step_time)
    assert len(set(predicted)) == 1 and predicted[0] > 0, predicted
    # Resharding: train at pp=2 dp=2 for 9 steps, checkpoint after step 3; resume at pp=4 dp=1.
    losses: dict[str, list[float]] = {"a": [], "b": []}
    a = Checker(2, "1f1b")
    opt = torch.optim.SGD(a.pipe.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(a.ref.parameters(), lr=0.5, momentum=0.9)
    for step in range(9):
        if step == 3:
            a.pipe.save_checkpoint(out / "a3.pt", optimizer=opt, extra={"step": 3})
        if step == 6:
            sd = a.pipe.state_dict()
            if dist.get_rank() == 0:
                torch.save(sd, out / "a6-state.pt")
        losses["a"].append(a.step_and_compare(step))
        opt.step()
        ref_opt.step()
    b = Pipeline(make_model(seed=7), stages=4, schedule="1f1b", microbatches=4,
                 loss_fn=lm_loss, balance="parameters", capture_method="fx")
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)  # hyper-parameters come from the checkpoint
    extra = b.load_checkpoint(out / "a3.pt", optimizer=opt_b)
    assert extra == {"step": 3}, extra
    assert opt_b.param_groups[0]["momentum"] == 0.9
    for step in range(3, 6):
        x, y = global_batch(step, BATCH * 2)
        b.zero_grad()
        losses["b"].append(float(b.step(x, y)))
        opt_b.step()
    b.save_checkpoint(out / "b6.pt", optimizer=opt_b, extra={"step": 6})
    if dist.get_rank() == 0:
        (out / "losses.json").write_text(json.dumps(losses))
    dist.destroy_process_group()
    print("worker matrix: every check ran")


def worker_schedules(out: Path) -> None:
    """world 2: pp=2 with every schedule, and pp=1 dp=2 (small gradient buckets); a batch
    whose shape changes between steps; forward; the trace gathered on rank 0."""
    import torch.distributed as dist

    from pipeline import Pipeline
    from scheduler import SCHEDULES

    init_worker()
    for schedule in sorted(SCHEDULES):
        Checker(2, schedule).train(10)
    # Activation policies: recomputed and selective stages under a split backward, and the
    # planner's per-stage choice agreed by every process.
    Checker(2, "zb-h1", checkpoint_activations=["selective", "full"]).train(3)
    auto = Checker(2, "1f1b", checkpoint_activations="auto", memory_limit=1e12)
    auto.train(3)
    assert auto.pipe.plan.activations == ["none", "none"]
    import pipeline.execution.distributed.gradsync

    # several gradient buckets per stage
    pipeline.execution.distributed.gradsync.BUCKET_BYTES = 4096
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        Checker(1, schedule).train(10)
    c = Checker(2, "1f1b")
    for step, (rows, seq) in enumerate([(8, 6), (6, 6), (8, 5), (8, 6)]):
        c.step_and_compare(step, rows, seq)
    # A model built on the meta device gets this process's weights from a state dict.
    with torch.device("meta"):
        meta_model = make_model()
    meta = Pipeline(meta_model, stages=2, schedule="1f1b", microbatches=4, loss_fn=lm_loss,
                    balance="parameters", example_input=global_batch(0, BATCH)[0].to("meta"))
    meta.load_state_dict(c.ref.state_dict())
    assert all(not p.is_meta and p.numel() > 0 for _, p in meta.named_parameters())
    x, y = global_batch(9, BATCH)
    torch.testing.assert_close(meta.step(x, y).double(), lm_loss(c.ref(x), y).detach(),
                               atol=ATOL, rtol=0)
    # Its optimizer state round-trips through a sharded checkpoint (the loaded tensors took the
    # meta ones' place in the model too, so the optimizer's parameters have the model's names).
    meta_opt = torch.optim.SGD(meta.parameters(), lr=0.0, momentum=0.9)
    meta_opt.step()  # lr 0: momentum buffers, weights (shared with c.ref's, by assign) kept
    meta.save_checkpoint(out / "meta-ckpt", optimizer=meta_opt)
    again = torch.optim.SGD(meta.parameters(), lr=0.5)
    meta.load_checkpoint(out / "meta-ckpt", optimizer=again)
    for p in meta.parameters():
        assert torch.equal(again.state[p]["momentum_buffer"], meta_opt.state[p]["momentum_buffer"])
    own = dict(c.pipe.named_parameters())
    assert own and len(own) < len(dict(c.pipe.module.named_parameters()))
    for k, p in c.pipe.module.named_parameters():  # other stages' parameters are freed
        assert (p.numel() > 0) == (k in own), k
    trace = c.pipe.trace
    assert trace is not None
    if dist.get_rank() == 0:
        assert {e.rank for e in trace.events} == {0, 1}, trace.events
        assert len(trace.events) == sum(len(a) for a in c.pipe.schedule.actions)
    x, _ = global_batch(0, 6)
    with torch.no_grad():
        out_pipe = c.pipe(x)
        expected = c.ref(x)
    if c.pipe.holds_last_stage:
        torch.testing.assert_close(out_pipe, expected, atol=ATOL, rtol=0)
    else:
        assert out_pipe is None
    dist.destroy_process_group()
    print("worker schedules: every check ran")


def _fail_on_step(pipe: object, step: int, action: Callable[[], None]) -> None:
    """Run `action` inside this process's first stage forward of the given step (mid-step)."""
    calls = [0]
    per_step = pipe.schedule.num_microbatches  # type: ignore[attr-defined]

    def hook(module: nn.Module, inputs: object, output: object) -> None:
        calls[0] += 1
        if calls[0] == step * per_step + 2:
            action()

    pipe.stage_modules[0].register_forward_hook(hook)  # type: ignore[attr-defined]


def _failing_run(victim: int, action: Callable[[], None], stages: int) -> None:
    import torch.distributed as dist

    from pipeline import Pipeline

    init_worker()
    x, y = global_batch(0, BATCH)
    pipe = Pipeline(make_model(), stages=stages, schedule="1f1b", microbatches=4,
                    loss_fn=lm_loss, balance="parameters", capture_method="fx", example_input=x)
    if dist.get_rank() == victim:
        _fail_on_step(pipe, 2, action)
    for _ in range(5):
        pipe.step(x, y)
    raise AssertionError("the steps finished although a rank failed")


def worker_raise(out: Path) -> None:
    """world 3, pp=3: rank 1 raises in the middle of step 2."""

    def boom() -> None:
        raise ValueError("injected failure")

    _failing_run(1, boom, stages=3)


def worker_kill(out: Path) -> None:
    """world 4, pp=2 dp=2: rank 1 is killed (SIGKILL) in the middle of step 2."""
    _failing_run(1, lambda: os.kill(os.getpid(), signal.SIGKILL), stages=2)


def worker_hang(out: Path) -> None:
    """world 2, pp=2: rank 1 stops answering (blocks forever) in the middle of step 2."""
    import threading

    _failing_run(1, threading.Event().wait, stages=2)


WORKERS: dict[str, Callable[[Path], None]] = {
    "matrix": worker_matrix,
    "schedules": worker_schedules,
    "raise": worker_raise,
    "kill": worker_kill,
    "hang": worker_hang,
}


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_transparency_layouts_and_resharding(tmp_path: Path) -> None:
    """pp=2 dp=2, pp=4 dp=1, pp=1 dp=4 x gpipe/1f1b/zb-h1 equal the single process; a run saved
    at pp=2 dp=2 resumes at pp=4 dp=1 and then in one process with the same losses."""
    from pipeline import Pipeline

    all_ok(launch("matrix", 4, tmp_path, script=__file__), "matrix")
    losses = json.loads((tmp_path / "losses.json").read_text())
    torch.testing.assert_close(torch.tensor(losses["b"], dtype=torch.float64),
                               torch.tensor(losses["a"][3:6], dtype=torch.float64),
                               atol=ATOL, rtol=0)
    # One process (local executor) from the pp=4 checkpoint: same parameters as the pp=2 dp=2
    # run had after step 6, and the same next losses.
    pipe = Pipeline(make_model(seed=9), stages=2, schedule="1f1b", microbatches=4,
                    loss_fn=lm_loss, balance="parameters", capture_method="fx")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    assert pipe.load_checkpoint(tmp_path / "b6.pt", optimizer=opt) == {"step": 6}
    expected = torch.load(tmp_path / "a6-state.pt")
    got = pipe.state_dict()
    assert got is not None and list(got) == list(expected)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], atol=ATOL, rtol=0, msg=k)
    tail = []
    for step in range(6, 9):
        x, y = global_batch(step, BATCH * 2)
        pipe.zero_grad()
        tail.append(float(pipe.step(x, y)))
        opt.step()
    torch.testing.assert_close(torch.tensor(tail, dtype=torch.float64),
                               torch.tensor(losses["a"][6:9], dtype=torch.float64),
                               atol=ATOL, rtol=0)


@pytest.mark.slow
def test_transparency_all_schedules_two_ranks(tmp_path: Path) -> None:
    """pp=2 with every schedule (interleaved and zbv included), pp=1 dp=2, a changing batch
    shape, forward, and rank 0's gathered trace."""
    all_ok(launch("schedules", 2, tmp_path, script=__file__), "schedules")


@pytest.mark.slow
def test_raising_rank_stops_every_rank(tmp_path: Path) -> None:
    ended = launch("raise", 3, tmp_path, script=__file__, timeout=5.0, deadline=60.0)
    assert all(e.returncode != 0 for e in ended), dump(ended)
    assert "injected failure" in ended[1].output, dump(ended)
    for e in (ended[0], ended[2]):
        assert "RankFailure" in e.output and "rank 1 (pipeline rank 1" in e.output, dump(ended)
        assert "injected failure" in e.output, dump(ended)


@pytest.mark.slow
def test_killed_rank_stops_every_rank(tmp_path: Path) -> None:
    ended = launch("kill", 4, tmp_path, script=__file__, timeout=5.0, deadline=60.0)
    assert ended[1].returncode == -signal.SIGKILL, dump(ended)
    for e in ended:
        if e.rank != 1:
            assert e.returncode != 0, dump(ended)
            assert "RankFailure" in e.output, dump(ended)
            assert "because rank 1 (pipeline rank 1 of replica 0)" in e.output, dump(ended)


@pytest.mark.slow
def test_hung_rank_is_named_after_the_timeout(tmp_path: Path) -> None:
    ended = launch("hang", 2, tmp_path, script=__file__, timeout=3.0, deadline=60.0, hangs=1)
    assert ended[1].returncode == -signal.SIGKILL, dump(ended)  # killed by us, still hung
    assert ended[0].returncode != 0, dump(ended)
    assert "because rank 1 (pipeline rank 1 of replica 0) stopped responding" in ended[0].output
    assert "timeout 3 s" in ended[0].output, dump(ended)


def test_layout_and_divisibility() -> None:
    from pipeline.execution.distributed import make_layout

    layout = make_layout(4, world_size=8, rank=5)
    assert (layout.data_parallel, layout.pp_rank, layout.dp_rank) == (2, 1, 1)
    assert layout.pipeline_ranks() == [4, 5, 6, 7]
    assert layout.replica_ranks() == [1, 5]
    assert layout.global_rank(3, 0) == 3 and layout.coordinate(6) == (1, 2)
    assert layout.describe(6) == "rank 6 (pipeline rank 2 of replica 1)"
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by stages=4"):
        make_layout(4, world_size=6, rank=0)
    with pytest.raises(ValueError, match=r"stages=2 x data_parallel=3 = 6 processes"):
        make_layout(2, 3, world_size=4, rank=0)


def test_layout_with_tensor_parallel() -> None:
    """(dp, pp, tp) with tp innermost: a tp group is consecutive ranks; pipeline peers and
    gradient groups sit at the process's own tp coordinate."""
    from pipeline.execution.distributed import make_layout

    layout = make_layout(2, world_size=8, rank=5, tensor_parallel=2)  # dp=2 x pp=2 x tp=2
    assert (layout.data_parallel, layout.dp_rank, layout.pp_rank, layout.tp_rank) == \
        (2, 1, 0, 1)
    assert layout.tp_ranks() == [4, 5]
    assert layout.pipeline_ranks() == [5, 7]
    assert layout.replica_ranks() == [1, 5]
    assert layout.global_rank(1) == 7 and layout.world_size == 8
    assert layout.describe(6) == "rank 6 (pipeline rank 1, tp rank 0 of replica 1)"
    with pytest.raises(ValueError, match=r"not divisible by stages=2 x tensor_parallel=2"):
        make_layout(2, world_size=6, rank=0, tensor_parallel=2)
    with pytest.raises(ValueError, match=r"tensor_parallel must be an int >= 1"):
        make_layout(2, world_size=4, rank=0, tensor_parallel=0)


def test_a_tp_group_spanning_nodes_is_warned(monkeypatch: pytest.MonkeyPatch) -> None:
    """tp=4 on nodes of 6 processes puts ranks 4-7 on two nodes: correct, but every tp
    collective crosses the network, so it is a warning naming the fix; tp=2 fits."""
    import warnings

    from pipeline.execution.distributed import make_layout

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "6")
    with pytest.warns(UserWarning, match=r"tensor_parallel=4 does not divide the 6 processes "
                      r"per node.*tensor_parallel in \[1, 2, 3, 6\]"):
        make_layout(3, world_size=12, rank=0, tensor_parallel=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_layout(2, world_size=12, rank=0, tensor_parallel=2)


def test_tensor_parallel_needs_torchrun() -> None:
    from pipeline import Pipeline

    with pytest.raises(ValueError, match=r"tensor_parallel=2 .* launch with torchrun"):
        Pipeline(torch.nn.Linear(2, 2), stages=1, tensor_parallel=2)


def test_message_packing_and_metadata_round_trip() -> None:
    from pipeline.execution.distributed.p2p import decode_meta, encode_meta, pack, unpack

    tensors = [torch.randn(2, 3), torch.arange(5), torch.randn(4).t(), torch.ones(1, 1, 2)]
    layout = decode_meta(encode_meta(tensors))
    assert layout == [(t.dtype, tuple(t.shape)) for t in tensors]
    flats = pack(tensors)
    assert [d for d in flats] == [torch.float32, torch.int64]  # one message per dtype
    for got, want in zip(unpack(flats, layout), tensors, strict=True):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="at most 64 tensors"):
        encode_meta([torch.zeros(1)] * 65)


class _BlockingGroup:
    """A process group stand-in whose send records the tag and blocks until released."""

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()
        self.tags: list[int] = []

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> str:
        self.tags.append(tag)
        self.release.wait(5.0)
        return f"work {tag}"


def test_sender_handoff_returns_once_taken_and_is_bounded_by_a_stuck_send(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`post` returns when the sender thread has taken the message (so it leaves without
    waiting for the GIL behind the caller's next action), and returns within its bound when
    the thread is still inside an earlier, stuck isend; `close` then posts what is queued."""
    from pipeline.execution.distributed import p2p

    group = _BlockingGroup()
    sender = p2p._Sender(group)  # type: ignore[arg-type]
    item = torch.zeros(1)
    bound = p2p.HANDOFF_WAIT
    monkeypatch.setattr(p2p, "HANDOFF_WAIT", 5.0)  # a loaded machine may take ms to switch
    sender.post((item, 1, 7, "first"))
    assert sender.queue.empty()  # taken before post returned
    monkeypatch.setattr(p2p, "HANDOFF_WAIT", bound)
    started = time.perf_counter()
    sender.post((item, 1, 8, "second"))  # the thread is stuck in the first send
    waited = time.perf_counter() - started
    assert waited < bound + 0.5 and not sender.queue.empty()
    group.release.set()
    posted = sender.close(5.0)
    assert [p[0] for p in posted] == ["work 7", "work 8"] and group.tags == [7, 8]


def test_receives_are_posted_ahead_within_the_byte_budget() -> None:
    """Once a batch shape is known, `begin` posts a peer's receives ahead: at least
    `prefetch`, more while the posted buffers fit `ahead_bytes`; each consumed receive tops the
    window up again, in the peer's send order."""
    from types import SimpleNamespace

    from pipeline.execution.distributed.p2p import P2PTransport
    from scheduler import Op, Recv

    posted: list[int] = []

    class Group:
        def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> str:
            posted.append(tag)
            return "work"

    ctx = SimpleNamespace(
        layout=SimpleNamespace(pp_rank=1, global_rank=lambda r: r, tensor_parallel=1,
                               tp_rank=0), device="cpu",
        pp_group=Group(), wait_work=lambda work, peer, what: None,
    )
    msgs = [(Op.F, 0, m) for m in range(6)]  # 6 messages of 100 float32s (400 bytes) each
    for ahead, first in ((1000, 2), (2000, 5), (10_000, 6), (0, 2)):
        transport = P2PTransport(ctx, prefetch=2, send_thread=False,  # type: ignore[arg-type]
                                 ahead_bytes=ahead)
        transport._metas[7] = {k: [(torch.float32, (100,))] for k in msgs}
        transport._plans[7] = {k: [(torch.float32, 100)] for k in msgs}
        posted.clear()
        transport.begin(7, {0: msgs})
        assert len(posted) == first, ahead
        (buffer,) = transport.recv(Recv(Op.F, 0, 0, peer=0))
        assert buffer.shape == (100,)
        assert len(posted) == min(6, first + 1), ahead  # one consumed, one more posted
    assert sorted(set(posted)) == posted  # tags rise with the microbatch: send order


def test_receives_are_posted_in_each_senders_order() -> None:
    """Rank 0 needs 1F1 before 1F0 but rank 1 sends 1F0 first: an in-order transport (NCCL)
    must post rank 0's receives in rank 1's send order, which `incoming` gives."""
    from scheduler import Op, Recv, Schedule, incoming, lower, receive_order, validate

    schedule = Schedule.from_text(
        "0F0 0F1 2F1 2F0 2B0 2B1 0B0 0B1\n"
        "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"
    )
    validate(schedule)
    F, B = Op.F, Op.B
    program = lower(schedule)
    assert incoming(program, 0) == {
        1: [(F, 1, 0), (F, 1, 1), (B, 3, 0), (B, 3, 1), (B, 1, 0), (B, 1, 1)]
    }
    assert incoming(program, 1) == {
        0: [(F, 0, 0), (F, 0, 1), (F, 2, 1), (F, 2, 0), (B, 2, 0), (B, 2, 1)]
    }
    assert receive_order(schedule)[0][:2] == [Recv(F, 1, 1, peer=1), Recv(F, 1, 0, peer=1)]
    assert incoming(lower(Schedule.from_text("0F0 0B0")), 0) == {}


def test_gradient_buckets_respect_the_cap() -> None:
    from types import SimpleNamespace

    from pipeline.execution.distributed import GradSync

    params = [nn.Parameter(torch.zeros(n)) for n in (10, 30, 5, 40, 1)]
    params.append(nn.Parameter(torch.zeros(3, dtype=torch.float64)))
    ctx = SimpleNamespace(layout=SimpleNamespace(data_parallel=2))
    sync = GradSync(ctx, {0: params}, bucket_bytes=160)  # type: ignore[arg-type]
    sizes = [[p.numel() for p in bucket] for bucket in sync.buckets[0]]
    assert sizes == [[1], [40], [5, 30], [3], [10]]  # reverse order, <= 160 bytes, one dtype


def test_buffer_sync_sends_running_statistics_and_buffers_written_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from pipeline.execution.distributed import gradsync
    from pipeline.execution.grads import running_statistics

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(2)
            self.register_buffer("calls", torch.zeros(()))
            self.register_buffer("table", torch.ones(3))  # constant

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls.add_(1)
            return self.bn(x) * self.table[0]

    model = Counting()
    running = running_statistics(model)
    assert running == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    sent: list[list[torch.Tensor]] = []
    monkeypatch.setattr(gradsync, "_from_replica_0", lambda ctx, ts, what: sent.append(ts))
    ctx = SimpleNamespace(layout=SimpleNamespace(data_parallel=2))
    sync = gradsync.BufferSync(ctx, [model], running)  # type: ignore[arg-type]
    sync.begin()
    model(torch.randn(4, 2))
    sync.finish()
    names = {id(b): n for n, b in model.named_buffers()}
    assert sorted(names[id(t)] for t in sent[0]) == sorted([*running, "calls"])
    one = SimpleNamespace(layout=SimpleNamespace(data_parallel=1))
    single = gradsync.BufferSync(one, [model], running)  # type: ignore[arg-type]
    single.begin()
    model(torch.randn(4, 2))
    single.finish()
    assert len(sent) == 1  # one replica: nothing to send
    assert running_statistics(model.eval()) == set()  # eval: BatchNorm writes nothing


def test_shared_parameter_is_reduced_once_with_the_stage_that_finishes_last() -> None:
    from types import SimpleNamespace

    from pipeline.execution.distributed import GradSync
    from pipeline.execution.distributed.gradsync import finish_order
    from scheduler import Schedule, build_schedule

    params = [nn.Parameter(torch.zeros(n)) for n in (10, 30, 5)]
    ctx = SimpleNamespace(layout=SimpleNamespace(data_parallel=2))
    # Stage 1 finishes first, stage 0 last: the parameters both use go with stage 0.
    sync = GradSync(ctx, {1: params[:2], 0: params})  # type: ignore[arg-type]
    assert [[p.numel() for p in b] for b in sync.buckets[0]] == [[5, 30, 10]]
    assert sync.buckets[1] == []
    sync = GradSync(ctx, {0: params, 1: params[:2]})  # type: ignore[arg-type]
    assert [[p.numel() for p in b] for b in sync.buckets[0]] == [[5]]
    assert [[p.numel() for p in b] for b in sync.buckets[1]] == [[30, 10]]
    # V placement: rank 0 holds stages 0 and 3; stage 0's backward runs last.
    zbv = build_schedule("zbv", 2, 4)
    assert finish_order(zbv, 0) == [3, 0]
    assert finish_order(zbv, 1) == [2, 1]
    assert finish_order(Schedule.from_text("0F0 1F0 1B0 0B0"), 0) == [1, 0]


def test_timeout_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.execution.distributed import DEFAULT_TIMEOUT, ENV_TIMEOUT, resolve_timeout

    monkeypatch.delenv(ENV_TIMEOUT, raising=False)
    assert resolve_timeout(None) == DEFAULT_TIMEOUT
    assert resolve_timeout(3) == 3.0
    monkeypatch.setenv(ENV_TIMEOUT, "7.5")
    assert resolve_timeout(None) == 7.5
    monkeypatch.setenv(ENV_TIMEOUT, "soon")
    with pytest.raises(ValueError, match="HYBRIDPIPE_TIMEOUT='soon' is not a number"):
        resolve_timeout(None)
    with pytest.raises(ValueError, match="> 0"):
        resolve_timeout(0)


if __name__ == "__main__":
    WORKERS[sys.argv[1]](Path(sys.argv[2]))
