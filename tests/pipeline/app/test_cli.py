"""The `hybridpipe` command line, called in-process through `main([...])`: its printed figures
agree with the library, it writes the promised files, and bad arguments name the choices."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import pytest

from pipeline.app.cli import main
from scheduler import SCHEDULES, build_schedule, simulate
from viz import to_chrome_trace


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
    # GPipe, p=3, m=5, F=B=W=1 (unsplit B costs B+W=2): step 3(m+p-1) = 21, bubble
    # (p-1)/(m+p-1) = 2/7 = 28.6%, every rank holds all m=5 activations.
    assert out.splitlines() == [
        "3 ranks, 5 microbatches; costs per rank: forward 1.0, backward 1.0, weight 1.0, comm 0.0",
        "schedule            v  stages  step time   bubble  peak mem  peak in-flight per rank",
        "-" * 84,
        "gpipe               1       3         21    28.6%         5  5 5 5",
        "peak mem: most activations one rank holds, in microbatches of its model share",
        "peak in-flight: most (stage, microbatch) activations each rank holds",
        "(add --out DIR to write timelines, memory plots and Chrome traces)",
    ]


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; fails unless the file is a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    width, height = struct.unpack(">II", data[16:24])
    return width, height


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
    names = ["1f1b", "zb-h1"]
    timelines = {
        name: simulate(build_schedule(name, 2, 4), 1.0, 1.0, 1.0, 0.25, activation=1.0)
        for name in names
    }
    fast, slow = timelines["zb-h1"].step_time, timelines["1f1b"].step_time
    assert fast < slow
    lines = out.splitlines()
    assert f"fastest: zb-h1, {slow / fast:.2f}x faster than the slowest (1f1b)" in lines
    assert (
        lines[-1] == f"wrote 10 files to {tmp_path}/ (open trace_*.json in https://ui.perfetto.dev)"
    )
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted(
        [f"{stem}_{n}.png" for stem in ("timeline", "memory") for n in names]
        + [f"trace_{n}.json" for n in names]
        + [f"schedule_{n}.txt" for n in names]
        + ["comparison.png", "summary.json"]
    )
    for name in names:
        for stem in ("timeline", "memory"):
            width, height = _png_size(tmp_path / f"{stem}_{name}.png")
            assert width >= 300 and height >= 150, (stem, name, width, height)
        schedule = build_schedule(name, 2, 4)
        assert (tmp_path / f"schedule_{name}.txt").read_text() == schedule.to_text() + "\n"
        trace = json.loads((tmp_path / f"trace_{name}.json").read_text())
        assert trace == json.loads(json.dumps(to_chrome_trace(timelines[name])))
    assert min(_png_size(tmp_path / "comparison.png")) >= 150
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == {
        "ranks": 2,
        "microbatches": 4,
        "costs": {"forward": 1.0, "backward": 1.0, "weight": 1.0, "comm": 0.25},
        "schedules": [
            {
                "name": name,
                "virtual_stages": 1,
                "step_time": timelines[name].step_time,
                "bubble_fraction": timelines[name].bubble_fraction,
                "peak_inflight": list(timelines[name].peak_inflight),
                "peak_memory": list(timelines[name].peak_memory),
            }
            for name in names
        ],
    }


@pytest.mark.slow
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
    assert [s["name"] for s in summary["schedules"]] == sorted(SCHEDULES)
    chunks = {"interleaved-1f1b": 2, "zbv": 2, "dualpipev": 2}
    assert {s["name"]: s["virtual_stages"] for s in summary["schedules"]} == {
        name: chunks.get(name, 1) for name in SCHEDULES
    }
    work = 4 * ((1 + 2 + 0.5) + (3 + 2 + 0.5))
    for s in summary["schedules"]:
        assert s["step_time"] * (1 - s["bubble_fraction"]) * 2 == pytest.approx(work)


def error_line(err: str, command: str = "simulate") -> str:
    """The message argparse prints after the usage, without its prefix."""
    assert f"\nusage: hybridpipe {command} [-h]" in "\n" + err, err
    prefix = f"hybridpipe {command}: error: "
    (line,) = [ln for ln in err.splitlines() if ln.startswith(prefix)]
    return line[len(prefix) :]


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The error message of a refused command line."""
    return error_line(fails(capsys, *argv), argv[0])


def test_simulate_rejects_bad_arguments_naming_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    names = sorted(SCHEDULES)
    err = refused(capsys, "simulate", "--schedule", "pipedream")
    assert err.startswith("argument --schedule: invalid choice: 'pipedream' (choose from ")
    assert all(name in err for name in names)
    assert refused(capsys, "simulate", "--compare", "gpipe,zb-h9") == (
        f"argument --compare: unknown schedule(s) ['zb-h9']; choose from {', '.join(names)}, "
        "synth (comma-separated) or 'all'"
    )
    assert refused(capsys, "simulate", "--ranks", "0") == (
        "argument --ranks: expected a whole number >= 1, got 0"
    )
    assert refused(capsys, "simulate", "--microbatches", "two") == (
        "argument --microbatches: expected a whole number >= 1, got 'two'"
    )
    assert refused(capsys, "simulate", "--forward", "fast") == (
        "argument --forward: expected a number or comma-separated numbers (one per rank or "
        "one per stage), got 'fast'"
    )
    assert refused(capsys, "simulate", "--weight", "1,-2") == (
        "argument --weight: costs must be >= 0, got '1,-2'"
    )
    assert refused(capsys, "simulate", "--ranks", "2", "--forward", "1,2,3") == (
        "--forward has 3 values; 1f1b needs one number, one per rank (2) or one per stage (2)"
    )
    # A library refusal is reported the same way, with its own advice.
    assert refused(capsys, "simulate", "--schedule", "gpipe", "--virtual-stages", "2") == (
        "gpipe runs one stage per rank; got virtual_stages=2. Use virtual_stages=1, or "
        "'interleaved-1f1b' (v >= 2) / 'zbv' (always 2) for more"
    )


def test_compare_falls_back_for_single_chunk_schedules(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["simulate", "--compare", "gpipe,interleaved-1f1b", "--virtual-stages", "4"]
    assert main([*argv, "--ranks", "2", "--microbatches", "4"]) == 0
    captured = capsys.readouterr()
    # --schedule defaults to 1f1b, which also runs alongside the comparison.
    assert captured.err.splitlines() == [
        f"note: {name} cannot run 4 virtual stages per rank; simulated with 1"
        for name in ("1f1b", "gpipe")
    ]
    rows = {line.split()[0]: line.split() for line in captured.out.splitlines() if line}
    assert rows["interleaved-1f1b"][1:3] == ["4", "8"]
    assert rows["gpipe"][1:3] == rows["1f1b"][1:3] == ["1", "2"]
    # Same figures as the library gives each schedule at its own chunk count.
    for name, v in (("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 4)):
        expected = simulate(build_schedule(name, 2, 4, v), 1.0 / v, 1.0 / v, 1.0 / v)
        assert float(rows[name][3]) == pytest.approx(expected.step_time, rel=1e-3)
        assert rows[name][4] == f"{expected.bubble_fraction:.1%}"


@pytest.mark.parametrize("command", ["simulate", "profile", "demo"])
def test_every_command_has_help(capsys: pytest.CaptureFixture[str], command: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: hybridpipe {command} [-h]")
    assert "\nexamples:\n  hybridpipe " + command in out


def test_missing_command_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    err = fails(capsys)
    assert err.startswith("usage: hybridpipe [-h] {simulate,profile,plan,demo}")
    assert err.splitlines()[-1] == (
        "hybridpipe: error: the following arguments are required: {simulate,profile,plan,demo}"
    )


# ------------------------------------------------------------------------------------ profile


def test_profile_builtin_model_writes_plan_and_plot(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = run(
        capsys, "profile", "mlp", "--stages", "3", "--balance", "parameters", "--out", str(tmp_path)
    )
    plan = json.loads((tmp_path / "plan.json").read_text())
    # mlp_stack(): 8 residual blocks of 5 nodes (ln, fc1, gelu, fc2, add) + the read-out _8.
    suffix = [""] + [f"_{b}" for b in range(1, 8)]  # fx numbers repeated function nodes
    blocks = [
        [f"_{b}_ln", f"_{b}_fc1", f"gelu{suffix[b]}", f"_{b}_fc2", f"add{suffix[b]}"]
        for b in range(8)
    ]
    nodes = [n for block in blocks for n in block] + ["_8"]
    # float32 parameter bytes: ln 2*256, fc1 256*1024+1024, fc2 1024*256+256, read-out 256*257.
    ln, fc1, fc2, head = 4 * 512, 4 * 263168, 4 * 262400, 4 * 65792
    block = ln + fc1 + fc2
    # The min-max split cuts inside blocks 2 and 5, right after their fc1.
    assert plan["stages"] == [nodes[:12], nodes[12:27], nodes[27:]]
    assert plan["stage_params"] == [
        2 * block + ln + fc1,
        fc2 + 2 * block + ln + fc1,
        fc2 + 2 * block + head,
    ]
    assert plan["method"] == "parameters"
    # Each cut carries fc1's 8x1024 output and the block's 8x256 residual input, float32.
    assert plan["cut_bytes"] == [4 * 8 * (1024 + 256)] * 2
    lines = out.splitlines()
    assert lines[0] == "Plan (parameters): 3 stages"
    assert [line.split()[:4] for line in lines[2:5]] == [
        ["0", "_0_ln", "_2_fc1", "12"],
        ["1", "gelu_2", "_5_fc1", "15"],
        ["2", "gelu_5", "_8", "14"],
    ]
    assert lines[-1] == f"wrote {tmp_path / 'partition.png'} and {tmp_path / 'plan.json'}"
    assert min(_png_size(tmp_path / "partition.png")) >= 150


def test_profile_times_a_factory_model(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["profile", "pipeline.app.models:SkipNet", "--input-shape", "4,32", "--stages", "2"]
    assert main([*argv, "--repeats", "1"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0] == "Plan (profile): 2 stages"
    assert lines[-1] == "(add --out DIR to write partition.png and plan.json)"
    progress = captured.err.splitlines()
    assert progress[0] == "capturing pipeline.app.models:SkipNet on input 4x32 ..."
    assert re.fullmatch(r"captured 34 nodes in \d+\.\d s", progress[1]), progress[1]
    assert progress[2] == "profiling on cpu (1 timed runs per node) ..."
    assert re.fullmatch(r"profiled in \d+\.\d s", progress[-1]), progress[-1]
    # Two stage rows that share out all 34 nodes.
    rows = [line.split() for line in lines[2:4]]
    assert [row[0] for row in rows] == ["0", "1"]
    assert sum(int(row[3]) for row in rows) == 34


def test_profile_rejects_bad_models_and_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert refused(capsys, "profile", "bert") == (
        "unknown MODEL 'bert': give one of gpt, mlp, skip, skewed, torchvision:NAME or "
        "package.module:factory"
    )
    err = refused(capsys, "profile", "torchvision:resnet5")
    assert err.startswith("torchvision has no model 'resnet5'; did you mean resnet50, ")
    assert refused(capsys, "profile", "no_such_pkg.models:build", "--input-shape", "2,3") == (
        "cannot import 'no_such_pkg.models' for MODEL 'no_such_pkg.models:build' (No module "
        "named 'no_such_pkg'); check the module path and that it is importable from here "
        "(PYTHONPATH)"
    )
    bad_factory = "pipeline.app.models:no_such_factory"
    assert refused(capsys, "profile", bad_factory, "--input-shape", "2,3") == (
        "pipeline.app.models has no callable 'no_such_factory' for MODEL "
        "'pipeline.app.models:no_such_factory'"
    )
    assert refused(capsys, "profile", "pipeline.app.models:GPT") == (
        "--input-shape is required for MODEL 'pipeline.app.models:GPT' "
        "(e.g. --input-shape 8,3,224,224)"
    )
    assert refused(capsys, "profile", "gpt", "--balance", "fast") == (
        "argument --balance: invalid balance 'fast': choose from profile, parameters, uniform, "
        "or give comma-separated node counts per stage (e.g. 3,4,4,3)"
    )
    assert refused(capsys, "profile", "gpt", "--input-dtype", "float32") == (
        "MODEL 'gpt' takes integer token ids, not float32; drop --input-dtype or use int64"
    )
    # The partitioner's own message: the mlp graph has 41 nodes (see the test above).
    assert refused(capsys, "profile", "mlp", "--stages", "2", "--balance", "1,1") == (
        "balance [1, 1] sums to 2 but the graph has 41 nodes; the counts must sum to 41"
    )
    assert refused(capsys, "profile", "gpt", "--input-shape", "8,x") == (
        "argument --input-shape: expected comma-separated sizes such as 8,3,224,224, got '8,x'"
    )
    assert refused(capsys, "profile", "gpt", "--input-shape", "8,0") == (
        "argument --input-shape: sizes must be >= 1, got '8,0'"
    )


# --------------------------------------------------------------------------------------- plan


def test_help_does_not_import_torch() -> None:
    """`hybridpipe --help` and each command's --help answer without importing torch (the
    seconds that import takes were most of the wait)."""
    import subprocess
    import sys

    from tests.support import ROOT

    code = (
        "import sys\n"
        "from pipeline.app.cli import build_parser\n"
        "for argv in ([], ['simulate'], ['profile'], ['plan'], ['demo']):\n"
        "    try:\n"
        "        build_parser().parse_args([*argv, '--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={"PYTHONPATH": str(ROOT)}, check=True)
    assert done.stdout.splitlines()[-1] == "False", done.stdout


@pytest.mark.slow
def test_plan_writes_files_only_where_asked_and_draws_in_ms(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --json no JSON is written (autoplan.json once landed in the working directory
    unasked). With --out the pictures of the prediction (in seconds) are drawn in ms, as the
    table gives the step, not in abstract cost units."""
    import viz

    drawn: list[tuple[str, str]] = []

    def recording(plot: Any) -> Any:
        def draw(*args: Any, **kwargs: Any) -> Any:
            fig = plot(*args, **kwargs)
            drawn.append((fig.axes[-1].get_xlabel(), fig.axes[0].get_title(loc="left")))
            return fig
        return draw

    monkeypatch.setattr(viz, "plot_timeline", recording(viz.plot_timeline))
    monkeypatch.chdir(tmp_path)
    out = run(capsys, "plan", "mlp", "--world-size", "2", "--input-shape", "2,256",
              "--schedules", "1f1b", "--top", "3", "--out", "best")
    assert [p.name for p in tmp_path.iterdir()] == ["best"]  # no JSON unless --json
    assert "wrote" in out and ".json" not in out.replace("trace_1f1b.json", "")
    [(xlabel, title)] = drawn
    assert xlabel in ("time (ms)", "time (µs)", "time (s)"), xlabel
    assert re.search(r"step [\d.]+ (ms|µs|s)\b", title), title


@pytest.mark.slow
def test_documented_plan_example_shows_a_trade_off(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/cli.md's `hybridpipe plan gpt ...` line, run as written: the memory cap rules
    out plain data parallelism, so the table ranks pipeline depths and schedules that differ
    (several pp, several step times and bubbles), not twenty equal pp=1 rows; it writes the
    JSON it was asked for and nothing else."""
    from tests.support import ROOT

    docs = (ROOT / "docs" / "cli.md").read_text()
    [line] = [x for x in docs.splitlines() if x.startswith("hybridpipe plan gpt")]
    monkeypatch.chdir(tmp_path)
    out = run(capsys, *line.split()[1:])
    [header] = [r.split() for r in out.splitlines() if r.split()[:1] == ["#"]]
    pp, step, bubble = header.index("pp"), header.index("step"), header.index("bubble") - 1
    rows = [r.split() for r in out.splitlines() if r[:3].strip().isdigit()]
    assert len({r[pp] for r in rows}) >= 2, out  # pipeline depths
    assert len({r[step] for r in rows}) >= 3 and len({r[bubble] for r in rows}) >= 3, out
    assert "pp=1" not in out and all(r[pp] != "1" for r in rows), out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
