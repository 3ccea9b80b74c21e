"""The `hybridpipe` command line, called in-process through `main([...])`: its printed figures
agree with the library, it writes the promised files, and bad arguments name the choices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.cli import main
from scheduler import SCHEDULES, build_schedule, simulate


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def fails(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run a command that must be refused; return its error output."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


# ----------------------------------------------------------------------------------- simulate


def test_simulate_prints_the_simulators_figures(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(capsys, "simulate", "--schedule", "gpipe", "--ranks", "3", "--microbatches", "5")
    expected = simulate(build_schedule("gpipe", 3, 5), 1.0, 1.0, 1.0)
    (row,) = [line for line in out.splitlines() if line.startswith("gpipe ")]
    cells = row.split()
    assert cells[:3] == ["gpipe", "1", "3"]
    assert float(cells[3]) == pytest.approx(expected.step_time, rel=1e-3)
    assert cells[4] == f"{expected.bubble_fraction:.1%}"
    assert cells[6:] == [str(n) for n in expected.peak_inflight]
    assert "--out DIR" in out  # says how to get the pictures


def test_simulate_compare_writes_pictures_traces_and_summary(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = run(
        capsys,
        "simulate",
        "--schedule", "1f1b",
        "--compare", "zb-h1,1f1b",
        "--ranks", "2",
        "--microbatches", "4",
        "--comm", "0.25",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert "fastest: zb-h1" in out
    names = ["1f1b", "zb-h1"]
    for name in names:
        for stem, suffix in (("timeline", ".png"), ("memory", ".png"), ("trace", ".json")):
            assert (tmp_path / f"{stem}_{name}{suffix}").stat().st_size > 0
        schedule = build_schedule(name, 2, 4)
        assert (tmp_path / f"schedule_{name}.txt").read_text().strip() == schedule.to_text()
        trace = json.loads((tmp_path / f"trace_{name}.json").read_text())
        complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        assert len(complete) == sum(len(acts) for acts in schedule.actions)
    assert (tmp_path / "comparison.png").read_bytes().startswith(b"\x89PNG")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [s["name"] for s in summary["schedules"]] == names
    for entry in summary["schedules"]:
        expected = simulate(build_schedule(entry["name"], 2, 4), 1.0, 1.0, 1.0, 0.25)
        assert entry["step_time"] == pytest.approx(expected.step_time)
        assert entry["bubble_fraction"] == pytest.approx(expected.bubble_fraction)


def test_virtual_stages_share_a_ranks_cost(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """With v chunks per rank each chunk costs 1/v of the rank's share, so every schedule does
    the same work: busy time = ranks x microbatches x (forward + backward + weight)."""
    run(
        capsys,
        "simulate",
        "--compare", "all",
        "--ranks", "2",
        "--microbatches", "4",
        "--forward", "1,3",
        "--backward", "2",
        "--weight", "0.5",
        "--out", str(tmp_path),
    )  # fmt: skip
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {s["name"] for s in summary["schedules"]} == set(SCHEDULES)
    assert {s["virtual_stages"] for s in summary["schedules"]} == {1, 2}
    work = 4 * ((1 + 2 + 0.5) + (3 + 2 + 0.5))
    for s in summary["schedules"]:
        assert s["step_time"] * (1 - s["bubble_fraction"]) * 2 == pytest.approx(work)


def test_simulate_rejects_bad_arguments_naming_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = fails(capsys, "simulate", "--schedule", "pipedream")
    assert "'pipedream'" in err and all(name in err for name in SCHEDULES)
    err = fails(capsys, "simulate", "--compare", "gpipe,zb-h9")
    assert "zb-h9" in err and "zbv" in err and "'all'" in err
    err = fails(capsys, "simulate", "--ranks", "0")
    assert "--ranks" in err and ">= 1" in err
    err = fails(capsys, "simulate", "--forward", "fast")
    assert "--forward" in err and "'fast'" in err
    err = fails(capsys, "simulate", "--ranks", "2", "--forward", "1,2,3")
    assert "--forward has 3 values" in err and "one per rank (2)" in err
    # A library refusal is reported the same way, with its own advice.
    err = fails(capsys, "simulate", "--schedule", "gpipe", "--virtual-stages", "2")
    assert "virtual_stages=2" in err and "interleaved-1f1b" in err


def test_compare_falls_back_for_single_chunk_schedules(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["simulate", "--compare", "gpipe,interleaved-1f1b", "--virtual-stages", "4"]
    assert main([*argv, "--ranks", "2", "--microbatches", "4"]) == 0
    captured = capsys.readouterr()
    assert "gpipe cannot run 4 virtual stages per rank; simulated with 1" in captured.err
    rows = {line.split()[0]: line.split() for line in captured.out.splitlines() if line}
    assert rows["interleaved-1f1b"][1:3] == ["4", "8"]
    assert rows["gpipe"][1:3] == ["1", "2"]


@pytest.mark.parametrize("command", ["simulate", "profile"])
def test_every_command_has_help(capsys: pytest.CaptureFixture[str], command: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: hybridpipe {command}" in out and "examples:" in out


def test_missing_command_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    err = fails(capsys)
    assert "simulate" in err and "profile" in err


# ------------------------------------------------------------------------------------ profile


def test_profile_builtin_model_writes_plan_and_plot(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = run(
        capsys, "profile", "mlp", "--stages", "3", "--balance", "parameters", "--out", str(tmp_path)
    )
    assert "Plan (parameters): 3 stages" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["method"] == "parameters" and len(plan["stages"]) == 3
    # mlp_stack(): 8 residual blocks of 4 nodes each (ln, fc1, gelu, fc2 and the add) + read-out.
    assert sum(len(stage) for stage in plan["stages"]) > 8
    assert (tmp_path / "partition.png").read_bytes().startswith(b"\x89PNG")


def test_profile_times_a_factory_model(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["profile", "pipeline.models:SkipNet", "--input-shape", "4,32", "--stages", "2"]
    assert main([*argv, "--repeats", "1"]) == 0
    captured = capsys.readouterr()
    assert "Plan (profile): 2 stages" in captured.out
    assert "profiling on cpu" in captured.err and "captured" in captured.err  # progress


def test_profile_rejects_bad_models_and_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    err = fails(capsys, "profile", "bert")
    assert "'bert'" in err and "gpt, mlp, skip, skewed" in err and "torchvision:NAME" in err
    err = fails(capsys, "profile", "torchvision:resnet5")
    assert "no model 'resnet5'" in err and "resnet50" in err
    err = fails(capsys, "profile", "no_such_pkg.models:build", "--input-shape", "2,3")
    assert "cannot import 'no_such_pkg.models'" in err
    err = fails(capsys, "profile", "pipeline.models:GPT")
    assert "--input-shape is required" in err
    err = fails(capsys, "profile", "gpt", "--balance", "fast")
    assert "'fast'" in err and "profile, parameters, uniform" in err
    err = fails(capsys, "profile", "gpt", "--input-dtype", "float32")
    assert "integer token ids" in err
    err = fails(capsys, "profile", "mlp", "--stages", "2", "--balance", "1,1")
    assert "balance [1, 1] sums to 2" in err  # the partitioner's own message
    err = fails(capsys, "profile", "gpt", "--input-shape", "8,x")
    assert "'8,x'" in err
