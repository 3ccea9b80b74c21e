"""Distributed setup is as safe as a step (pipeline.execution.distributed.agreement,
pipeline.planning.settings).

Spawned gloo processes (launched as torchrun does, by test_distributed.launch):
- Pipelines that differ in one setting per case (schedule, microbatches, virtual stages, loss
  weighting, stages / data_parallel, schedule text, model parameters, input dtype) end every
  rank with one SettingsMismatch naming the setting, each rank's value and the fix, before any
  tensor moved; the same job then builds a matching Pipeline and trains it correctly;
- a later step whose last stage holds targets of another batch size, or a step on one rank
  and a forward on the other, end every rank with both values;
- a rank that dies before building its Pipeline, raises while capturing, is killed while
  profiling, or hangs while building is named, with what it was doing, by every surviving rank,
  which exits with status 1: no gloo abort, no bare "Read error".
The wall time from the fault to its detection is printed and written to ``detection.json`` in
the test's directory (benchmarks/bench_setup.py collects it into benchmarks/results), never
asserted. Process-free tests cover the message format and the sync protocol on one store.

This file is also the worker: ``python <this file> WORKER OUT_DIR``.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.support.distributed import BATCH, Checker, Ended, dump, init_worker, launch
from tests.support.models import global_batch, lm_loss, make_model

TIMEOUT = 5.0  # seconds any wait may take in the failure cases


# ---------------------------------------------------------------------------------------------
# Workers (run in the launched processes)
# ---------------------------------------------------------------------------------------------


def _pipeline(**kwargs: Any) -> Any:
    from pipeline import Pipeline

    args: dict[str, Any] = dict(model=make_model(), stages=2, schedule="1f1b", microbatches=4,
                                loss_fn=lm_loss, balance="parameters")
    args.update(kwargs)
    return Pipeline(**args)


def mismatch_cases() -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Per case: the Pipeline arguments rank 0 and rank 1 use (the rest as in `_pipeline`)."""
    from pipeline.app.models import GPT
    from scheduler import build_schedule

    x = global_batch(0, BATCH)[0]
    torch.manual_seed(0)
    shallower = GPT(vocab=32, dim=16, layers=3, heads=2, max_seq=8).double()
    return {
        "schedule": ({"schedule": "1f1b"}, {"schedule": "zb-h1"}),
        "microbatches": ({"microbatches": 4}, {"microbatches": 2}),
        "virtual_stages": ({"schedule": "interleaved-1f1b", "virtual_stages": 2},
                           {"schedule": "interleaved-1f1b", "virtual_stages": 3}),
        "loss weighting": ({"loss_fn": nn.CrossEntropyLoss()},
                           {"loss_fn": nn.CrossEntropyLoss(reduction="sum")}),
        "stages": ({"stages": 2}, {"stages": 1}),
        "schedule text": ({"schedule": build_schedule("gpipe", 2, 4)},
                          {"schedule": build_schedule("1f1b", 2, 4)}),
        "model parameters": ({}, {"model": shallower}),
        "input dtypes": ({"example_input": x}, {"example_input": x.int()}),
    }


def _record(out: Path, name: str, **values: Any) -> None:
    (out / f"{name}.json").write_text(json.dumps({"time": time.time(), **values}))


def worker_mismatch(out: Path) -> None:
    """world 2: every mismatch case in turn (each one a SettingsMismatch on both ranks), then
    a matching Pipeline trains exactly; then rank 1 gets targets of 6 rows at step 2 (fatal)."""
    import torch.distributed as dist

    from pipeline.execution.distributed import SettingsMismatch

    init_worker()
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for case, per_rank in mismatch_cases().items():
        start = time.perf_counter()
        try:
            _pipeline(**per_rank[rank])
        except SettingsMismatch as err:
            results[case] = {"message": str(err), "seconds": time.perf_counter() - start}
        else:
            results[case] = {"message": None}
    (out / f"mismatch-rank{rank}.json").write_text(json.dumps(results))
    Checker(2, "1f1b").train(2)  # the job is intact: same loss and grads as one process
    print("worker mismatch: the matching Pipeline trained")
    pipe = _pipeline()
    x, y = global_batch(1, BATCH)
    pipe.step(x, y)
    if rank == 1:
        x, y = x[:6], y[:6]
        _record(out, "inject")
    _step_and_record(out, rank, lambda: pipe.step(x, y))


def _step_and_record(out: Path, rank: int, call: Callable[[], object]) -> None:
    try:
        call()
    except Exception as err:
        _record(out, f"detect-rank{rank}", message=str(err))
        raise
    raise AssertionError("the step finished although the ranks disagree")


def worker_call(out: Path) -> None:
    """world 2: rank 0 calls step while rank 1 calls forward (fatal)."""
    import torch.distributed as dist

    init_worker()
    rank = dist.get_rank()
    pipe = _pipeline()
    x, y = global_batch(1, BATCH)
    if rank == 0:  # one writer: both writing inject.json at once could interleave the text
        _record(out, "inject")
    _step_and_record(out, rank, lambda: pipe.step(x, y) if rank == 0 else pipe(x))


def _setup_fault(out: Path, victim: int, fault: str, **kwargs: Any) -> None:
    """Build a Pipeline and take one step; rank `victim` faults as `fault` says."""
    import torch.distributed as dist

    init_worker()
    rank = dist.get_rank()
    model = make_model()
    if rank == victim:
        _arm(out, model, fault)
    x, y = global_batch(0, BATCH)
    _step_and_record(out, rank, lambda: _pipeline(model=model, **kwargs).step(x, y))


def _arm(out: Path, model: nn.Module, fault: str) -> None:
    """Make this process fault at the named point of its setup."""
    if fault == "dead before building":
        _record(out, "inject")
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "raise while capturing":

        def trap(module: nn.Module, inputs: tuple[Any, ...]) -> None:
            _record(out, "inject")  # the first call on this rank is the capture's
            raise ValueError("injected failure while capturing")

        model.blocks[0].register_forward_pre_hook(trap)  # type: ignore[index]
    if fault == "killed while profiling":
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        phase = f"hybridpipe/setup/1/phase/{dist.get_rank()}"  # as this process reports it

        def kill(module: nn.Module, inputs: tuple[Any, ...]) -> None:
            if store.get(phase) == b"profiling of the model":  # the capture runs it too
                _record(out, "inject")
                os.kill(os.getpid(), signal.SIGKILL)

        model.head.register_forward_pre_hook(kill)  # type: ignore[union-attr]
    if fault == "hang while building":
        head = model.head

        def hang(fn: Any, recurse: bool = True) -> Any:
            _record(out, "inject")
            threading.Event().wait()

        head._apply = hang  # type: ignore[method-assign, assignment]


def worker_dead(out: Path) -> None:
    """world 2: rank 1 is killed before it builds its Pipeline."""
    _setup_fault(out, 1, "dead before building")


def worker_capture(out: Path) -> None:
    """world 3, pp=3: rank 1's model raises while it is captured."""
    _setup_fault(out, 1, "raise while capturing", stages=3)


def worker_profile(out: Path) -> None:
    """world 2: global rank 0 (the only one profiling) is killed while profiling."""
    # fx capture: the fault hooks on the user's modules run inside fx's stages (an exported
    # graph calls aten ops, not the modules).
    _setup_fault(out, 0, "killed while profiling", balance="profile", capture_method="fx")


def worker_build(out: Path) -> None:
    """world 2: rank 1 hangs while building its executor (moving its stage to its device)."""
    _setup_fault(out, 1, "hang while building", capture_method="fx")


WORKERS: dict[str, Callable[[Path], None]] = {
    "mismatch": worker_mismatch,
    "call": worker_call,
    "dead": worker_dead,
    "capture": worker_capture,
    "profile": worker_profile,
    "build": worker_build,
}


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def _run(worker: str, world: int, out: Path, hangs: int | None = None,
         timeout: float = TIMEOUT) -> list[Ended]:
    return launch(worker, world, out, timeout=timeout, deadline=90.0, hangs=hangs,
                  script=__file__)


def _clean_exit(ended: list[Ended], survivors: list[int]) -> None:
    """Every surviving rank ended with status 1 (an exception), no C++ abort, no bare gloo
    error."""
    for e in ended:
        if e.rank in survivors:
            assert e.returncode == 1, dump(ended)
            assert "terminate called" not in e.output and "Read error" not in e.output, dump(
                ended)


def _detection(out: Path, survivors: list[int], label: str) -> dict[int, float]:
    """Seconds from the fault to each survivor's error: printed and kept, not asserted."""
    inject = json.loads((out / "inject.json").read_text())["time"]
    seconds = {r: json.loads((out / f"detect-rank{r}.json").read_text())["time"] - inject
               for r in survivors}
    print(f"{label}: detected after " + ", ".join(f"{s:.2f} s on rank {r}"
                                                 for r, s in seconds.items()))
    (out / "detection.json").write_text(json.dumps({"case": label, "timeout": TIMEOUT,
                                                    "seconds": seconds}))
    return seconds


@pytest.fixture(scope="module")
def mismatch_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Ended]]:
    out = tmp_path_factory.mktemp("mismatch")
    return out, _run("mismatch", 2, out, timeout=60.0)  # it trains too: no tight timeout


EXPECTED = {  # case -> what its message must say
    "schedule": ["schedule: '1f1b' on rank 0; 'zb-h1' on rank 1"],
    "microbatches": ["microbatches: 4 on rank 0; 2 on rank 1"],
    "virtual_stages": ["virtual_stages: 2 on rank 0; 3 on rank 1"],
    "loss weighting": ["loss weighting: CrossEntropyLoss(reduction='mean')",
                       "CrossEntropyLoss(reduction='sum'), each microbatch weighted"],
    "stages": ["stages: 2 on rank 0; 1 on rank 1", "data_parallel: 1 on rank 0; 2 on rank 1"],
    "schedule text": ["schedule text: 'gpipe': 16 actions", "'1f1b': 16 actions",
                      "first difference, line 1: '0F0 0F1 0F2 0F3"],
    "model parameters": ["model parameters: 53 tensors, 14,304 values", "on rank 0; 41 tensors",
                         "first difference, line 39: 'blocks.3.ln1.weight (16,) torch.float64' "
                         "on rank 0, 'ln_f.weight (16,) torch.float64' on rank 1"],
    "input dtypes": ["found at the first batch", "input dtypes: (int64,) on rank 0; "
                     "(int32,) on rank 1"],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(EXPECTED))
def test_mismatched_setting_is_named_on_every_rank(
    mismatch_run: tuple[Path, list[Ended]], case: str
) -> None:
    out, ended = mismatch_run
    seen = [json.loads((out / f"mismatch-rank{r}.json").read_text())[case] for r in (0, 1)]
    message = seen[0]["message"]
    assert message is not None, f"{case}: no SettingsMismatch\n" + dump(ended)
    assert seen[1]["message"] == message  # one message, the same on every rank
    for text in [*EXPECTED[case], "before any tensor moved", "fix: "]:
        assert text in message, f"{case}: {text!r} not in\n{message}"
    print(f"{case}: found after {seen[0]['seconds']:.3f} s (Pipeline construction included)")


@pytest.mark.slow
def test_job_survives_a_mismatch_and_a_later_batch_size_mismatch_ends_every_rank(
    mismatch_run: tuple[Path, list[Ended]],
) -> None:
    out, ended = mismatch_run
    assert "the matching Pipeline trained" in ended[0].output, dump(ended)
    _clean_exit(ended, [0, 1])
    for e in ended:
        assert ("the batch size differs within replica 0: rank 0 (pipeline rank 0 of replica 0)"
                " (stage 0) was given inputs of 8 samples but rank 1 (pipeline rank 1 of "
                "replica 0) (the last stage) targets of 6") in e.output, dump(ended)
    assert "RankFailure" in ended[0].output and "ValueError" in ended[1].output, dump(ended)
    _detection(out, [0, 1], "targets of another batch size at a later step")


@pytest.mark.slow
def test_step_on_one_rank_and_forward_on_another_ends_every_rank(tmp_path: Path) -> None:
    ended = _run("call", 2, tmp_path)
    _clean_exit(ended, [0, 1])
    for e in ended:
        assert ("the call differs within replica 0: rank 0 (pipeline rank 0 of replica 0) "
                "(stage 0) called step(x, y) but rank 1 (pipeline rank 1 of replica 0) called "
                "forward") in e.output, dump(ended)
    _detection(tmp_path, [0, 1], "step on rank 0, forward on rank 1")


@pytest.mark.slow
def test_rank_dead_before_building_is_named(tmp_path: Path) -> None:
    ended = _run("dead", 2, tmp_path)
    assert ended[1].returncode == -signal.SIGKILL, dump(ended)
    _clean_exit(ended, [0])
    assert ("RankFailure: rank 0 (pipeline rank 0 of replica 0) stopped its setup at the "
            "settings check because rank 1 (pipeline rank 1 of replica 0) (it never started "
            f"building this Pipeline) did not reach the settings check within {TIMEOUT:g} s"
            ) in ended[0].output, dump(ended)
    _detection(tmp_path, [0], "rank dead before building its Pipeline")


@pytest.mark.slow
def test_rank_raising_while_capturing_is_named_by_every_rank(tmp_path: Path) -> None:
    # Not found by a timeout: the error itself is reported. The timeout only has to outlast
    # the capture's own error path (torch.fx's interpreter imports torch._dynamo: seconds).
    ended = _run("capture", 3, tmp_path, timeout=30.0)
    _clean_exit(ended, [0, 1, 2])
    assert "ValueError: injected failure while capturing" in ended[1].output, dump(ended)
    for e in (ended[0], ended[2]):
        assert (f"rank {e.rank} (pipeline rank {e.rank} of replica 0) stopped its setup at the "
                "plan because rank 1 (pipeline rank 1 of replica 0) raised ValueError during "
                "its capture of the model: injected failure while capturing") in e.output, (
            dump(ended))
    _detection(tmp_path, [0, 2], "rank raising while capturing")


@pytest.mark.slow
def test_rank_killed_while_profiling_is_named(tmp_path: Path) -> None:
    ended = _run("profile", 2, tmp_path)
    assert ended[0].returncode == -signal.SIGKILL, dump(ended)
    _clean_exit(ended, [1])
    assert ("because rank 0 (pipeline rank 0 of replica 0) (last reported: profiling of the "
            f"model) did not reach the plan within {TIMEOUT:g} s") in ended[1].output, (
        dump(ended))
    _detection(tmp_path, [1], "rank killed while profiling")


@pytest.mark.slow
def test_rank_hanging_while_building_is_named(tmp_path: Path) -> None:
    ended = _run("build", 2, tmp_path, hangs=1)
    assert ended[1].returncode == -signal.SIGKILL, dump(ended)  # killed by us, still hung
    _clean_exit(ended, [0])
    assert ("because rank 1 (pipeline rank 1 of replica 0) (last reported: building of the "
            f"executor) did not reach the start within {TIMEOUT:g} s") in ended[0].output, (
        dump(ended))
    _detection(tmp_path, [0], "rank hanging while building")


# -- the protocol on one store, no processes ------------------------------------------------


def test_mismatch_message_groups_ranks_and_shows_the_first_difference() -> None:
    from pipeline.planning.settings import Setting, mismatch_message

    same = {"stages": Setting("2")}
    per_rank = [
        {**same, "schedule text": Setting("a", ("0F0 0B0", "1F0 1B0"))},
        {**same, "schedule text": Setting("b", ("0F0 0B0", "1F0 1F1"))},
        {**same, "schedule text": Setting("a", ("0F0 0B0", "1F0 1B0")), "input dtypes": None},
        {**same, "schedule text": Setting("a", ("0F0 0B0", "1F0 1B0"))},
    ]
    message = mismatch_message("the plan", per_rank)
    assert message is not None
    assert "  schedule text: a on ranks 0, 2-3; b on rank 1\n" in message
    assert "first difference, line 2: '1F0 1B0' on rank 0, '1F0 1F1' on rank 1" in message
    assert "fix: give every process the same schedule" in message
    assert "stages" not in message and "input dtypes" not in message
    # A setting not known on some ranks (None) is compared among the others only.
    assert mismatch_message("x", [{"input dtypes": None}, {"input dtypes": Setting("a")}]) is None


def _agreements(world: int, timeout: float) -> list[Any]:
    """One Agreement per rank, each with its own client of one store (as processes have)."""
    import torch.distributed as dist

    from pipeline.execution.distributed.agreement import Agreement

    wait = datetime.timedelta(seconds=10)
    host = dist.TCPStore("127.0.0.1", 0, world + 1, True, timeout=wait,
                         wait_for_workers=False)
    clients = [dist.TCPStore("127.0.0.1", host.port, world + 1, False, timeout=wait)
               for _ in range(world)]
    return [Agreement(c, r, world, timeout) for r, c in enumerate(clients)] + [host]


def _in_threads(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run each call in its own thread (as one rank each); their results or exceptions."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as err:
            results[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return results


def test_sync_gives_rank_zeros_payload_and_names_a_failed_or_silent_rank() -> None:
    from pipeline.execution.distributed import RankFailure, SettingsMismatch
    from pipeline.planning.settings import Setting

    a = _agreements(3, timeout=1.0)
    got = _in_threads([lambda: a[0].sync("one", {"plan": 7}, {"s": Setting("x")}),
                       lambda: a[1].sync("one", None, {"s": Setting("x")}),
                       lambda: a[2].sync("one", None, {"s": Setting("x")})])
    assert got == [{"plan": 7}] * 3

    got = _in_threads([lambda r=r: a[r].sync("two", None, {"s": Setting(str(r == 2))})
                       for r in range(3)])
    assert all(isinstance(g, SettingsMismatch) for g in got) and len({str(g) for g in got}) == 1
    assert "s: False on ranks 0-1; True on rank 2" in str(got[0])

    def fails() -> None:
        with a[1].phase("capture of the model"):
            raise KeyError("boom")

    got = _in_threads([lambda: a[0].sync("three"), fails, lambda: a[2].sync("three")])
    assert isinstance(got[1], KeyError)
    for g in (got[0], got[2]):
        assert isinstance(g, RankFailure)
        assert "because rank 1 raised KeyError during its capture of the model" in str(g)

    b = _agreements(2, timeout=0.3)
    b[1].note("profiling of the model")
    got = _in_threads([lambda: b[0].sync("four")])  # rank 1 never comes
    assert isinstance(got[0], RankFailure)
    assert ("rank 1 (last reported: profiling of the model) did not reach four within 0.3 s"
            in str(got[0]))
    late = _in_threads([lambda: b[1].sync("four")])[0]  # rank 1 comes after all
    assert isinstance(late, RankFailure)
    assert "rank 1 reached four after the other processes had stopped waiting for it" in str(late)


if __name__ == "__main__":
    WORKERS[sys.argv[1]](Path(sys.argv[2]))
