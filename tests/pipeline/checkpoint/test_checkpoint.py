"""Checkpoints in one process: state_dict / load_state_dict under the original keys, clear errors
for state dicts and checkpoints that do not fit, resuming with optimizer state gives the same
losses, a meta-device model loads its weights, a writer killed during save_checkpoint leaves
the previous checkpoint intact (killed in a child process mid-write of a DCP shard and before
the switch to the new version), loads that do not fit (another optimizer type, other param
groups) change nothing, `extra` that could not load back is refused at save time, and a full
disk is named. Resharding across layouts is tested in test_distributed.py.

This file is also the killed writer: ``python <this file> MODE DIR``."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import re
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from pipeline import Pipeline
from pipeline.app.models import GPT
from tests.support import ROOT
from tests.support.disk import full_disk
from tests.support.models import lm_loss, make_model, token_batch


def make_pipe(model: nn.Module, **kw: Any) -> Pipeline:
    return Pipeline(model, stages=2, schedule="1f1b", microbatches=4, loss_fn=lm_loss,
                    balance="parameters", **kw)


def test_state_dict_has_original_keys_and_loads_into_another_pipeline() -> None:
    model = make_model()
    pipe = make_pipe(model, example_input=token_batch(0)[0])
    sd = pipe.state_dict()
    assert sd is not None
    expected = model.state_dict()
    assert list(sd) == list(expected)
    for k, v in expected.items():
        assert torch.equal(sd[k], v), k
    other = make_pipe(make_model(seed=1), example_input=token_batch(0)[0])
    other.load_state_dict(sd)
    for (k, p), (k2, q) in zip(other.named_parameters(), model.named_parameters(), strict=True):
        assert k == k2 and torch.equal(p, q), k
    x, y = token_batch(1)
    assert torch.equal(other.step(x, y), pipe.step(x, y))


def test_load_state_dict_names_missing_unexpected_and_mismatched_keys() -> None:
    pipe = make_pipe(make_model())
    good = make_model(seed=3).state_dict()
    missing = {k: v for k, v in good.items() if k not in ("head.weight", "ln_f.bias")}
    with pytest.raises(ValueError, match=r"missing keys \(2\): head.weight, ln_f.bias"):
        pipe.load_state_dict(missing)
    with pytest.raises(ValueError, match=r"unexpected keys \(1\): bogus.weight"):
        pipe.load_state_dict({**good, "bogus.weight": torch.zeros(2)})
    wrong = {**good, "head.weight": torch.zeros(3, 16, dtype=torch.float64)}
    with pytest.raises(ValueError, match=r"head.weight: shape \(3, 16\) in state_dict, \(32, 16\)"):
        pipe.load_state_dict(wrong)
    with pytest.raises(TypeError, match="give a mapping"):
        pipe.load_state_dict([1, 2])  # type: ignore[arg-type]
    before = {k: p.clone() for k, p in pipe.named_parameters()}
    pipe.load_state_dict(missing, strict=False)  # loads what is there
    got = dict(pipe.named_parameters())
    assert torch.equal(got["head.weight"], before["head.weight"])
    assert torch.equal(got["tok.weight"], good["tok.weight"])


def test_checkpoint_of_another_model_or_not_a_checkpoint(tmp_path: Path) -> None:
    small = make_pipe(make_model(dim=8))
    small.save_checkpoint(tmp_path / "small")
    pipe = make_pipe(make_model())
    with pytest.raises(ValueError, match=r"saved from a different model: .*tok.weight: "
                                         r"\(32, 8\) vs \(32, 16\)"):
        pipe.load_checkpoint(tmp_path / "small")
    torch.save(make_model().state_dict(), tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="not a hybridpipe checkpoint"):
        pipe.load_checkpoint(tmp_path / "plain.pt")
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        pipe.load_checkpoint(tmp_path / "absent.pt")
    with pytest.raises(ValueError, match="has no optimizer state"):
        small.load_checkpoint(tmp_path / "small",
                              optimizer=torch.optim.SGD(small.parameters(), lr=0.1))


def test_resume_with_adam_gives_the_same_losses(tmp_path: Path) -> None:
    pipe = make_pipe(make_model())
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    losses = []
    for step in range(6):
        if step == 3:
            pipe.save_checkpoint(tmp_path / "ckpt", optimizer=opt, extra={"step": step})
        x, y = token_batch(step)
        pipe.zero_grad()
        losses.append(pipe.step(x, y))
        opt.step()
    resumed = make_pipe(make_model(seed=5))
    opt2 = torch.optim.Adam(resumed.parameters(), lr=1.0)
    assert resumed.load_checkpoint(tmp_path / "ckpt", optimizer=opt2) == {"step": 3}
    assert opt2.param_groups[0]["lr"] == 1e-2
    for step in range(3, 6):
        x, y = token_batch(step)
        resumed.zero_grad()
        assert torch.equal(resumed.step(x, y), losses[step]), step
        opt2.step()


def test_meta_model_gets_real_weights_from_a_state_dict(tmp_path: Path) -> None:
    reference = make_model()
    torch.save(reference.state_dict(), tmp_path / "weights.pt")
    with torch.device("meta"):
        model = GPT(vocab=32, dim=16, layers=4, heads=2, max_seq=8).double()
    pipe = make_pipe(model)
    pipe.load_state_dict(torch.load(tmp_path / "weights.pt", mmap=True))
    assert not any(p.is_meta for p in pipe.parameters())
    x, y = token_batch(0)
    torch.testing.assert_close(pipe.step(x, y), lm_loss(reference(x), y), atol=1e-10, rtol=0)


class _DyingStream:
    """A DCP file stream that writes half of the first write, then has the process killed."""

    def __init__(self, stream: Any, die: Any) -> None:
        self.stream, self.die = stream, die

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.stream.write(view[: len(view) // 2])
        self.stream.flush()
        self.die()
        return 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _writer(mode: str, out: Path) -> None:
    """Save v1, change the weights, then die (SIGKILL) while saving v2."""

    from torch.distributed.checkpoint import filesystem

    import pipeline.checkpoint.files as ckpt

    torch.set_num_threads(1)
    pipe = make_pipe(make_model())
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    pipe.save_checkpoint(out / "ckpt", optimizer=opt, extra="v1")
    torch.save(pipe.state_dict(), out / "v1-state.pt")
    with torch.no_grad():
        for p in pipe.parameters():
            p.add_(1.0)

    def die(*args: object, **kw: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if mode == "mid-write":
        real = filesystem.FileSystem.create_stream

        @contextmanager
        def dying(self: Any, path: Any, mode: str) -> Any:
            with real(self, path, mode) as stream:
                yield _DyingStream(stream, die) if str(path).endswith(".distcp") else stream

        filesystem.FileSystem.create_stream = dying  # type: ignore[method-assign]
    else:  # every shard is written and synced, the switch to the new version has not happened
        ckpt.os.replace = die  # type: ignore[assignment]
    pipe.save_checkpoint(out / "ckpt", optimizer=opt, extra="v2")
    raise AssertionError("the writer was not killed")


@pytest.mark.slow
def test_killed_writer_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    runs = {}
    for mode in ("mid-write", "before-rename"):
        out = tmp_path / mode
        out.mkdir()
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        runs[mode] = (out, subprocess.Popen([sys.executable, __file__, mode, str(out)], env=env,
                                            cwd=ROOT, stderr=subprocess.PIPE, text=True))
    for mode, (out, proc) in runs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == -signal.SIGKILL, f"{mode}: exit {proc.returncode}\n{err}"
        # The dead writer's new version is there, partly (mid-write) or wholly written.
        assert sorted(p.name for p in (out / "ckpt").iterdir()) == [
            "current", "v-000001", "v-000002"
        ], mode
        shards = list((out / "ckpt" / "v-000002").glob("*.distcp"))
        assert shards and all(p.stat().st_size > 0 for p in shards), mode
        pipe = make_pipe(make_model(seed=8))
        opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
        assert pipe.load_checkpoint(out / "ckpt", optimizer=opt) == "v1", mode
        v1 = torch.load(out / "v1-state.pt")
        got = pipe.state_dict()
        assert got is not None
        for k, v in v1.items():
            assert torch.equal(got[k], v), (mode, k)
        assert opt.param_groups[0]["momentum"] == 0.9
        pipe.save_checkpoint(out / "ckpt", extra="v3")  # clears the dead writer's version
        assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["current", "v-000003"], mode
        assert pipe.load_checkpoint(out / "ckpt") == "v3"


def _snapshot(pipe: Pipeline, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], Any]:
    import copy

    return ({k: p.detach().clone() for k, p in pipe.named_parameters()},
            copy.deepcopy(opt.state_dict()))


def _assert_unchanged(pipe: Pipeline, opt: torch.optim.Optimizer,
                      before: tuple[dict[str, Any], Any]) -> None:
    params, opt_state = before
    for k, p in pipe.named_parameters():
        assert torch.equal(p, params[k]), k
    now = opt.state_dict()
    assert now["param_groups"] == opt_state["param_groups"]
    assert now["state"].keys() == opt_state["state"].keys()
    for i, state in now["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt_state["state"][i][key]))


def _trained(tmp_path: Path) -> tuple[Pipeline, torch.optim.Optimizer]:
    """A pipeline trained one step with Adam over two param groups, checkpointed."""
    pipe = make_pipe(make_model())
    params = dict(pipe.named_parameters())
    decay = [p for k, p in params.items() if k.endswith("weight")]
    rest = [p for k, p in params.items() if not k.endswith("weight")]
    opt = torch.optim.Adam([{"params": decay}, {"params": rest, "lr": 1e-3}], lr=1e-2)
    x, y = token_batch(0)
    pipe.step(x, y)
    opt.step()
    pipe.save_checkpoint(tmp_path / "adam", optimizer=opt, extra={"step": 1})
    return pipe, opt


def test_load_that_does_not_fit_the_optimizer_changes_nothing(tmp_path: Path) -> None:
    _trained(tmp_path)
    pipe = make_pipe(make_model(seed=4))
    params = dict(pipe.named_parameters())
    x, y = token_batch(1)
    cases: list[tuple[torch.optim.Optimizer, str]] = [
        (torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9),
         r"holds the state of a torch.optim.adam.Adam, but the optimizer given is a "
         r"torch.optim.sgd.SGD; build the same optimizer type"),
        (torch.optim.Adam(pipe.parameters(), lr=1e-2),
         r"optimizer has 2 param groups, this one has 1; build the optimizer with the same "
         r"param groups"),
        (torch.optim.Adam([{"params": [p for k, p in params.items() if k.startswith("tok")]},
                           {"params": [p for k, p in params.items() if not k.startswith("tok")]}]),
         r"groups its parameters differently \(26\): blocks.0.ln1.weight \(group 1 here, "
         r"group 0 there\);.* Build the optimizer with the same param groups, in the same order"),
    ]
    for opt, pattern in cases:
        pipe.zero_grad()
        pipe.step(x, y)
        opt.step()  # the optimizer has state of its own, to be kept
        before = _snapshot(pipe, opt)
        with pytest.raises(ValueError, match=pattern):
            pipe.load_checkpoint(tmp_path / "adam", optimizer=opt)
        _assert_unchanged(pipe, opt, before)


def test_load_of_another_model_changes_nothing(tmp_path: Path) -> None:
    small = make_pipe(make_model(dim=8))
    small.save_checkpoint(tmp_path / "small")
    pipe = make_pipe(make_model())
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    before = _snapshot(pipe, opt)
    with pytest.raises(ValueError, match="saved from a different model"):
        pipe.load_checkpoint(tmp_path / "small", optimizer=opt)
    _assert_unchanged(pipe, opt, before)


def test_adam_resume_with_two_param_groups(tmp_path: Path) -> None:
    pipe, opt = _trained(tmp_path)
    resumed = make_pipe(make_model(seed=5))
    params = dict(resumed.named_parameters())
    opt2 = torch.optim.Adam([{"params": [p for k, p in params.items() if k.endswith("weight")]},
                             {"params": [p for k, p in params.items()
                                         if not k.endswith("weight")]}], lr=0.5)
    assert resumed.load_checkpoint(tmp_path / "adam", optimizer=opt2) == {"step": 1}
    assert [g["lr"] for g in opt2.param_groups] == [1e-2, 1e-3]
    for step in (1, 2):
        x, y = token_batch(step)
        for p_ in (pipe, resumed):
            p_.zero_grad()
        assert torch.equal(resumed.step(x, y), pipe.step(x, y)), step
        opt.step()
        opt2.step()


@dataclass
class _Config:
    lr: float = 0.1


@pytest.mark.parametrize(("extra", "where", "kind"), [
    ({"loss": np.float64(1.5)}, "extra['loss']", "numpy.float64"),
    ({"rng": np.random.get_state()}, "extra['rng'][1]", "numpy.ndarray"),
    ({"out": Path("/tmp/run")}, "extra['out']", "pathlib"),
    (argparse.Namespace(lr=0.1), "extra", "argparse.Namespace"),
    ([1, _Config()], "extra[1]", "test_checkpoint._Config"),
])
def test_extra_that_cannot_load_back_is_refused_at_save(
    tmp_path: Path, extra: Any, where: str, kind: str
) -> None:
    pipe = make_pipe(make_model())
    pipe.save_checkpoint(tmp_path / "ckpt", extra="v1")
    with pytest.raises(TypeError, match=(
        re.escape(where) + r" is a [\w.]*" + re.escape(kind) + r".*cannot load back.*"
        r"convert it to plain data first"
    )):
        pipe.save_checkpoint(tmp_path / "ckpt", extra=extra)
    assert pipe.load_checkpoint(tmp_path / "ckpt") == "v1"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["current", "v-000001"]
    # Converted as the message says, it saves and loads back.
    plain = {"loss": 1.5, "rng": [np.random.get_state()[0],
                                  torch.from_numpy(np.random.get_state()[1])],
             "out": "/tmp/run", "args": vars(argparse.Namespace(lr=0.1)),
             "config": dataclasses.asdict(_Config())}
    pipe.save_checkpoint(tmp_path / "ckpt", extra=plain)
    got = pipe.load_checkpoint(tmp_path / "ckpt")
    assert got.keys() == plain.keys() and got["config"] == {"lr": 0.1}


def test_full_disk_is_named_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pipeline.checkpoint.saveload as ckpt

    pipe = make_pipe(make_model())
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    pipe.save_checkpoint(tmp_path / "ckpt", optimizer=opt, extra="v1")
    pattern = (r"no space left on the device of checkpoint '.*ckpt': this process writes "
               r"[\d.]+ MiB and [\d.]+ MiB are free. Free space or save elsewhere; the previous "
               r"checkpoint is untouched")
    # 1. A disk that fills up during the write (the OS's ENOSPC inside DCP's writer).
    with full_disk(monkeypatch), pytest.raises(OSError, match=pattern) as info:
        pipe.save_checkpoint(tmp_path / "ckpt", optimizer=opt, extra="v2")
    assert info.value.errno == errno.ENOSPC
    # 2. A disk already too full: refused before writing anything.
    monkeypatch.setattr(ckpt.shutil, "disk_usage",
                        lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 10, 10))
    with pytest.raises(OSError, match=pattern.replace("[\\d.]+ MiB are", "0.0 MiB are")):
        pipe.save_checkpoint(tmp_path / "ckpt", optimizer=opt, extra="v2")
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["current", "v-000001"]
    assert pipe.load_checkpoint(tmp_path / "ckpt", optimizer=opt) == "v1"


def test_checkpoint_path_that_is_a_file(tmp_path: Path) -> None:
    pipe = make_pipe(make_model())
    (tmp_path / "ckpt.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"'.*ckpt.pt' is a file; a checkpoint is a directory"):
        pipe.save_checkpoint(tmp_path / "ckpt.pt")


if __name__ == "__main__":
    _writer(sys.argv[1], Path(sys.argv[2]))
