"""`hybridpipe simulate` and `hybridpipe plan` with synthesised schedules: the printed figures
are the library's (`scheduler.synthesize` + `simulate`), the schedule text and pictures are
written, and bad combinations name the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.app.cli import main
from scheduler import Schedule, build_schedule, simulate, synthesize, validate


def test_simulate_synth_prints_and_draws_the_librarys_schedule(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["simulate", "--schedule", "synth", "--compare", "zb-h1,1f1b", "--ranks", "3",
                 "--microbatches", "4", "--forward", "2,2,1", "--backward", "3,2,1",
                 "--memory-limit", "4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    expected = synthesize(3, 4, [2.0, 2.0, 1.0], [3.0, 2.0, 1.0], 1.0, memory_limit=4)
    assert (tmp_path / "schedule_synth.txt").read_text() == expected.to_text() + "\n"
    timeline = simulate(expected, [2.0, 2.0, 1.0], [3.0, 2.0, 1.0], 1.0)
    row = next(line.split() for line in out.splitlines() if line.startswith("synth "))
    assert row[:4] == ["synth", "1", "3", f"{timeline.step_time:.4g}"]
    assert row[-3:] == [str(n) for n in timeline.peak_inflight]
    zb = simulate(build_schedule("zb-h1", 3, 4), [2.0, 2.0, 1.0], [3.0, 2.0, 1.0], 1.0)
    assert timeline.step_time < zb.step_time  # 24 against 26 (tests/scheduler/test_synthesize)
    for name in ("timeline_synth.png", "memory_synth.png", "trace_synth.json"):
        assert (tmp_path / name).stat().st_size > 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [s["name"] for s in summary["schedules"]] == ["synth", "zb-h1", "1f1b"]


def test_simulate_synth_defaults_and_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    # Default limit: ranks x virtual stages (here 2 x 2 chunks).
    assert main(["simulate", "--schedule", "synth", "--ranks", "2", "--microbatches", "4",
                 "--virtual-stages", "2"]) == 0
    row = next(line.split() for line in capsys.readouterr().out.splitlines()
               if line.startswith("synth "))
    assert row[1:3] == ["2", "4"] and all(int(n) <= 4 for n in row[-2:])
    with pytest.raises(SystemExit):
        main(["simulate", "--schedule", "synth", "--ranks", "2", "--virtual-stages", "2",
              "--forward", "1,2"])
    assert ("--forward has 2 values; 'synth' with 2 virtual stages per rank needs one number "
            "or one per stage (4)") in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", "--compare", "synth,zb-h9"])
    assert "choose from" in capsys.readouterr().err


def test_plan_lists_synthesised_candidates_with_their_schedule(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_json = tmp_path / "plan.json"
    assert main(["plan", "mlp", "--world-size", "2", "--input-shape", "4,256",
                 "--dp-bandwidth", "1e3", "--top", "50", "--json", str(out_json),
                 "--out", str(tmp_path / "best")]) == 0
    out = capsys.readouterr().out
    data = json.loads(out_json.read_text())
    synth = [c for c in data["candidates"] if c["schedule"] == "synth"]
    assert synth, out
    for c in synth:
        schedule = Schedule.from_text(c["actions"])
        validate(schedule)
        assert (schedule.num_ranks, schedule.num_microbatches) == (c["pp"], c["microbatches"])
    best = data["candidates"][0]
    text = (tmp_path / "best" / f"schedule_{best['schedule']}.txt").read_text()
    assert Schedule.from_text(text).num_microbatches == best["microbatches"]
    assert (tmp_path / "best" / f"timeline_{best['schedule']}.png").stat().st_size > 0
    if best["schedule"] == "synth":
        assert best["actions"] in out
