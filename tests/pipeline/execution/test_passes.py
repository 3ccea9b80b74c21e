"""A stage is prepared by the passes of pipeline.execution.passes in one order (split, tensor
parallel, activation policy, compile, precision, data parallel), listed per stage by
``pipe.describe()`` and logged once per stage; the Pipeline's settings are one frozen record,
checked once, that the planner and the executor are built with (nothing is assigned into
them from outside), and that the processes compare field by field."""

from __future__ import annotations

import ast
import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from pipeline import Pipeline
from pipeline.execution import passes
from pipeline.planning.settings import PipelineSettings, compared_settings, mismatch_message
from tests.support.models import lm_loss, make_model, token_batch

ROOT = Path(__file__).resolve().parents[3]
ORDER = ["split", "tensor parallel", "activation policy", "compile", "precision",
         "data parallel"]


def test_passes_run_in_their_order_and_are_described_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert [p.__name__ for p in passes.PASSES] == [
        "split", "tensor_parallel", "activation_policy", "compile_stage", "precision",
        "data_parallel"]
    x, y = token_batch(0, 4)
    with caplog.at_level(logging.INFO, logger="hybridpipe"):
        pipe = Pipeline(make_model(), 2, microbatches=2, loss_fn=lm_loss, balance="uniform",
                        capture_method="fx", checkpoint_activations=["offload", "none"],
                        example_input=x)
        pipe.step(x, y)
    text = pipe.describe()
    stage0, stage1 = text.split("stage 0:\n")[1].split("stage 1:\n")
    for stage in (stage0, stage1):
        assert [line.strip().split(":")[0] for line in stage.strip().splitlines()] == ORDER
    assert "activation policy: offload" in stage0 and "activation policy: none" in stage1
    assert "compile: none (eager)" in stage0 and "tensor parallel: none" in stage0
    logged = [r.getMessage() for r in caplog.records if "stage 0:\n  split" in r.getMessage()]
    assert len(logged) == 1, logged  # the runtimes are built once: logged once


def test_settings_are_one_frozen_record_given_to_planner_and_executor() -> None:
    pipe = Pipeline(make_model(), 2, microbatches=2, loss_fn=lm_loss, compile_timeout=60,
                    balance=[2, 4])
    settings = pipe.settings
    assert pipe._executor.settings is settings and pipe._setup.planner.settings is settings
    assert settings.balance == (2, 4) and settings.compile_timeout == 60.0
    assert settings.tensor_parallel == 1 and settings.tp_plan is None
    assert not settings.sequence_parallel
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.stages = 3  # type: ignore[misc]


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"tensor_parallel": 2}, ValueError, "tensor_parallel=2 .*tensor parallelism needs torchrun"),
    ({"tensor_parallel": 0}, ValueError, "tensor_parallel must be >= 1, got 0"),
    ({"tensor_parallel": "2"}, TypeError, "tensor_parallel must be an int, got '2'"),
    ({"sequence_parallel": True}, ValueError, "sequence_parallel=True .* tensor_parallel=1"),
    ({"sequence_parallel": 1}, TypeError, "sequence_parallel must be True or False"),
    ({"tp_plan": {"*.mlp.up": "colwise"}}, ValueError, "tp_plan .* tensor_parallel=1"),
    ({"tp_plan": {"*.mlp.up": "columns"}}, ValueError, r"tp_plan styles .*'columns'"),
    ({"tp_plan": ["colwise"]}, TypeError, "tp_plan must map module path globs"),
])
def test_width_settings_are_checked(kwargs: dict[str, object], error: type[Exception],
                                    match: str) -> None:
    with pytest.raises(error, match=match):
        Pipeline(make_model(), 2, **kwargs)  # type: ignore[arg-type]


def test_every_shared_field_is_compared_across_processes() -> None:
    model = make_model()
    base = PipelineSettings(2, microbatches=2)
    wider = dataclasses.replace(base, tensor_parallel=2, compile={"backend": "eager"},
                                timeout=5.0)  # a process's own timeout is not compared
    per_rank = [compared_settings(s, data_parallel=1, built=None, loss_fn=lm_loss, model=model)
                for s in (base, wider)]
    message = mismatch_message("the settings check", per_rank)
    assert message is not None
    assert "tensor_parallel: 1 on rank 0; 2 on rank 1" in message
    assert "compile: None on rank 0; {'backend': 'eager'} on rank 1" in message
    assert "fix: pass the same tensor_parallel=... to Pipeline on every process" in message
    assert "timeout" not in message


def _assigned_into(tree: ast.AST) -> list[str]:
    """`x.executor.attr = ...` / `x.planner.attr = ...` statements, and `setattr` calls on
    them."""
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        if (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr"
                and node.args):
            targets = [ast.Attribute(value=node.args[0], attr="?")]
            ast.copy_location(targets[0], node)
        for target in targets:
            if isinstance(target, ast.Attribute):
                owner = target.value
                name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if name.lstrip("_") in ("executor", "planner"):
                    found.append(f"line {node.lineno}: {ast.unparse(target)}")
    return found


def test_nothing_is_assigned_into_the_planner_or_executor_from_outside() -> None:
    outside = [ROOT / "pipeline" / "api.py",
               *sorted((ROOT / "pipeline").glob("facade/*.py")),
               *sorted((ROOT / "pipeline").glob("checkpoint/*.py")),
               *sorted((ROOT / "pipeline").glob("elastic/*.py"))]
    found = {str(p.relative_to(ROOT)): hits for p in outside
             if (hits := _assigned_into(ast.parse(p.read_text())))}
    assert found == {}


def test_describe_before_the_plan_explains() -> None:
    pipe = Pipeline(make_model(), 2, loss_fn=lm_loss, balance="uniform", capture_method="fx")
    with pytest.raises(RuntimeError, match="the plan is made from the first batch"):
        pipe.describe()
    assert torch.is_tensor(pipe.step(*token_batch(0, 4)))
    assert "stage 1:" in pipe.describe()
