"""Resume and periodic checkpoints in one process: retention keeps the newest `keep` versions;
an asynchronous save writes the state as it was when the call returned (the optimizer steps on
meanwhile) and its failure (a full disk) comes back at the wait, with the previous version
live and nothing left behind, so the next save that fits succeeds (also after a synchronous
full-disk failure); a damaged or truncated data file, or a damaged DCP index, is a ValueError
naming the file that changes nothing; a wait for a slow save is bounded and can be repeated;
`Checkpointer` resumes at another stage count with the losses, optimizer and RNG state of the
uninterrupted run (float64, 1e-9), re-planned first from the unit costs the checkpoint kept
(the elastic re-plan) when the resumed Pipeline is planned, and falls back to an older retained
version when the live one is damaged; stages="auto" outside torchrun is refused."""

from __future__ import annotations

import errno
import logging
import random
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from partitioner import partition
from pipeline import Checkpointer, Pipeline
from pipeline.app.models import GPT
from tests.support.disk import FullDiskStream, full_disk
from tests.support.models import lm_loss, make_model, token_batch


def make_pipe(stages: int = 2, seed: int = 0) -> Pipeline:
    return Pipeline(make_model(seed), stages=stages, schedule="1f1b", microbatches=4,
                    loss_fn=lm_loss, balance="parameters")


def train(pipe: Pipeline, opt: torch.optim.Optimizer, step: int) -> float:
    pipe.zero_grad()
    loss = float(pipe.step(*token_batch(step)))
    opt.step()
    return loss


def params(pipe: Pipeline) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in pipe.named_parameters()}


def listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


FULL = r"no space left on the device of checkpoint '.*ckpt'"


def test_retention_keeps_the_newest_versions(tmp_path: Path) -> None:
    pipe = make_pipe()
    for i in range(1, 5):
        pipe.save_checkpoint(tmp_path / "ckpt", extra=i, keep=2)
    assert listing(tmp_path / "ckpt") == ["current", "v-000003", "v-000004"]
    assert pipe.load_checkpoint(tmp_path / "ckpt") == 4
    pipe.save_checkpoint(tmp_path / "ckpt", extra=5)  # keep=1 (the default) prunes the rest
    assert listing(tmp_path / "ckpt") == ["current", "v-000005"]
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        pipe.save_checkpoint(tmp_path / "ckpt", keep=0)


def test_async_save_writes_the_state_of_the_call(tmp_path: Path) -> None:
    pipe = make_pipe()
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    train(pipe, opt, 0)
    saved = params(pipe)
    pipe.save_checkpoint(tmp_path / "ckpt", opt, extra="a", async_save=True)
    for step in (1, 2):  # the parameters change while the write may still go on
        train(pipe, opt, step)
    pipe.wait_checkpoint()
    assert listing(tmp_path / "ckpt") == ["current", "v-000001"]
    fresh = make_pipe(seed=5)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    assert fresh.load_checkpoint(tmp_path / "ckpt", fresh_opt) == "a"
    for k, p in fresh.named_parameters():
        assert torch.equal(p, saved[k]), k
    # A second asynchronous save waits for nothing (none in flight) and replaces the first.
    pipe.save_checkpoint(tmp_path / "ckpt", opt, extra="b", async_save=True)
    pipe.save_checkpoint(tmp_path / "ckpt", opt, extra="c", async_save=True)
    pipe.wait_checkpoint()
    assert listing(tmp_path / "ckpt") == ["current", "v-000003"]
    assert fresh.load_checkpoint(tmp_path / "ckpt", fresh_opt) == "c"


class _SlowDisk(FullDiskStream):
    """DCP's file streams on a disk whose first write to a file takes `room` seconds."""

    def write(self, data: Any) -> int:
        time.sleep(self.room)
        self.room = 0
        return int(self.stream.write(data))


def test_wait_for_a_slow_save_is_bounded_and_can_be_repeated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.checkpoint import filesystem

    pipe = make_pipe()
    real = filesystem.FileSystem.create_stream

    @contextmanager
    def slow(self: Any, path: Any, mode: str) -> Any:
        with real(self, path, mode) as stream:
            yield _SlowDisk(stream, 0.5) if "w" in mode else stream

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", slow)
    pipe.save_checkpoint(tmp_path / "ckpt", extra="slow", async_save=True)
    with pytest.raises(TimeoutError, match=r"did not end within 0.05 s; the previous checkpoint "
                                           r"stays live. Wait longer"):
        pipe.wait_checkpoint(timeout=0.05)
    pipe.wait_checkpoint()  # the same save, still in flight, is waited for again
    monkeypatch.undo()
    assert listing(tmp_path / "ckpt") == ["current", "v-000001"]
    assert pipe.load_checkpoint(tmp_path / "ckpt") == "slow"


@pytest.mark.parametrize("async_save", [False, True])
def test_after_a_full_disk_the_next_save_that_fits_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    pipe = make_pipe()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    train(pipe, opt, 0)
    pipe.save_checkpoint(tmp_path / "ckpt", opt, extra="v1")
    with full_disk(monkeypatch):
        if async_save:
            pipe.save_checkpoint(tmp_path / "ckpt", opt, extra="v2", async_save=True)
            with pytest.raises(OSError, match=FULL) as info:
                pipe.wait_checkpoint()
        else:
            with pytest.raises(OSError, match=FULL) as info:
                pipe.save_checkpoint(tmp_path / "ckpt", opt, extra="v2")
    assert info.value.errno == errno.ENOSPC
    # The failed version is gone; the previous one is live and loads.
    assert listing(tmp_path / "ckpt") == ["current", "v-000001"]
    assert pipe.load_checkpoint(tmp_path / "ckpt", opt) == "v1"
    pipe.wait_checkpoint()  # the error was raised once; nothing is in flight
    pipe.save_checkpoint(tmp_path / "ckpt", opt, extra="v3", async_save=async_save)
    pipe.wait_checkpoint()
    assert listing(tmp_path / "ckpt") == ["current", "v-000002"]  # the failed one's number
    assert pipe.load_checkpoint(tmp_path / "ckpt", opt) == "v3"


def _damage(version: Path, how: str) -> Path:
    if how == "index":
        target = version / ".metadata"
    else:
        target = sorted(version.glob("*.distcp"))[0]
    data = bytearray(target.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "bit":  # one bit inside tensor data: DCP alone loads it as a wrong weight
        data[len(data) // 2] ^= 0x10
    else:
        for i in range(min(len(data), 400)):
            data[i] ^= 0xFF
    target.write_bytes(bytes(data))
    return target


@pytest.mark.parametrize(("how", "reason"), [
    ("flipped", r"its CRC32C checksum differs from the one written with it"),
    ("bit", r"its CRC32C checksum differs from the one written with it"),
    ("truncated", r"it is truncated \(\d+ bytes, \d+ expected\)"),
    ("index", r"DCP's index '.*\.metadata': its CRC32C checksum differs"),
])
def test_damaged_file_is_named_and_changes_nothing(tmp_path: Path, how: str, reason: str) -> None:
    pipe = make_pipe()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    train(pipe, opt, 0)
    pipe.save_checkpoint(tmp_path / "ckpt", opt)
    train(pipe, opt, 1)
    before, state = params(pipe), opt.state_dict()
    momentum = {i: s["momentum_buffer"].clone() for i, s in state["state"].items()}
    target = _damage(tmp_path / "ckpt" / "v-000001", how)
    pattern = r"checkpoint '.*ckpt' is damaged: "
    if how != "index":
        pattern += f"data file {re.escape(repr(str(target)))} holding \\d+ of this process's "
    with pytest.raises(ValueError, match=pattern + r".*" + reason + r".*Nothing was loaded"):
        pipe.load_checkpoint(tmp_path / "ckpt", opt)
    for k, p in pipe.named_parameters():
        assert torch.equal(p, before[k]), k
    for i, s in opt.state_dict()["state"].items():
        assert torch.equal(s["momentum_buffer"], momentum[i]), i


def test_checkpointer_resumes_at_another_stage_count(tmp_path: Path) -> None:
    # The uninterrupted run: 8 steps, a periodic asynchronous save every 3 steps.
    pipe = make_pipe(stages=2)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    ckpt = Checkpointer(pipe, tmp_path / "ckpt", opt, every=3, keep=2, async_save=True)
    assert ckpt.resume() is None
    losses, drawn = [], {}
    for step in range(8):
        losses.append(train(pipe, opt, step))
        random.random()
        if ckpt.maybe_save(step + 1, data={"epoch": 0, "next": step + 1}):
            drawn[step + 1] = (torch.rand(3), random.random())
    ckpt.close()
    assert listing(tmp_path / "ckpt") == ["current", "v-000001", "v-000002"]
    # A new run with 4 stages picks up after step 6 (the live version).
    torch.manual_seed(123)
    again = make_pipe(stages=4, seed=9)
    again_opt = torch.optim.Adam(again.parameters(), lr=1.0)  # lr comes from the checkpoint
    resumed = Checkpointer(again, tmp_path / "ckpt", again_opt, every=3).resume()
    assert resumed is not None
    assert (resumed.step, resumed.data) == (6, {"epoch": 0, "next": 6})
    assert resumed.saved_layout == {"stages": 2, "data_parallel": 1}
    assert resumed.layout == {"stages": 4, "data_parallel": 1}
    assert re.fullmatch(r"resumed after step 6 from '.*v-000002' \(saved at stages=2 x "
                        r"data_parallel=1, loaded at stages=4 x data_parallel=1\) in [\d.]+ s",
                        str(resumed))
    rand, py = drawn[6]
    assert torch.equal(torch.rand(3), rand) and random.random() == py
    for step in range(6, 8):
        torch.testing.assert_close(train(again, again_opt, step), losses[step], atol=1e-9,
                                   rtol=0)


def test_resume_at_another_layout_replans_from_the_unit_costs_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The elastic re-plan: a run balanced on its profile at 2 stages saves; a run at 4
    stages, split uniformly (2 of the 4 equal blocks on one stage), resumes from it
    re-planned from the saved unit costs (`Planner.replan`, "elastic"; one block per stage,
    no profiling) and trains on with the same losses."""
    x0, _ = token_batch(0)
    pipe = Pipeline(make_model(), stages=2, schedule="1f1b", microbatches=4, loss_fn=lm_loss,
                    example_input=x0, capture_method="fx")  # fx: 0.1 s, export seconds
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    ckpt = Checkpointer(pipe, tmp_path / "ckpt", opt, every=2)
    losses = []
    for step in range(3):
        losses.append(train(pipe, opt, step))
        if step < 2:
            ckpt.maybe_save(step + 1)
    ckpt.close()
    kept = dict(pipe.captured.costs)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the resumed run profiled")

    monkeypatch.setattr("pipeline.planning.measure.profile", refuse)
    again = Pipeline(make_model(9), stages=4, schedule="1f1b", microbatches=4, loss_fn=lm_loss,
                     balance="uniform", example_input=x0, capture_method="fx")
    uniform = again.plan.sizes
    again_opt = torch.optim.Adam(again.parameters(), lr=1.0)
    resumed = Checkpointer(again, tmp_path / "ckpt", again_opt).resume()
    assert resumed is not None and resumed.step == 2
    report = resumed.replanned
    assert report is not None and report.before == uniform, (report, uniform)
    assert again.captured.costs == kept  # planned on the saving run's costs, as they were
    balanced = partition(again.captured, 4, "profile").sizes
    assert report.after == balanced != uniform and report.applied, report
    assert again.plan.sizes == balanced
    assert str(resumed).endswith(f"re-planned from the unit costs it kept: stages "
                                 f"{uniform} -> {balanced}, applied"), str(resumed)
    torch.testing.assert_close(train(again, again_opt, 2), losses[2], atol=1e-9, rtol=0)


def test_checkpointer_refuses_bad_settings_and_foreign_checkpoints(tmp_path: Path) -> None:
    pipe = make_pipe()
    with pytest.raises(ValueError, match="every must be an int >= 1, got 0"):
        Checkpointer(pipe, tmp_path, every=0)
    pipe.save_checkpoint(tmp_path / "plain", extra={"step": 3})
    with pytest.raises(ValueError, match="was not written by a Checkpointer"):
        Checkpointer(pipe, tmp_path / "plain").resume()


def test_auto_stages_need_torchrun() -> None:
    with pytest.raises(ValueError, match=r'stages="auto" chooses \(stages, data_parallel\) for '
                                         r"the world size under torchrun"):
        Pipeline(GPT(vocab=32, dim=16, layers=2, heads=2, max_seq=8), stages="auto")


def test_resume_falls_back_to_an_older_version_when_the_live_one_is_damaged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pipe = make_pipe()
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    ckpt = Checkpointer(pipe, tmp_path / "ckpt", opt, every=2, keep=2)
    losses = []
    for step in range(4):
        losses.append(train(pipe, opt, step))
        ckpt.maybe_save(step + 1)
    ckpt.close()
    _damage(tmp_path / "ckpt" / "v-000002", "truncated")
    again = make_pipe(seed=3)
    again_opt = torch.optim.Adam(again.parameters(), lr=1.0)
    with caplog.at_level(logging.WARNING, logger="hybridpipe"):
        resumed = Checkpointer(again, tmp_path / "ckpt", again_opt).resume()
    assert resumed is not None and (resumed.step, resumed.version.name) == (2, "v-000001")
    assert re.search(r"checkpoint version v-000002 of .* not loaded \(checkpoint .* is damaged",
                     caplog.text), caplog.text
    for step in (2, 3):
        torch.testing.assert_close(train(again, again_opt, step), losses[step], atol=1e-9,
                                   rtol=0)
    with pytest.raises(ValueError, match=r"has no version 'v-000009'; it holds \['v-000001', "
                                         r"'v-000002'\]"):
        again.load_checkpoint(tmp_path / "ckpt", version="v-000009")
    _damage(tmp_path / "ckpt" / "v-000001", "truncated")  # none loads: the newest one's error
    with pytest.raises(ValueError, match=r"v-000002/__0_0.distcp' .*: it is truncated"):
        Checkpointer(again, tmp_path / "ckpt", again_opt).resume()


def test_a_flipped_bit_in_the_live_version_falls_back_to_an_older_one(tmp_path: Path) -> None:
    pipe = make_pipe()
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    ckpt = Checkpointer(pipe, tmp_path / "ckpt", opt, every=1, keep=2)
    losses = [train(pipe, opt, 0)]
    ckpt.maybe_save(1)
    losses.append(train(pipe, opt, 1))
    ckpt.maybe_save(2)
    ckpt.close()
    _damage(tmp_path / "ckpt" / "v-000002", "bit")
    again = make_pipe(seed=3)
    again_opt = torch.optim.Adam(again.parameters(), lr=1.0)
    resumed = Checkpointer(again, tmp_path / "ckpt", again_opt).resume()
    assert resumed is not None and (resumed.step, resumed.version.name) == (1, "v-000001")
    torch.testing.assert_close(train(again, again_opt, 1), losses[1], atol=1e-9, rtol=0)
    meta = tmp_path / "ckpt" / "v-000001" / "hybridpipe.pt"
    data = bytearray(meta.read_bytes())
    data[len(data) // 2] ^= 0x01
    meta.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"is damaged: its metadata '.*v-000001/hybridpipe.pt'"
                                         ": its CRC32C checksum differs"):
        again.load_checkpoint(tmp_path / "ckpt", version="v-000001")
    sums = tmp_path / "ckpt" / "v-000002" / "checksums-r0.json"
    sums.write_text(sums.read_text().replace('"crc": ', '"crc": 1'))
    with pytest.raises(ValueError, match=r"checksums-r0.json' is damaged \(its own checksum"):
        again.load_checkpoint(tmp_path / "ckpt")


def test_resume_restores_numpys_generator_for_augmentation(tmp_path: Path) -> None:
    """A batch stream that augments with NumPy's global generator draws the same after a
    resume as in the uninterrupted run."""

    def augmented(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = token_batch(step)
        flip = np.random.rand(x.shape[0]) < 0.5
        x[torch.from_numpy(flip)] = x[torch.from_numpy(flip)].flip(1)
        return x, y

    def run(pipe: Pipeline, opt: torch.optim.Optimizer, step: int) -> float:
        pipe.zero_grad()
        loss = float(pipe.step(*augmented(step)))
        opt.step()
        return loss

    np.random.seed(5)
    pipe = make_pipe()
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    losses = [run(pipe, opt, step) for step in range(4)]  # uninterrupted
    np.random.seed(5)
    first = make_pipe()
    first_opt = torch.optim.Adam(first.parameters(), lr=1e-2)
    ckpt = Checkpointer(first, tmp_path / "ckpt", first_opt, every=2)
    for step in range(2):  # interrupted after a save at step 2
        run(first, first_opt, step)
        ckpt.maybe_save(step + 1)
    ckpt.close()
    np.random.seed(99)  # a new process starts from another state
    again = make_pipe(seed=3)
    again_opt = torch.optim.Adam(again.parameters(), lr=1.0)
    assert Checkpointer(again, tmp_path / "ckpt", again_opt).resume() is not None
    for step in (2, 3):
        torch.testing.assert_close(run(again, again_opt, step), losses[step], atol=1e-9, rtol=0)


def test_rng_states_are_keyed_by_replica_pipeline_and_tp_rank() -> None:
    """Each tp rank resumes its own RNG states (they were keyed by (replica, pipeline rank),
    so the tp ranks of one stage overwrote each other's); a checkpoint written with the old
    two-part keys still resumes, and a coordinate the save did not have takes rank 0's."""
    from pipeline.elastic.checkpointer import _saved_rng

    states: dict[tuple[int, ...], dict[str, Any]] = {
        (0, 0, 0): {"at": "rank 0"}, (0, 1, 1): {"at": "pp 1 tp 1"}, (0, 1, 0): {"at": "pp 1"}}
    assert _saved_rng(states, (0, 1, 1)) == {"at": "pp 1 tp 1"}
    assert _saved_rng(states, (0, 1, 0)) == {"at": "pp 1"}
    assert _saved_rng(states, (1, 3, 0)) == {"at": "rank 0"}
    old: dict[tuple[int, ...], dict[str, Any]] = {(0, 0): {"at": "old 0"}, (0, 1): {"at": "old 1"}}
    assert _saved_rng(old, (0, 1, 1)) == {"at": "old 1"}
    assert _saved_rng(old, (2, 2, 0)) == {"at": "old 0"}
    with pytest.raises(ValueError, match="no entry"):
        _saved_rng({(1, 1, 1): {}}, (0, 0, 0))
