"""The examples run, at tiny sizes: GPT-2 fine-tuning with validation passes (one process), a
ResNet with BatchNorm trained and evaluated (one process), and the Llama-style model built on
meta under torchrun (bf16, shard="full") checkpointing under out/ and resuming at another world
size, its metrics numbered on from the resumed step, and a rerun with nothing left to train
saying how to go on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--seq", "16", "--dim", "32", "--layers", "2", "--batch", "2"]


def _run(script: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


@pytest.mark.slow
def test_gpt2_finetuning_example_validates() -> None:
    out = _run("finetune_gpt2.py", "--steps", "4", "--eval-every", "2", "--eval-batches", "1",
               "--log-every", "2", "--batch", "4", "--seq", "16", "--layers", "2", "--dim", "32")
    assert out.count("validation loss") == 2 and "hybridpipe: step 4 | loss" in out


@pytest.mark.slow
def test_vision_example_trains_and_evaluates() -> None:
    out = _run("train_vision.py", "--steps", "2", "--eval-every", "1", "--batch", "8",
               "--size", "16")
    assert out.count("accuracy") == 2


def _torchrun(nproc: int, script: str, *args: str, cwd: Path) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--standalone", str(ROOT / "examples" / script), *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HYBRIDPIPE_TIMEOUT="60",
               LOGLEVEL="WARNING")
    run = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


@pytest.mark.slow
def test_llama_meta_example_checkpoints_and_resumes(tmp_path: Path) -> None:
    """Checkpoints go under out/; a rerun resumes at another world size and its metrics lines
    number the steps on from the resumed one; a rerun with nothing left to train says where it
    is and how to go on (--steps), rather than exiting silently."""
    out = _torchrun(4, "train_llama_meta.py", "--stages", "2", "--steps", "4", "--save-every",
                    "2", "--log-every", "2", *TINY, cwd=tmp_path)
    assert "world 4 = 2 replicas x 2 stages; starting afresh" in out
    assert "hybridpipe: step 2 | loss" in out and "tokens/s" in out
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert sorted(p.name for p in (tmp_path / "out" / "llama-checkpoint").iterdir())[-1] == (
        "v-000002")
    out = _torchrun(2, "train_llama_meta.py", "--stages", "2", "--steps", "6", "--save-every",
                    "2", "--log-every", "1", *TINY, cwd=tmp_path)
    assert "world 2 = 1 replicas x 2 stages; resumed after step 4" in out
    assert "saved at stages=2 x data_parallel=2, loaded at stages=2 x data_parallel=1" in out
    assert "step 6 done" in out
    assert "hybridpipe: step 5 | loss" in out and "hybridpipe: step 6 | loss" in out
    assert "hybridpipe: step 1 |" not in out
    out = _torchrun(2, "train_llama_meta.py", "--stages", "2", "--steps", "6", *TINY,
                    cwd=tmp_path)
    assert "resumed after step 6" in out
    assert ("nothing to train: out/llama-checkpoint is at step 6 and --steps is 6; pass "
            "--steps 12 to train on") in out
