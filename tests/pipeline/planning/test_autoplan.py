"""The auto-planner: candidates ranked by the cost model's prediction, the memory cap kept,
pruning never changing the winner, Pipeline's "auto" settings, and `hybridpipe plan`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline import Pipeline
from pipeline.app.cli import main
from pipeline.app.models import mlp_stack
from pipeline.planning.autoplan import OPTIMIZER_FACTOR, _scaled, search
from pipeline.planning.costs import costs_for_stages, predict
from scheduler import build_schedule, simulate
from scheduler.simulate import summarize
from tests.support.graphs import synthetic_graph


@pytest.mark.slow
def test_candidates_are_ranked_predictions_within_the_cap() -> None:
    graph = synthetic_graph()
    free = search(graph, world_size=4, batch_size=32, profiled_batch=4, keep=1000)
    limit = sorted(c.max_memory for c in free.candidates)[len(free.candidates) // 2]
    capped = search(
        graph, world_size=4, batch_size=32, profiled_batch=4, memory_limit=limit, keep=1000
    )
    assert capped.over_memory > 0 and capped.candidates
    assert all(c.max_memory <= limit for c in capped.candidates)
    times = [c.step_time for c in capped.candidates]
    assert times == sorted(times)
    # Each figure is the one cost model's: re-predict a pipelined candidate from scratch.
    c = next(c for c in capped.candidates if c.pp > 1)
    schedule = c.built or build_schedule(c.schedule, c.pp, c.microbatches, c.virtual_stages)
    base = costs_for_stages(graph, schedule.num_stages)
    timeline = predict(schedule, _scaled(base, 32 / c.dp / c.microbatches / 4))
    assert c.pipeline_time == pytest.approx(timeline.step_time)
    assert c.bubble == pytest.approx(timeline.bubble_fraction)
    params = [0.0] * c.pp
    for s, r in enumerate(schedule.placement):
        params[r] += base.param_bytes[s]
    expected = [OPTIMIZER_FACTOR * p + a for p, a in zip(params, timeline.peak_memory, strict=True)]
    assert list(c.peak_memory) == pytest.approx(expected)


@pytest.mark.slow
def test_pruning_keeps_the_winner_and_the_cap_can_exclude_everything() -> None:
    graph = synthetic_graph()
    for limit in (None, 2.0e5):
        full = search(graph, world_size=8, batch_size=64, profiled_batch=4, keep=10_000,
                      memory_limit=limit, dp_bandwidth=1e3)
        fast = search(graph, world_size=8, batch_size=64, profiled_batch=4, keep=1,
                      memory_limit=limit, dp_bandwidth=1e3)
        assert fast.pruned > 0
        assert fast.best.step_time == full.best.step_time
    nothing = search(graph, world_size=2, batch_size=8, profiled_batch=4, memory_limit=1.0)
    with pytest.raises(ValueError, match="no configuration fits"):
        _ = nothing.best
    with pytest.raises(ValueError, match=r"pp \[3\] must divide world_size=4"):
        search(graph, world_size=4, batch_size=8, profiled_batch=4, pp=[3])


def test_summarize_matches_the_timeline() -> None:
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h2", "dualpipev"):
        s = build_schedule(name, 3, 6)
        n = s.num_stages
        f, b, w, act = ([float(k % 3 + i) for k in range(n)] for i in (1, 2, 3, 4))
        t = simulate(s, f, b, w, 0.5, activation=act)
        u = summarize(s, f, b, w, 0.5, act)
        assert (u.step_time, u.peak_memory) == (t.step_time, t.peak_memory)
        assert u.bubble_fraction == pytest.approx(t.bubble_fraction, abs=1e-15)


def test_pipeline_auto_picks_by_simulation_and_stays_exact() -> None:
    torch.manual_seed(0)
    model = mlp_stack(blocks=4, dim=8).double()
    x, y = torch.randn(16, 8, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64)
    pipe = Pipeline(model, 2, schedule="auto", microbatches="auto", loss_fn=F.mse_loss)
    loss = pipe.step(x, y)
    plan = pipe.autoplan
    assert plan is not None
    best = plan.best
    s = pipe.schedule
    assert (s.name, s.num_microbatches, s.virtual_stages) == (
        best.schedule, best.microbatches, best.virtual_stages
    )
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    expected = F.mse_loss(model(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), atol=1e-10, rtol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-10, rtol=0)
    # A fixed schedule with auto microbatches searches the microbatch count only.
    fixed = Pipeline(model, 2, schedule="1f1b", microbatches="auto", loss_fn=F.mse_loss,
                     example_input=x)
    assert fixed.schedule.name == "1f1b" and fixed.autoplan is not None
    assert {c.schedule for c in fixed.autoplan.candidates} == {"1f1b"}
    with pytest.raises(ValueError, match="memory_limit must be a number of bytes > 0"):
        Pipeline(model, 2, schedule="auto", memory_limit=-1)


def test_cli_plan_prints_the_ranked_table_and_writes_json(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out_json = tmp_path / "plan.json"
    monkeypatch.chdir(tmp_path)
    code = main(["plan", "mlp", "--world-size", "4", "--memory-limit", "64MiB",
                 "--input-shape", "4,256", "--top", "5", "--json", str(out_json)])
    assert code == 0
    assert list(tmp_path.iterdir()) == [out_json]  # the file asked for, nothing else
    out = capsys.readouterr().out
    data = json.loads(out_json.read_text())
    assert data["memory_limit"] == 64 * 2**20 and len(data["candidates"]) == 5
    rows = [line.split() for line in out.splitlines() if line[:3].strip().isdigit()]
    assert len(rows) == 5
    for row, cand in zip(rows, data["candidates"], strict=True):
        assert row[1:7] == [str(cand["tp"]), str(cand["pp"]), str(cand["dp"]), cand["schedule"],
                            str(cand["microbatches"]), str(cand["virtual_stages"])]
        assert float(row[7]) == pytest.approx(1e3 * cand["step_time"], abs=1e-3)
        assert max(cand["peak_memory"]) <= 64 * 2**20
    steps = [c["step_time"] for c in data["candidates"]]
    assert steps == sorted(steps)
    with pytest.raises(SystemExit):
        main(["plan", "mlp", "--world-size", "4", "--memory-limit", "lots"])
    assert "expected bytes such as 80GiB" in capsys.readouterr().err
