"""The demo end to end at a tiny size: every promised file is written and the figures are sane."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from pipeline.app import demo
from pipeline.app.cli import main
from pipeline.app.demo import DemoConfig, run_demo
from pipeline.app.textdata import TokenBatches, stdlib_corpus

EXPECTED = {
    "loss.png",
    "memory.png",
    "partition.png",
    "predicted_vs_measured.png",
    "report.md",
    "schedules.png",
    "summary.json",
    "timeline_measured.png",
    "trace.json",
}


@pytest.mark.slow  # 12 steps of training, calibration and 9 files: ~4 s
def test_demo_writes_every_file_and_loss_falls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cost-model check on 4 steps per schedule, not 20: it runs the same code (and writes
    # the same tables); its error figures, which need the 20, are not asserted here.
    monkeypatch.setattr(demo, "CHECK_STEPS", 4)
    config = DemoConfig(steps=12, dim=32, layers=2, heads=2, seq_len=16, batch_size=8, lr=1e-2)
    summary = run_demo(tmp_path, config)
    assert EXPECTED <= {p.name for p in tmp_path.iterdir()}
    assert summary["loss_last"] < summary["loss_first"]
    assert summary["predicted_step_time_s"] > 0 and summary["trace_step_time_s"] > 0
    assert 1 <= summary["trace_steps"] < config.steps  # the steps it was calibrated on
    trace = json.loads((tmp_path / "trace.json").read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    # 2 ranks x 4 microbatches x (F, B) under 1f1b
    assert len(complete) == 2 * 4 * 2
    report = (tmp_path / "report.md").read_text()
    assert "Plan (profile)" in report and "zbv" in report
    # Every schedule's predicted vs measured (with the error), and the plan table.
    assert report.count("%") >= 2 * 7 and "dualpipev" in report
    assert "## Plan for 8 devices" in report and summary["worst_calibrated_error"] >= 0


def test_demo_cli_runs_a_one_step_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The command's own path at the tiny size (the default model's cost checks take ~30 s):
    # the flags must reach the run, as the trace and the report show.
    monkeypatch.setattr(demo, "DemoConfig", functools.partial(
        DemoConfig, dim=32, layers=2, heads=2, seq_len=16, batch_size=8))
    monkeypatch.setattr(demo, "CHECK_STEPS", 2)
    argv = ["demo", "--out", str(tmp_path), "--steps", "1", "--microbatches", "2",
            "--stages", "3", "--schedule", "gpipe"]
    assert main(argv) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["loss_first"] > 0
    trace = json.loads((tmp_path / "trace.json").read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == 3 * 2 * 2  # 3 ranks x 2 microbatches x (F, B)
    assert "gpipe" in (tmp_path / "report.md").read_text()


def test_demo_cli_rejects_unknown_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--schedule", "nope"])
    assert exc.value.code == 2
    assert "1f1b" in capsys.readouterr().err


def test_token_batches_are_shifted_windows() -> None:
    corpus = stdlib_corpus(max_bytes=4096)
    x, y = TokenBatches(corpus, batch_size=3, seq_len=10, seed=1).next()
    assert x.shape == y.shape == (3, 10)
    assert (x[:, 1:] == y[:, :-1]).all()
    with pytest.raises(ValueError, match="seq_len"):
        TokenBatches(corpus[:5], batch_size=1, seq_len=10)
