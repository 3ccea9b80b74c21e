"""A real fault: two torchrun agents on loopback (``--nnodes 1:2``, c10d rendezvous, 2 processes
each: pp=2 x dp=2) train examples/train_hybrid.py in float64 with asynchronous periodic
checkpoints; one agent and its workers are killed (SIGKILL) mid-training, as a lost machine.
The surviving agent restarts its workers (``--max-restarts``), which re-plan for a world of 2
(pp=2 x dp=1, twice the microbatches per replica), resume from the last checkpoint and finish;
every step's loss equals the uninterrupted run's (the unsplit model trained on the same global
batches, 1e-9). The time from the kill to
the first resumed step is printed (``-s`` shows it).

The test hosts the rendezvous store itself (both agents join it with ``is_host=0``), as a
cluster's etcd or the job's launcher would: the agent killed could otherwise be the one holding
it. Every wait is bounded; a process left at the end is killed and fails the test."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import ROOT

STEPS, EVERY = 10, 2  # killed after step 5: 5 more steps (2.5 s) before it could end
ARGS = ["--stages", "2", "--steps", str(STEPS), "--save-every", str(EVERY), "--keep", "2",
        "--async-save", "--global-batch", "8", "--microbatch-size", "2", "--seq", "16",
        "--dim", "32", "--layers", "2", "--dtype", "float64"]


def _env() -> dict[str, str]:
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: each restart's workers get a fresh store of their own
    # (hosted by their rank 0), not the long-lived rendezvous store, where the keys of the
    # previous attempt's process groups (the dead workers' addresses) would still be found.
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HYBRIDPIPE_TIMEOUT="10",
                LOGLEVEL="WARNING", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def _agent(port: int, out: Path, name: str, extra: list[str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
           "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "fault",
           # A dead agent is dropped from the rendezvous after 2 s without a heartbeat (torch's
           # default: 5 s, checked every 5 s).
           "--rdzv-conf",
           "is_host=0,join_timeout=60,last_call_timeout=3,heartbeat=2,keep_alive_interval=1",
           "--max-restarts", "3", "--monitor-interval", "0.5",
           str(ROOT / "examples" / "train_hybrid.py"), *ARGS, *extra]
    log = open(out / f"{name}.log", "w")  # noqa: SIM115 - the child holds it
    return subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            start_new_session=True)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL an agent and every process below it (its workers run in their own sessions)."""
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _records(path: Path) -> list[dict[str, float]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _losses(path: Path) -> list[dict[str, float]]:
    return [r for r in _records(path) if "step" in r]


def _reference_losses() -> dict[int, float]:
    """The uninterrupted run: the unsplit model on each step's global batch (the pipeline equals
    it in float64; tests/pipeline/facade/test_transparency.py), as examples/train_hybrid.py sets
    it up."""
    import torch
    from torch.nn import functional as F

    from pipeline.app.models import GPT
    from pipeline.app.textdata import TokenBatches, stdlib_corpus

    torch.manual_seed(0)
    model = GPT(vocab=256, dim=32, layers=2, heads=4, max_seq=16).to(torch.float64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = TokenBatches(stdlib_corpus(), 8, 16, seed=0)
    losses = {}
    for step in range(STEPS):
        x, y = data.at(step)
        optimizer.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        optimizer.step()
        losses[step] = float(loss.detach())
    return losses


def _wait(proc: subprocess.Popen[bytes], deadline: float, what: str, out: Path) -> None:
    try:
        proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        logs = "\n".join(p.read_text()[-3000:] for p in sorted(out.glob("*.log")))
        pytest.fail(f"{what} did not end in time\n{logs}")


@pytest.mark.slow
def test_losing_an_agent_resumes_on_the_survivor(tmp_path: Path) -> None:
    import torch.distributed as dist

    reference = _reference_losses()
    store = dist.TCPStore("127.0.0.1", 0, None, True,
                          timeout=datetime.timedelta(seconds=120), wait_for_workers=False)
    losses = tmp_path / "run.jsonl"
    extra = ["--checkpoint", str(tmp_path / "ckpt"), "--losses", str(losses),
             "--step-delay", "0.5"]
    a = _agent(store.port, tmp_path, "agent-a", extra)
    b = _agent(store.port, tmp_path, "agent-b", extra)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # mid-training, after a checkpoint
            done = _losses(losses)
            if len(done) >= 5:
                break
            if a.poll() is not None or b.poll() is not None:
                pytest.fail("an agent ended before the kill: " + (tmp_path / "agent-a.log")
                            .read_text()[-3000:] + (tmp_path / "agent-b.log").read_text()[-3000:])
            time.sleep(0.2)
        else:
            pytest.fail("training did not reach step 5 within 180 s")
        assert {r["data_parallel"] for r in done} == {2}, done
        killed_at = time.time()
        _kill_tree(b)
        _wait(a, time.monotonic() + 150, "the surviving agent", tmp_path)
    finally:
        _kill_tree(a)
        _kill_tree(b)
    runs = _losses(losses)
    after = [r for r in runs if r["time"] > killed_at]
    log = (tmp_path / "agent-a.log").read_text()
    assert a.returncode == 0, log[-4000:]
    assert "connectFullMesh failed" not in log, log[-4000:]  # the first restart came up
    assert after and {r["data_parallel"] for r in after} == {1}, runs
    # Resumed from the last live checkpoint (one save may still have been in flight).
    first = int(after[0]["step"])
    before = [int(r["step"]) for r in runs if r["time"] <= killed_at]
    assert max(before) + 1 - 2 * EVERY < first <= max(before) + 1, (before, first)
    assert [int(r["step"]) for r in after] == list(range(first, STEPS))
    for r in runs:
        assert abs(r["loss"] - reference[int(r["step"])]) < 1e-9, (r, reference[int(r["step"])])
    start = [r for r in _records(losses) if r.get("event") == "start" and r["time"] > killed_at]
    # One restart: the survivor's workers came up once and ended cleanly.
    assert len(start) == 1 and start[0]["resumed"] == first, start
    print(f"\nkill -> first resumed step: {after[0]['time'] - killed_at:.1f} s (the new workers "
          f"started {start[0]['started'] - killed_at:.1f} s after the kill, had planned and "
          f"resumed at {start[0]['time'] - killed_at:.1f} s; resumed at step {first}; steps "
          f"done before the kill: {max(before) + 1})")
