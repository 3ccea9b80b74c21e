"""Train and eval mode behind a Pipeline: each call runs in the modes the model's modules are
in, as in eager PyTorch. A torch.export capture bakes the modes into its ops (dropout, batch
norm); when the modules' modes differ from what the held stages run, every process agrees on
the switch and the stages take the code of the other modes (pipeline.planning.other_mode: captured
once, on a fake stand-in that copies no weight, when first needed, cut by the running plan;
kept for later switches), keeping their modules, parameters and buffers
(pipeline.execution.stage_code)."""

from __future__ import annotations

from torch import nn

from partitioner.inputs import modes
from pipeline.execution.executor import Executor
from pipeline.execution.stage_code import StageCode, code_of
from pipeline.facade.planning_phase import PlanningPhase
from pipeline.planning.other_mode import Shape, shapes_of, stages_in_mode
from pipeline.planning.settings import mode_setting
from pipeline.planning.shapes import pairs_for


class ModeSwitch:
    """The modes the held stages run and the stage code of each modes seen so far, for the
    running plan. `shapes`: the model's tensors' shapes, taken before any is freed."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.shapes: dict[str, Shape] = shapes_of(model)
        self._plan: object | None = None  # the plan the codes below are cut by
        self._codes: dict[tuple[bool, ...], list[StageCode]] = {}
        self.running: tuple[bool, ...] | None = None  # None: the code does not depend on it

    def follow(self, setup: PlanningPhase, executor: Executor) -> None:
        """Before a step or forward: make the held stages run the modules' current modes."""
        decision = setup.require_plan()
        if decision is not self._plan:  # a new decision runs the modes it was captured in
            self._plan, self._codes = decision, {}
            self.running = decision.captured.training
        now = modes(self.model)
        if self.running is None or now == self.running:
            return
        executor.coordination.agree("the train/eval mode switch",
                                    settings={"train/eval mode": mode_setting(self.model)})
        if self.running not in self._codes:
            self._codes[self.running] = [code_of(m) for m in decision.modules]
        if now not in self._codes:
            planner, inputs = setup.planner, decision.capture
            with executor.setting_up(), executor.precision.planning(executor.devices):
                stages = stages_in_mode(
                    self.model, self.shapes, decision.captured, decision.plan, inputs.rows,
                    inputs.call_spec, leaf_modules=planner.leaf_modules,
                    dynamic=pairs_for(inputs.rows, planner.dynamic_dims) | inputs.changed,
                )
            self._codes[now] = [code_of(m) for m in stages]
        executor.run_code(self._codes[now])
        self.running = now
