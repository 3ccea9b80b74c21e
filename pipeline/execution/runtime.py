"""The action interpreter shared by both executors: `RankRuntime` runs one pipeline rank's
lowered program (`scheduler.lower`: Compute, Send and Recv instructions) over the rank's stage
modules, moving tensors between ranks through a `Transport`, and records measured `Event`s.

Instructions (one "Roughly:" line each; pairing rules in brackets):

- Recv  Roughly: ``mail[key] = transport.recv(recv)``  [pairs with the Send of the same key]
- Send  Roughly: ``transport.send(send, mail.pop(key))``  [follows the Compute producing key]
- F     Roughly: ``x = mail.pop(reads) or microbatch; y = stage(*x); mail[writes] = y`` or, on
        the last stage, ``loss = fn(y, t) * w``
        [each F(s, m) is followed on the same rank by exactly one B(s, m)]
- B     full:  Roughly: ``backward(y, mail.pop(reads)); mail[writes] = x.grad``
        split: Roughly: ``dx = grad(y, x, dy, retain_graph=True); mail[writes] = dx``
        [when the schedule splits backward, each B(s, m) is followed by exactly one W(s, m)]
- W     Roughly: ``backward(saved node grads, inputs=stage params)`` (weight grads only)

`reads` / `writes` are message keys (op, producing stage, microbatch) from
`scheduler.producer` / `scheduler.consumer_stage`, the one place the peer rule lives. A
message between two stages on the same rank (interleaved, zbv) has no Send/Recv: the producer
leaves it in the mail and the consumer takes it.

The split backward lives in `split_backward`, the gradient writes (step-private leaves, their
commit, stage 0's input grads) in `grads`, cancellation in `cancel`, program compilation, the
`Transport` interface and the results in `program`, the checks at a stage's boundaries in
`stage_io`, and the per-step state in `step_state`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd import profiler as autograd_profiler
from torch.profiler import record_function

from partitioner.saved_bytes import SavedBytes
from pipeline.execution.activations.recompute import Recomputed, UpdatedBuffers
from pipeline.execution.cancel import CancelToken, PipelineAborted
from pipeline.execution.grads import (
    StepLeaves,
    accumulate_grads,
    is_float,
    parameter_slots,
)
from pipeline.execution.passes import PreparedStage
from pipeline.execution.precision import Precision
from pipeline.execution.program import (
    LossFn,
    Program,
    RankResult,
    Step,
    Transport,
    compile_program,
)
from pipeline.execution.split_backward import WeightWork, backward_input, backward_weight
from pipeline.execution.stage_io import (
    as_leaves,
    backward_roots,
    check_sent,
    check_stage_outputs,
    check_step_args,
    needing_grad,
    weighted_loss,
)
from pipeline.execution.step_state import StepState
from scheduler import Action, Event, Op, Recv, Schedule, Send, forward_only


class RankRuntime:
    """Runs one pipeline rank's lowered program over that rank's stage modules.

    `stages` maps stage index -> the stages placed on `rank` as the stage-preparation passes
    made them (pipeline.execution.passes: what runs each, how a training forward calls it,
    under which activation policy and autocast), or a plain module run as it is (StageModule
    contract: `forward(*inputs) -> tuple`; the last stage returns a 1-tuple holding the model
    output). Stage modules must already live on `device`; the transport delivers tensors
    there.

    `loss_fn(output, target)` is applied by the last stage to each microbatch and multiplied by
    that microbatch's weight (its share of the batch for mean-reduced losses), so summed grads
    equal the whole batch's. `on_stage_done(stage)` is called right after the last backward
    action (B, or W when backward is split) of each stage in a step and the sends following
    it, e.g. to start that stage's gradient all-reduce. `abort` (a `CancelToken`), once set by
    anyone, stops this rank before its next action and before any gradient write.

    The runtime keeps per-step state (stashed activations, pending weight grads, undelivered
    messages) and checks it is empty at the end of each step.

    `precision` (pipeline.execution.precision): the fp32 loss and the loss scale a backward
    starts from. `saved`: a `partitioner.saved_bytes.SavedBytes` counting the bytes the
    training forwards keep for their backward (off when None). A recomputing stage with a
    block under ``torch.utils.checkpoint`` (one that does not trace, or a compiled stage)
    computes its weight grads in B even when the schedule splits backward (its W is then
    empty), so its blocks are recomputed once.
    """

    def __init__(
        self,
        rank: int,
        schedule: Schedule,
        stages: Mapping[int, PreparedStage | nn.Module],
        transport: Transport,
        *,
        device: torch.device | str = "cpu",
        loss_fn: LossFn | None = None,
        on_stage_done: Callable[[int], None] | None = None,
        abort: CancelToken | None = None,
        statistics: Collection[str] = (),
        precision: Precision | None = None,
        saved: SavedBytes | None = None,
    ) -> None:
        expected = set(schedule.stages_of(rank))
        if set(stages) != expected:
            raise ValueError(
                f"rank {rank} runs stages {sorted(expected)} in schedule {schedule.name!r} but "
                f"got modules for stages {sorted(stages)}; pass exactly this rank's stages"
            )
        self.rank = rank
        self.schedule = schedule
        self.transport = transport
        self.device = torch.device(device)
        self.loss_fn = loss_fn
        self.statistics = frozenset(statistics)
        self.saved = saved  # counts what training forwards keep for the backward, if given
        self.precision = precision or Precision()
        self.on_stage_done = on_stage_done
        self.abort = abort
        self.last_stage = schedule.num_stages - 1
        self.restage(stages)
        self.program = compile_program(schedule, rank)
        self._forward_programs: dict[int, Program] = {}
        self._leaves: dict[int, StepLeaves] = {}  # this training step's leaves per stage
        self._state = StepState()  # empty between steps (checked at the end of each)
        state = self._state  # its buffers, cleared in place after every step:
        self._stash, self._mail, self._pending_w = state.stash, state.mail, state.pending_w
        self.running: Action | None = None  # the action in progress (names a stuck rank)

    def forward_program(self, microbatches: int) -> Program:
        """The lowered forward-only program for `microbatches` microbatches (cached)."""
        if microbatches not in self._forward_programs:
            self._forward_programs[microbatches] = compile_program(
                forward_only(self.schedule, microbatches), self.rank
            )
        return self._forward_programs[microbatches]

    # -- public entry points ------------------------------------------------------------------

    def run_step(
        self,
        inputs: Sequence[tuple[Tensor, ...]] | None,
        targets: Sequence[Any] | None,
        loss_weights: Sequence[float],
    ) -> RankResult:
        """Run this rank's program for one training step.

        `inputs[m]`: stage 0's positional arguments for microbatch m (needed only on the rank
        that runs stage 0; on `device`). `targets[m]`: the loss target (needed only on the last
        stage's rank). `loss_weights[m]`: the microbatch's loss weight (last stage's rank).
        """
        check_step_args(
            self.rank, self.schedule.num_microbatches, first=0 in self.stages,
            last=self.last_stage in self.stages, loss_fn=self.loss_fn, inputs=inputs,
            targets=targets, loss_weights=loss_weights,
        )
        self._state.begin(inputs or (), targets or (), loss_weights)
        try:
            with nullcontext() if self._leaves else self.step_leaves(), torch.enable_grad():
                self._run(self.program, train=True)
            self._state.check_empty(self.rank, self.schedule.name)
            return self._state.result
        finally:
            self._end()

    def rebind(self) -> None:
        """Re-read where the stage modules hold their parameters, for a step whose parameters
        were put in the modules since (FSDP2 swaps its gathered and sharded ones)."""
        self._slots = {s: parameter_slots(m) for s, m in self.stages.items()}

    @contextmanager
    def step_leaves(self) -> Iterator[None]:
        """The training step's private leaves (see the module docstring) in this rank's stage
        modules while the block runs. Executors enter it in the caller's thread around the
        step, so the parameters are back in their modules when the step returns or raises,
        even while a cancelled worker is still stuck in its backward; `run_step` enters it
        itself when the caller has not."""
        self._leaves = {st: StepLeaves(slots) for st, slots in self._slots.items()}
        try:
            for leaves in self._leaves.values():
                leaves.swap_in()
            yield
        finally:
            for leaves in self._leaves.values():
                leaves.swap_out()
            self._leaves = {}

    def run_forward(
        self, inputs: Sequence[tuple[Tensor, ...]] | None, microbatches: int, *, grad: bool
    ) -> RankResult:
        """Forward only over `microbatches` microbatches (no loss). With `grad=False` no graph
        is built; with `grad=True` tensors cross stages without detaching, so the returned
        outputs stay connected to every stage's parameters (backward then runs unpipelined)."""
        self._state.begin(inputs or (), (), ())
        try:
            with torch.set_grad_enabled(grad):
                self._run(self.forward_program(microbatches), train=False)
            self._state.check_empty(self.rank, self.schedule.name)
            return self._state.result
        finally:
            self._end()

    def restage(self, stages: Mapping[int, PreparedStage | nn.Module]) -> None:
        """(Re)build how each stage is run from `stages` (prepared anew, e.g. after its code
        changed to the other train/eval mode; pipeline.execution.stage_code)."""
        prepared = {s: m if isinstance(m, PreparedStage) else PreparedStage.of(m)
                    for s, m in stages.items()}
        self.stages = {s: p.runs for s, p in prepared.items()}
        self._runs = {  # a training forward
            s: p.training_forward(partial(self._recomputing, p.runs)) for s, p in prepared.items()
        }
        self._evaluations = {s: p.forward() for s, p in prepared.items()}  # forward only
        self._slots = {s: parameter_slots(m) for s, m in self.stages.items()}

    # -- the interpreter loop ------------------------------------------------------------------

    def _run(self, program: Program, *, train: bool) -> None:
        events = self._state.result.events
        mail, transport, abort = self._mail, self.transport, self.abort
        done, hook = program.stage_done, self.on_stage_done
        profiling = autograd_profiler._is_profiler_enabled  # a plain flag: cheap to read
        for index, step in enumerate(program.steps):
            ins = step.instruction
            try:
                if isinstance(ins, Send):
                    transport.send(ins, mail.pop(ins.key))
                elif isinstance(ins, Recv):
                    mail[ins.key] = transport.recv(ins)
                else:
                    action = ins.action
                    if abort is not None:
                        if abort.is_set():
                            raise PipelineAborted(
                                f"rank {self.rank} cancelled before {action}: the step failed"
                            )
                        abort.beat = time.monotonic()
                    handler = _HANDLERS.get(action.op)
                    if handler is None:
                        raise ValueError(f"unknown action kind {action.op!r} in {action}")
                    start = time.perf_counter()
                    self.running = action
                    if profiling:
                        with record_function(step.label):
                            handler(self, action, step, train)
                    else:
                        handler(self, action, step, train)
                    self.running = None
                    events.append(Event(self.rank, action.stage, action.op, action.microbatch,
                                        start, time.perf_counter()))
            except Exception as err:
                if not isinstance(err, PipelineAborted):
                    err.add_note(f"while running {ins} on pipeline rank {self.rank}")
                raise
            if index in done:
                self._commit(done[index])
                if hook is not None:
                    hook(done[index])

    def _end(self) -> None:
        self._state.clear()
        self.running = None

    # -- actions --------------------------------------------------------------------------------

    def _forward(self, action: Action, step: Step, train: bool) -> None:
        stage, mb = action.stage, action.microbatch
        state = self._state
        inputs = tuple(state.inputs[mb]) if step.reads is None else self._mail.pop(step.reads)
        if train:
            inputs = as_leaves(inputs, None if step.reads is None
                               else self._crossing(stage, "input_needs_grad", inputs))
        # The module gets clones of the leaves, as in the unsplit model a stage's first op
        # may work in place on its input (e.g. ReLU(inplace=True)), which a leaf forbids.
        args = tuple(t.clone() if t.requires_grad and t.is_leaf else t for t in inputs)
        run = self._runs[stage] if train else self._evaluations[stage]
        with self.saved.counting() if train and self.saved is not None else nullcontext():
            outputs = run(*args)
        outputs = check_stage_outputs(outputs, stage, last=step.writes is None)
        if step.writes is None:  # the last stage
            if not train:
                state.result.outputs[mb] = outputs[0]
                return
            loss = weighted_loss(  # in fp32 under mixed precision
                self.loss_fn, self.precision.loss_input(outputs[0]), state.targets[mb],
                state.weights[mb], mb,
            )
            state.result.losses[mb] = loss.detach()
            self._stash[(stage, mb)] = (inputs, (loss.reshape(()),))
            return
        if train:
            check_sent(outputs, self._crossing(stage, "output_needs_grad", outputs), stage)
            self._stash[(stage, mb)] = (inputs, outputs)
            self._mail[step.writes] = tuple(t.detach() for t in outputs)
        else:
            self._mail[step.writes] = outputs

    def _crossing(self, stage: int, which: str, values: Sequence[Any]) -> Sequence[bool]:
        """Per input or output of `stage` on another stage's side (`which`: the StageModule
        attribute), whether a gradient crosses it, as the plan found (partitioner.split
        needs_grad); every value when the module carries no marks (a hand-made stage)."""
        marks: Sequence[bool] = getattr(self.stages[stage], which, ())
        return marks if marks else [True] * len(values)

    def _recomputing(self, module: nn.Module) -> UpdatedBuffers:
        """For one checkpointed block of `module`: the buffers its recomputation must see as
        its forward did and put back after, so each is updated once per microbatch, as without
        activation checkpointing (the running statistics, and what the block updates)."""
        return UpdatedBuffers(module, self.statistics)

    def _commit(self, stage: int) -> None:
        """Commit `stage`'s leaf grads into its parameters' `.grad` (the only gradient write
        of a step), under the cancel token: a cancelled step's worker raises here instead."""
        lock = self.abort.writing(f"rank {self.rank}'s gradient write") if self.abort else None
        with lock or nullcontext():
            self._leaves[stage].commit()

    def _backward(self, action: Action, step: Step, train: bool) -> None:
        stage, mb = action.stage, action.microbatch
        inputs, outputs = self._stash.pop((stage, mb))
        received = None if step.reads is None else self._mail.pop(step.reads)
        roots, grads = backward_roots(step.instruction, outputs, received,
                                      self._crossing(stage, "output_needs_grad", outputs))
        if received is None:  # the loss: its backward starts from the loss scale (fp16)
            grads = [self.precision.seed(roots[0])]
        floats = [t for t in inputs if is_float(t)]
        wanted = [t for t in floats if t.requires_grad]
        params = self._leaves[stage].leaves
        work = None
        # A stage with blocks under torch.utils.checkpoint takes its weight grads in B too: the
        # checkpoint recomputes once per backward call, so a separate W would recompute the
        # blocks a second time (graph-level recompute splits: W never recomputes).
        run = self._runs[stage]
        if not self.schedule.splits_backward or (
                isinstance(run, Recomputed) and run.checkpoints):
            if roots and (wanted or params):  # AccumulateGrad writes the step's leaves
                torch.autograd.backward(roots, grads, inputs=[*wanted, *params])
            dx: Sequence[Tensor | None] = [t.grad for t in wanted]
            if self.schedule.splits_backward:
                work = WeightWork([], [], [], [])  # its W has nothing left to do
        else:
            dx, work = backward_input(roots, grads, wanted, params)
        by_id = {id(t): g for t, g in zip(wanted, dx, strict=True)}
        crossing = floats if step.writes is None else needing_grad(
            inputs, self._crossing(stage, "input_needs_grad", inputs))
        self._state.deliver_input_grads(step.writes, mb, crossing,
                                        [by_id.get(id(t)) for t in crossing])
        if work is not None:
            self._pending_w[(stage, mb)] = work

    def _weight(self, action: Action, step: Step, train: bool) -> None:
        key = (action.stage, action.microbatch)
        if key not in self._pending_w:
            raise RuntimeError(f"{action} has no matching B before it on rank {self.rank}")
        accumulate_grads(*backward_weight(self._pending_w.pop(key)))  # into the step's leaves


_HANDLERS: dict[Op, Callable[[RankRuntime, Action, Step, bool], None]] = {
    Op.F: RankRuntime._forward,
    Op.B: RankRuntime._backward,
    Op.W: RankRuntime._weight,
}
