"""Synthesised schedules in a Pipeline: both executors run them as they run any schedule,
transparently (float64 loss and every gradient equal to the unsplit model) on an uneven model
(a GPT whose embedding and head outweigh its blocks); schedule="auto" puts a synthesised
schedule among its candidates and re-synthesises from measured costs once steps have run.

The distributed case is also the worker: ``python <this file> WORKER OUT``
(run by tests.support.distributed.launch, as torchrun would)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline import Pipeline
from pipeline.app.models import GPT
from scheduler import Action, Schedule, synthesize
from tests.support.models import lm_loss, token_batch

ATOL = 1e-10
VOCAB = 96  # embedding and head of 96 x 8 against blocks of dim 8: an uneven model


def uneven_gpt(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return GPT(vocab=VOCAB, dim=8, layers=3, heads=2, max_seq=8).double()


def uneven_batch(step: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(step, rows, vocab=VOCAB, seed=100)


def head_heavy(ranks: int, microbatches: int, virtual_stages: int = 1,
               memory_limit: int = 3) -> Schedule:
    """A schedule synthesised for costs whose first and last stages dominate."""
    n = ranks * virtual_stages
    f = [3.0 if s in (0, n - 1) else 1.0 for s in range(n)]
    b = [4.0 if s == n - 1 else 1.5 for s in range(n)]
    return synthesize(ranks, microbatches, f, b, 0.7, 0.1, memory_limit=memory_limit,
                      virtual_stages=virtual_stages)


def check_step(pipe: Pipeline, ref: nn.Module, step: int) -> None:
    """One step of `pipe` equals the unsplit `ref` (loss and every gradient it holds)."""
    x, y = uneven_batch(step)
    ref.zero_grad()
    expected = lm_loss(ref(x), y)
    expected.backward()
    pipe.zero_grad()
    loss = pipe.step(x, y)
    if loss is not None:
        torch.testing.assert_close(loss.double(), expected.detach(), atol=ATOL, rtol=0)
    grads = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(p.grad, grads[name].grad, atol=ATOL, rtol=0, msg=name)


def ran_in_order(pipe: Pipeline) -> bool:
    trace = pipe.trace
    assert trace is not None
    return all(
        [Action(e.stage, e.op, e.microbatch) for e in trace.for_rank(r)]
        == list(pipe.schedule.actions[r]) for r in range(pipe.schedule.num_ranks)
    )


@pytest.mark.parametrize(("ranks", "microbatches", "v", "limit"),
                         [(3, 4, 1, 3), (2, 4, 2, 4), (2, 5, 1, 1)])
def test_local_executor_runs_a_synthesised_schedule_exactly(
    ranks: int, microbatches: int, v: int, limit: int
) -> None:
    schedule = head_heavy(ranks, microbatches, v, limit)
    model = uneven_gpt()
    ref = uneven_gpt()
    pipe = Pipeline(model, ranks, schedule=schedule, loss_fn=lm_loss, balance="parameters",
                    capture_method="fx")
    for step in range(2):
        check_step(pipe, ref, step)
    assert pipe.schedule.to_text() == schedule.to_text()
    assert ran_in_order(pipe)


def test_auto_schedule_considers_synthesis_then_resynthesises_from_measured_costs() -> None:
    model, ref = uneven_gpt(), uneven_gpt()
    pipe = Pipeline(model, 2, schedule="auto", microbatches=4, loss_fn=lm_loss,
                    capture_method="fx")
    check_step(pipe, ref, 0)
    plan = pipe.autoplan
    assert plan is not None
    synthesised = [c for c in plan.candidates if c.schedule == "synth"]
    assert synthesised and all(c.built is not None for c in synthesised)
    assert pipe.schedule.name == plan.best.schedule
    # Steps 2 and 3 are measured; the re-synthesis runs after step 3 and is reported.
    for step in (1, 2):
        check_step(pipe, ref, step)
    report = pipe.resynthesized
    assert report is not None and report.predicted_after > 0
    assert report.applied == (pipe.schedule.name == "synth" and report.gain > 0.05)
    # Two more measured steps (of the new schedule if it was switched), then a forced
    # re-synthesis (any gain accepted): the next steps run it, exactly.
    for step in (3, 4):
        check_step(pipe, ref, step)
    forced = pipe.resynthesize(threshold=-1.0)
    assert forced.applied and pipe.schedule.name == "synth"
    assert pipe.schedule.splits_backward
    for step in (5, 6):
        check_step(pipe, ref, step)
        assert ran_in_order(pipe)


def test_autoplan_synthesis_beats_its_generators_and_stops_at_the_cap() -> None:
    """Within the byte cap the synthesised candidate is never slower than a generator of the
    same (pp, m, v=1) that fits it (its in-flight limit comes from the same bytes); past
    SYNTH_MAX_CELLS the planner says it did not search."""
    from partitioner import UnitCosts
    from pipeline.planning.autoplan import SYNTH_MAX_CELLS, search
    from tests.support.graphs import synthetic_graph

    graph = synthetic_graph()
    order = graph.order
    heavy = UnitCosts(forward=3.0, input_grad=4.0, weight_grad=1.5, activation_bytes=1000.0)
    # A heavy embedding and head.
    graph = graph.with_costs({**graph.costs, order[0]: heavy, order[-1]: heavy})
    plan = search(graph, world_size=4, pp=[4], batch_size=64, profiled_batch=4,
                  microbatches=[8, 16], virtual_stages=[1], memory_limit=5e4, keep=100)
    synth = [c for c in plan.candidates if c.schedule == "synth"]
    assert synth
    for c in synth:
        rivals = [g.step_time for g in plan.candidates if g.schedule != "synth"
                  and (g.pp, g.microbatches) == (c.pp, c.microbatches)]
        assert rivals and c.step_time <= min(rivals) + 1e-12
        assert c.max_memory <= 5e4
    big = search(graph, world_size=4, pp=[4], batch_size=1024, profiled_batch=4,
                 microbatches=[256], virtual_stages=[1])
    assert all(c.schedule != "synth" for c in big.candidates)
    assert any(f"over {SYNTH_MAX_CELLS} stage x microbatch cells" in n for n in big.notes)


def test_auto_stages_build_with_the_synthesised_schedule_itself() -> None:
    """stages="auto" (pipeline.planning.layout) hands the Pipeline the chosen candidate's settings:
    a synthesised one's Schedule (it has no generator name), which the planner adopts with
    the candidate's microbatches and chunks."""
    from pipeline.planning.autoplan import AutoPlan, Candidate
    from pipeline.planning.layout import LayoutChoice

    schedule = head_heavy(2, 4)
    best = Candidate(pp=2, dp=1, schedule="synth", microbatches=4, virtual_stages=1,
                     step_time=1.0, pipeline_time=1.0, allreduce_time=0.0, bubble=0.1,
                     peak_memory=(1.0, 1.0), built=schedule)
    plan = AutoPlan(world_size=2, batch_size=8, memory_limit=None, candidates=[best],
                    simulated=1, over_memory=0, pruned=0, seconds=0.0)
    layout = LayoutChoice.of(plan, uneven_batch(0)[0], rank=0)
    assert (layout.stages, layout.data_parallel, layout.schedule, layout.microbatches,
            layout.virtual_stages) == (2, 1, schedule, 4, 1)
    pipe = Pipeline(uneven_gpt(), layout.stages, schedule=layout.schedule,
                    microbatches=layout.microbatches, virtual_stages=layout.virtual_stages,
                    loss_fn=lm_loss, balance="parameters", capture_method="fx")
    check_step(pipe, uneven_gpt(), 0)
    assert pipe.schedule.to_text() == schedule.to_text()


def test_resynthesis_needs_measured_steps() -> None:
    pipe = Pipeline(uneven_gpt(), 2, schedule="auto", microbatches=4, loss_fn=lm_loss,
                    capture_method="fx", example_input=uneven_batch(0)[0])
    with pytest.raises(ValueError, match="run at least two steps first"):
        pipe.resynthesize()


# ---------------------------------------------------------------------------------------------
# Distributed: 2 processes (gloo), launched as torchrun does.
# ---------------------------------------------------------------------------------------------


def worker_synth(out: Path) -> None:
    """pp=2 with a synthesised one-chunk and a synthesised V (two-chunk) schedule, and
    schedule="auto" (planned on rank 0, synthesised candidates included), 3 steps each,
    against the unsplit model on every process."""
    import torch.distributed as dist

    from pipeline.checkpoint import gather_named

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for v, limit in ((1, 2), (2, 4), (0, 0)):
        ref = uneven_gpt()
        if v:
            schedule = head_heavy(2, 4, v, limit)
            pipe = Pipeline(uneven_gpt(), 2, schedule=schedule, loss_fn=lm_loss,
                            balance="parameters", capture_method="fx")
            assert pipe.schedule.to_text() == schedule.to_text()
        else:  # "auto": rank 0 plans (synthesised candidates among them), every rank follows
            pipe = Pipeline(uneven_gpt(), 2, schedule="auto", microbatches=4, loss_fn=lm_loss,
                            capture_method="fx")
        for step in range(3):
            x, y = uneven_batch(step)
            ref.zero_grad()
            expected = lm_loss(ref(x), y)
            expected.backward()
            pipe.zero_grad()
            loss = pipe.step(x, y)
            torch.testing.assert_close(loss.double(), expected.detach(), atol=ATOL, rtol=0)
            grads = gather_named({k: p.grad for k, p in pipe.named_parameters()},
                                 pipe.distributed)
            if grads is not None:
                params = dict(ref.named_parameters())
                assert sorted(grads) == sorted(params)
                for k, g in grads.items():
                    torch.testing.assert_close(g, params[k].grad, atol=ATOL, rtol=0, msg=k)
        if not v and pipe.autoplan is not None:
            assert any(c.schedule == "synth" for c in pipe.autoplan.candidates)
            assert pipe.schedule.name == pipe.autoplan.best.schedule
    dist.destroy_process_group()
    print("worker synth: every check ran")


@pytest.mark.slow
def test_distributed_executor_runs_synthesised_schedules_exactly(tmp_path: Path) -> None:
    from tests.support.distributed import all_ok, launch

    all_ok(launch("synth", 2, tmp_path, script=__file__), "synth")


if __name__ == "__main__":
    {"synth": worker_synth}[sys.argv[1]](Path(sys.argv[2]))
