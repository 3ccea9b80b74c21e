"""Checkpoints in one process: state_dict / load_state_dict under the original keys, clear errors
for state dicts and checkpoints that do not fit, resuming with optimizer state gives the same
losses, a meta-device model loads its weights, and a writer killed during save_checkpoint
leaves the previous checkpoint intact (killed in a child process mid-write and before the
rename). Resharding across layouts is tested in test_distributed.py.

This file is also the killed writer: ``python tests/test_checkpoint.py MODE DIR``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pipeline import Pipeline
from pipeline.models import GPT

ROOT = Path(__file__).resolve().parents[1]


def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.size(-1)), target.reshape(-1))


def make_model(seed: int = 0, dim: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    return GPT(vocab=32, dim=dim, layers=4, heads=2, max_seq=8).double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 32, (8, 6), generator=g), torch.randint(0, 32, (8, 6), generator=g)


def make_pipe(model: nn.Module, **kw: Any) -> Pipeline:
    return Pipeline(model, stages=2, schedule="1f1b", microbatches=4, loss_fn=lm_loss,
                    balance="parameters", **kw)


def test_state_dict_has_original_keys_and_loads_into_another_pipeline() -> None:
    model = make_model()
    pipe = make_pipe(model, example_input=batch(0)[0])
    sd = pipe.state_dict()
    assert sd is not None
    expected = model.state_dict()
    assert list(sd) == list(expected)
    for k, v in expected.items():
        assert torch.equal(sd[k], v), k
    other = make_pipe(make_model(seed=1), example_input=batch(0)[0])
    other.load_state_dict(sd)
    for (k, p), (k2, q) in zip(other.named_parameters(), model.named_parameters(), strict=True):
        assert k == k2 and torch.equal(p, q), k
    x, y = batch(1)
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
    small.save_checkpoint(tmp_path / "small.pt")
    pipe = make_pipe(make_model())
    with pytest.raises(ValueError, match=r"saved from a different model: .*tok.weight: "
                                         r"\(32, 8\) vs \(32, 16\)"):
        pipe.load_checkpoint(tmp_path / "small.pt")
    torch.save(make_model().state_dict(), tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="not a hybridpipe checkpoint"):
        pipe.load_checkpoint(tmp_path / "plain.pt")
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        pipe.load_checkpoint(tmp_path / "absent.pt")
    with pytest.raises(ValueError, match="has no optimizer state"):
        small.load_checkpoint(tmp_path / "small.pt",
                              optimizer=torch.optim.SGD(small.parameters(), lr=0.1))


def test_resume_with_adam_gives_the_same_losses(tmp_path: Path) -> None:
    pipe = make_pipe(make_model())
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    losses = []
    for step in range(6):
        if step == 3:
            pipe.save_checkpoint(tmp_path / "ckpt.pt", optimizer=opt, extra={"step": step})
        x, y = batch(step)
        pipe.zero_grad()
        losses.append(pipe.step(x, y))
        opt.step()
    resumed = make_pipe(make_model(seed=5))
    opt2 = torch.optim.Adam(resumed.parameters(), lr=1.0)
    assert resumed.load_checkpoint(tmp_path / "ckpt.pt", optimizer=opt2) == {"step": 3}
    assert opt2.param_groups[0]["lr"] == 1e-2
    for step in range(3, 6):
        x, y = batch(step)
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
    x, y = batch(0)
    torch.testing.assert_close(pipe.step(x, y), lm_loss(reference(x), y), atol=1e-10, rtol=0)


def _writer(mode: str, out: Path) -> None:
    """Save v1, change the weights, then die (SIGKILL) while saving v2."""
    import pipeline.checkpoint as ckpt

    torch.set_num_threads(1)
    pipe = make_pipe(make_model())
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    pipe.save_checkpoint(out / "ckpt.pt", optimizer=opt, extra="v1")
    torch.save(pipe.state_dict(), out / "v1-state.pt")
    with torch.no_grad():
        for p in pipe.parameters():
            p.add_(1.0)

    def die(*args: object, **kw: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if mode == "mid-write":
        real_save = torch.save

        def half_save(obj: object, f: Any, *args: object, **kw: object) -> None:
            import io

            buf = io.BytesIO()
            real_save(obj, buf)
            f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            f.flush()
            die()

        ckpt.torch.save = half_save
    else:  # the new file is complete and synced, the rename has not happened
        ckpt.os.replace = die
    pipe.save_checkpoint(out / "ckpt.pt", optimizer=opt, extra="v2")
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
        leftovers = [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
        assert len(leftovers) == 1, (mode, sorted(p.name for p in out.iterdir()))
        pipe = make_pipe(make_model(seed=8))
        opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
        assert pipe.load_checkpoint(out / "ckpt.pt", optimizer=opt) == "v1", mode
        v1 = torch.load(out / "v1-state.pt")
        got = pipe.state_dict()
        assert got is not None
        for k, v in v1.items():
            assert torch.equal(got[k], v), (mode, k)
        assert opt.param_groups[0]["momentum"] == 0.9
        pipe.save_checkpoint(out / "ckpt.pt", extra="v3")  # clears the dead writer's temp file
        assert sorted(p.name for p in out.iterdir()) == ["ckpt.pt", "v1-state.pt"], mode


if __name__ == "__main__":
    _writer(sys.argv[1], Path(sys.argv[2]))
