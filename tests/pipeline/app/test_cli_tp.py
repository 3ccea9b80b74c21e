"""`hybridpipe plan --tensor-parallel` and `hybridpipe profile --tensor-parallel` show the
tensor-parallel plan: the ranked table's tp column with tp=1 and tp=2 layouts and why the
best won, the derived plan per parameter and per stage, in plan.json and under each stage of
the partition picture. The collectives are read from a prepared cache (no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.app.cli import main
from pipeline.planning.hardware.group_collectives import Fit, GroupCollectives
from pipeline.planning.hardware.local import CACHE_ENV, cache_file


@pytest.mark.slow
def test_plan_and_profile_show_the_tp_plan(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    fits = {k: {2: Fit(2e-4, 5e8)} for k in ("all_reduce", "all_gather", "reduce_scatter")}
    path = cache_file("collectives-v1-2")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(GroupCollectives(fits, 3e-5).to_dict()))
    assert main(["plan", "gpt", "--world-size", "4", "--tensor-parallel", "1,2",
                 "--input-shape", "2,16", "--schedules", "1f1b", "--top", "4"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:3].strip().isdigit()]
    assert {row[1] for row in rows} == {"1", "2"}, out  # the best of tp=2 kept in the table
    assert "chosen tp=" in out and "best at tp=" in out
    assert "9 all_reduce (forward)" in out  # 4 blocks x 2 and the vocab-parallel embedding
    assert main(["profile", "gpt", "--stages", "2", "--tensor-parallel", "2", "--repeats", "1",
                 "--input-shape", "2,16", "--out", str(tmp_path / "prof")]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel 2 (derived):" in out
    assert "blocks.0.attn.proj.weight: rowwise (dim 1)" in out
    assert "  stage 0: tp=2: " in out and "  stage 1: tp=2: " in out
    written = json.loads((tmp_path / "prof" / "plan.json").read_text())["tensor_parallel"]
    assert written["degree"] == 2 and len(written["stages"]) == 2
    assert written["params"]["head.weight"]["style"] == "colwise"
    assert (tmp_path / "prof" / "partition.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        main(["plan", "gpt", "--world-size", "4", "--tensor-parallel", "3"])
