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

Split backward: B runs `torch.autograd.grad` w.r.t. the stage inputs only (graph kept), and
captures with node pre-hooks the gradient arriving where each weight's path leaves the
input-grad path; W starts from those saved gradients (`backward_input` / `backward_weight`), so
the activation-grad path is walked once. Stage outputs that do not depend on the stage inputs
(and stage 0, whose inputs need no grad) get their weight grads from a plain pass in W.
Under activation checkpointing W is one backward from the outputs restricted to the weights,
since each backward call recomputes the checkpointed forward.

Step-private leaves: for a training step each trainable parameter of a stage is swapped, in
its module, for a leaf of the step's own (``p.detach().requires_grad_()``, same storage), so
autograd's AccumulateGrad writes the weight grads there (stealing the first microbatch's
buffer, adding in place after: the hot-memory path of a plain ``loss.backward()``). When a
stage's last backward is done its leaves' grads are committed into the parameters' `.grad`
under the step's `CancelToken`; the parameters are put back at the end of the step. So once a
step is cancelled (a failure, a timeout, Ctrl-C) a worker still inside a backward writes only
into leaves nobody reads: neither the restored grads nor a retried step's. Stage inputs are
leaves of the step too; stage 0's input grads (an input with requires_grad) are returned in
`RankResult.input_grads`, and the executor applies them (`apply_input_grads`) once the whole
step succeeded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias, cast

import torch
from torch import Tensor, nn
from torch.autograd import profiler as autograd_profiler
from torch.autograd.graph import GradientEdge, Node
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

from pipeline.planning.microbatch import check_output
from scheduler import (
    Action,
    Compute,
    Event,
    Instruction,
    MessageKey,
    Op,
    Recv,
    Schedule,
    Send,
    Timeline,
    consumer_stage,
    forward_only,
    lower,
    producer,
)

LossFn: TypeAlias = Callable[[Any, Any], Tensor]


class PipelineAborted(RuntimeError):
    """Raised inside a worker when another worker failed and the step is being cancelled."""


class CancelToken:
    """Cancels one executor's workers for good (the executor makes a new token, with new
    workers' state, for the next step). Workers check it at every action boundary and while
    waiting; every gradient write happens inside `writing()`, under the token's lock, so once
    `set()` has returned no worker touches `.grad` again, even one that was still computing.
    `beat` is the time any worker last started an action (for stuck-stage detection).
    Duck-compatible with `threading.Event` (`set`, `is_set`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self.beat = time.monotonic()

    def set(self) -> None:
        """Cancel; waits for a gradient write in progress to finish."""
        with self._lock:
            self._set = True

    def is_set(self) -> bool:
        return self._set

    @contextmanager
    def writing(self, where: str) -> Iterator[None]:
        """Hold the lock for one gradient write; PipelineAborted if cancelled."""
        with self._lock:
            if self._set:
                raise PipelineAborted(f"{where} skipped: the step was cancelled")
            yield


class Transport(Protocol):
    """Moves tensors between pipeline ranks. One instance per rank (it knows its own rank).

    send(send, tensors): deliver `tensors` (the message `send.key`) to pipeline rank
        `send.peer`. Must not block for long (queue it, or post an isend).
    recv(recv) -> tensors: the message `recv.key` from pipeline rank `recv.peer`. Blocks until
        it arrives (on this rank's device, ready for its compute stream) or a timeout passes;
        then raises an error naming rank, message and timeout.

    F messages hold a stage's outputs; B messages one tensor per floating-point input of the
    producing stage, in positional order (zeros stand for a missing gradient).
    """

    def send(self, send: Send, tensors: tuple[Tensor, ...]) -> None: ...

    def recv(self, recv: Recv) -> tuple[Tensor, ...]: ...


@dataclass
class RankResult:
    """What one rank's run produced.

    `losses[m]`: the weighted loss of microbatch m (detached; only on the last stage's rank).
    `outputs[m]`: the model output of microbatch m (only on the last stage's rank; only from
    `run_forward`). `events`: the executed actions with measured perf_counter times.
    `input_grads[m]`: the gradients of stage 0's inputs that require grad, in positional
    order (only on stage 0's rank, only when some input requires grad).
    """

    events: list[Event] = field(default_factory=list)
    losses: dict[int, Tensor] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    input_grads: dict[int, tuple[Tensor | None, ...]] = field(default_factory=dict)


@dataclass
class StepResult:
    """What an executor's training step returns: the whole-batch loss (sum of the weighted
    microbatch losses, detached, 0-dim; None on processes that do not hold the last stage)
    and the measured Timeline of the step. `input_grads`: stage 0's input grads (see
    `RankResult`), applied by `Executor.run_step` once the step succeeded."""

    loss: Tensor | None
    trace: Timeline
    input_grads: dict[int, tuple[Tensor | None, ...]] = field(default_factory=dict)


def _is_float(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _name_of(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def apply_input_grads(
    inputs: Sequence[tuple[Tensor, ...]] | None,
    input_grads: Mapping[int, tuple[Tensor | None, ...]],
) -> None:
    """Backpropagate stage 0's input grads (`RankResult.input_grads`) into the caller's
    inputs, as ``loss.backward()`` on the unsplit model would. Executors call it in the
    caller's thread once the whole step succeeded, so a failed step leaves them untouched."""
    if inputs is None:  # not stage 0's rank: it has no input grads either
        return
    roots: list[Tensor] = []
    grads: list[Tensor] = []
    for m, got in input_grads.items():
        wanted = [t for t in inputs[m] if _is_float(t) and t.requires_grad]
        for t, g in zip(wanted, got, strict=True):
            if g is not None:
                roots.append(t)
                grads.append(g)
    if roots:
        torch.autograd.backward(roots, grads)


def accumulate_grads(
    params: Sequence[Tensor], grads: Sequence[Tensor | None], *, owned: bool = False
) -> None:
    """``p.grad += g`` as autograd's AccumulateGrad does; None grads are skipped. Where `.grad`
    is None it becomes a fresh copy of `g` (which may be shared with other gradients or
    expanded), or `g` itself when the caller `owned` it. A parameter listed more than once
    (a split backward's W reaches a weight both through the input-grad path and from an
    output that does not depend on the inputs) gets the sum of its gradients."""
    merged: dict[int, tuple[Tensor, Tensor]] = {}
    for p, g in zip(params, grads, strict=True):
        if g is not None:
            seen = merged.get(id(p))
            merged[id(p)] = (p, g) if seen is None else (p, seen[1] + g)
    pairs = list(merged.values())
    adds = [(p.grad, g) for p, g in pairs if p.grad is not None]
    for p, g in pairs:
        if p.grad is None:
            p.grad = g if owned else g.detach().clone(memory_format=torch.preserve_format)
    if adds:
        torch._foreach_add_([a for a, _ in adds], [g for _, g in adds])


def running_statistics(model: nn.Module) -> set[str]:
    """Names of the buffers a forward in train mode updates inside its kernels, where version
    counters do not see it: the running statistics of BatchNorm, InstanceNorm and modules
    built like them (`track_running_stats` and a `running_mean`)."""
    names: set[str] = set()
    for path, module in model.named_modules():
        if (module.training and getattr(module, "track_running_stats", False)
                and getattr(module, "running_mean", None) is not None):
            names.update(f"{path}.{name}" if path else name
                         for name, _ in module.named_buffers(recurse=False))
    return names


class _Restored:
    """Puts `buffers` back as they were when the block ends. Re-enterable: a split backward
    recomputes a checkpointed forward once per backward call (B, then W)."""

    def __init__(self, buffers: Sequence[Tensor]) -> None:
        self.buffers = list(buffers)
        self.saved: list[Tensor] = []

    def __enter__(self) -> None:
        self.saved = [b.detach().clone() for b in self.buffers]

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for b, value in zip(self.buffers, self.saved, strict=True):
                b.copy_(value)
        self.saved = []


Slot: TypeAlias = tuple[nn.Module, str, Tensor]  # (owning module, attribute name, parameter)


def parameter_slots(module: nn.Module) -> list[Slot]:
    """Where `module` holds its parameters (a parameter held twice has two slots)."""
    return [
        (owner, name, t)
        for owner in module.modules()
        for name, t in owner._parameters.items()
        if t is not None
    ]


class StepLeaves:
    """One step's private leaves of one stage: `pairs` (parameter, leaf) for the trainable
    parameters, each once. `swap_in` puts the leaves into the module's slots; `swap_out`
    puts the parameters back in the slots that still hold this step's leaves (a retried step
    may hold its own there already)."""

    def __init__(self, slots: Sequence[Slot]) -> None:
        leaves: dict[int, Tensor] = {}
        self.slots: list[tuple[nn.Module, str, Tensor, Tensor]] = []
        self.pairs: list[tuple[Tensor, Tensor]] = []
        for owner, name, p in slots:
            if not p.requires_grad:
                continue
            leaf = leaves.get(id(p))
            if leaf is None:
                leaf = leaves[id(p)] = p.detach().requires_grad_(True)
                self.pairs.append((p, leaf))
            self.slots.append((owner, name, p, leaf))
        self.leaves = [leaf for _, leaf in self.pairs]

    def swap_in(self) -> None:
        for owner, name, _, leaf in self.slots:
            owner._parameters[name] = cast(nn.Parameter, leaf)  # a plain leaf, for one step

    def swap_out(self) -> None:
        for owner, name, p, leaf in self.slots:
            if owner._parameters.get(name) is leaf:
                owner._parameters[name] = cast(nn.Parameter, p)

    def commit(self) -> None:
        """Move the leaves' grads into the parameters' `.grad` (stolen, or added)."""
        grads = [leaf.grad for _, leaf in self.pairs]
        for _, leaf in self.pairs:
            leaf.grad = None
        accumulate_grads([p for p, _ in self.pairs], grads, owned=True)


@dataclass(frozen=True, slots=True)
class _Step:
    """One lowered instruction with what a Compute reads and writes (message keys)."""

    instruction: Instruction
    reads: MessageKey | None  # the message a Compute consumes (None: stage 0's F, last B)
    writes: MessageKey | None  # the message a Compute produces for another stage
    label: str  # profiler label


@dataclass(frozen=True)
class Program:
    """One rank's lowered instructions, and after which step each stage's last backward
    (B, or W when backward is split) and its Sends are done."""

    schedule: Schedule
    steps: tuple[_Step, ...]
    stage_done: dict[int, int]  # step index -> stage


def compile_program(schedule: Schedule, rank: int) -> Program:
    """Lower `schedule` and annotate `rank`'s instructions for `RankRuntime`."""
    n = schedule.num_stages
    steps = []
    for ins in lower(schedule)[rank]:
        if isinstance(ins, Compute):
            a = ins.action
            src = producer(a, n)
            dst = consumer_stage(a.op, a.stage, n)
            steps.append(_Step(
                ins, None if src is None else (src.op, src.stage, src.microbatch),
                None if dst is None else (a.op, a.stage, a.microbatch), f"hybridpipe {a}",
            ))
        else:
            steps.append(_Step(ins, None, None, f"hybridpipe {ins}"))
    final = Op.W if schedule.splits_backward else Op.B
    last: dict[int, int] = {}
    for i, step in enumerate(steps):
        if isinstance(step.instruction, Compute) and step.instruction.action.op is final:
            last[step.instruction.action.stage] = i
    stage_done = {}
    for stage, i in last.items():
        while i + 1 < len(steps) and isinstance(steps[i + 1].instruction, Send):
            i += 1  # let the stage's last sends leave before its gradient work starts
        stage_done[i] = stage
    return Program(schedule, tuple(steps), stage_done)


class RankRuntime:
    """Runs one pipeline rank's lowered program over that rank's stage modules.

    `stages` maps stage index -> module for the stages placed on `rank` (StageModule contract:
    `forward(*inputs) -> tuple`; the last stage returns a 1-tuple holding the model output).
    Stage modules must already live on `device`; the transport delivers tensors there.

    `loss_fn(output, target)` is applied by the last stage to each microbatch and multiplied by
    that microbatch's weight (its share of the batch for mean-reduced losses), so summed grads
    equal the whole batch's. `on_stage_done(stage)` is called right after the last backward
    action (B, or W when backward is split) of each stage in a step and the sends following
    it, e.g. to start that stage's gradient all-reduce. `abort` (a `CancelToken`), once set by
    anyone, stops this rank before its next action and before any gradient write.

    The runtime keeps per-step state (stashed activations, pending weight grads, undelivered
    messages) and checks it is empty at the end of each step.
    """

    def __init__(
        self,
        rank: int,
        schedule: Schedule,
        stages: Mapping[int, nn.Module],
        transport: Transport,
        *,
        device: torch.device | str = "cpu",
        loss_fn: LossFn | None = None,
        checkpoint_activations: bool = False,
        on_stage_done: Callable[[int], None] | None = None,
        abort: CancelToken | None = None,
        statistics: Collection[str] = (),
    ) -> None:
        expected = set(schedule.stages_of(rank))
        if set(stages) != expected:
            raise ValueError(
                f"rank {rank} runs stages {sorted(expected)} in schedule {schedule.name!r} but "
                f"got modules for stages {sorted(stages)}; pass exactly this rank's stages"
            )
        self.rank = rank
        self.schedule = schedule
        self.stages = dict(stages)
        self.transport = transport
        self.device = torch.device(device)
        self.loss_fn = loss_fn
        self.checkpoint_activations = checkpoint_activations
        self.statistics = frozenset(statistics)
        self.on_stage_done = on_stage_done
        self.abort = abort
        self.last_stage = schedule.num_stages - 1
        self.program = compile_program(schedule, rank)
        self._forward_programs: dict[int, Program] = {}
        self._slots = {s: parameter_slots(m) for s, m in self.stages.items()}
        self._leaves: dict[int, StepLeaves] = {}  # this training step's leaves per stage
        # Per-step state; all empty between steps (checked by _check_buffers_empty).
        self._stash: dict[tuple[int, int], tuple[tuple[Tensor, ...], tuple[Tensor, ...]]] = {}
        self._pending_w: dict[tuple[int, int], WeightWork] = {}
        self._mail: dict[MessageKey, tuple[Tensor, ...]] = {}
        self._inputs: Sequence[tuple[Tensor, ...]] = ()
        self._targets: Sequence[Any] = ()
        self._weights: Sequence[float] = ()
        self._result = RankResult()
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
        m = self.schedule.num_microbatches
        holds_first, holds_last = 0 in self.stages, self.last_stage in self.stages
        if holds_first and (inputs is None or len(inputs) != m):
            got = "none" if inputs is None else len(inputs)
            raise ValueError(
                f"rank {self.rank} runs stage 0 and needs {m} microbatch inputs, got {got}"
            )
        if holds_last:
            if self.loss_fn is None:
                raise ValueError("a training step needs loss_fn; pass loss_fn=... to Pipeline")
            if targets is None or len(targets) != m or len(loss_weights) != m:
                raise ValueError(
                    f"rank {self.rank} runs the last stage and needs {m} targets and loss "
                    f"weights, got {None if targets is None else len(targets)} and "
                    f"{len(loss_weights)}"
                )
        self._begin(inputs or (), targets or (), loss_weights)
        try:
            with nullcontext() if self._leaves else self.step_leaves(), torch.enable_grad():
                self._run(self.program, train=True)
            self._check_buffers_empty()
            return self._result
        finally:
            self._end()

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
        self._begin(inputs or (), (), ())
        try:
            with torch.set_grad_enabled(grad):
                self._run(self.forward_program(microbatches), train=False)
            self._check_buffers_empty()
            return self._result
        finally:
            self._end()

    # -- the interpreter loop ------------------------------------------------------------------

    def _run(self, program: Program, *, train: bool) -> None:
        events = self._result.events
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

    # -- per-step bookkeeping ------------------------------------------------------------------

    def _begin(
        self,
        inputs: Sequence[tuple[Tensor, ...]],
        targets: Sequence[Any],
        weights: Sequence[float],
    ) -> None:
        self._inputs, self._targets, self._weights = inputs, targets, weights
        self._result = RankResult()

    def _end(self) -> None:
        # Drop everything a failed step may have left, so the next step starts clean.
        self._stash.clear()
        self._pending_w.clear()
        self._mail.clear()
        self._inputs, self._targets, self._weights = (), (), ()
        self.running = None

    def _check_buffers_empty(self) -> None:
        left = {
            "stashed activations": sorted(self._stash),
            "pending weight grads": sorted(self._pending_w),
            "undelivered messages": sorted(self._mail),
        }
        left = {k: v for k, v in left.items() if v}
        if left:
            raise RuntimeError(
                f"rank {self.rank} ended the step of schedule {self.schedule.name!r} with "
                f"leftovers {left}: the schedule is missing the actions that consume them"
            )

    # -- actions --------------------------------------------------------------------------------

    def _forward(self, action: Action, step: _Step, train: bool) -> None:
        stage, mb = action.stage, action.microbatch
        module = self.stages[stage]
        if step.reads is None:
            inputs = tuple(self._inputs[mb])
            if train:  # the caller's inputs get their grads once the step succeeded
                inputs = tuple(
                    t.detach().requires_grad_(True) if _is_float(t) and t.requires_grad else t
                    for t in inputs
                )
        else:
            inputs = self._mail.pop(step.reads)
            if train:
                # Leaves of this stage's graph: their .grad is what B sends upstream.
                inputs = tuple(
                    t.detach().requires_grad_(True) if _is_float(t) else t for t in inputs
                )
        # The module gets clones of the leaves, as in the unsplit model a stage's first op
        # may work in place on its input (e.g. ReLU(inplace=True)), which a leaf forbids.
        args = tuple(t.clone() if t.requires_grad and t.is_leaf else t for t in inputs)
        if train and self.checkpoint_activations:
            outputs = checkpoint(module, *args, use_reentrant=False,
                                 context_fn=lambda: (nullcontext(), self._recomputing(module)))
        else:
            outputs = module(*args)
        if not isinstance(outputs, tuple):
            raise TypeError(
                f"stage {stage} returned a {type(outputs).__name__}; stage modules must return "
                "a tuple (the last stage a 1-tuple holding the model output)"
            )
        if step.writes is None:  # the last stage
            output = outputs[0]
            check_output(output, stage)
            if not train:
                self._result.outputs[mb] = output
                return
            loss_fn = self.loss_fn
            if loss_fn is None:
                raise ValueError("a training step needs loss_fn; pass loss_fn=... to Pipeline")
            raw = loss_fn(output, self._targets[mb])
            if not isinstance(raw, Tensor) or raw.numel() != 1:
                got = (
                    f"a tensor of shape {tuple(raw.shape)}" if isinstance(raw, Tensor)
                    else f"{_short_repr(raw)} (a {type(raw).__name__})"
                )
                raise TypeError(
                    f"loss_fn {_name_of(loss_fn)} returned {got} for microbatch {mb}; it must "
                    "return a scalar tensor: a mean- or sum-reduced loss such as "
                    "nn.CrossEntropyLoss()(output, target) (check the function ends with "
                    "`return loss`)"
                )
            loss = raw * self._weights[mb]
            self._result.losses[mb] = loss.detach()
            self._stash[(stage, mb)] = (inputs, (loss.reshape(()),))
            return
        for i, t in enumerate(outputs):
            if not isinstance(t, Tensor):
                raise TypeError(
                    f"stage {stage} output {i} is a {type(t).__name__}; values crossing stage "
                    "boundaries must be tensors (cut the model elsewhere)"
                )
        if train:
            self._stash[(stage, mb)] = (inputs, outputs)
            self._mail[step.writes] = tuple(t.detach() for t in outputs)
        else:
            self._mail[step.writes] = outputs

    def _recomputing(self, module: nn.Module) -> AbstractContextManager[None]:
        """Around the recomputation of a checkpointed forward: the running statistics it
        updates again are put back, so they are updated once per microbatch, as without
        activation checkpointing."""
        return _Restored([b for name, b in module.named_buffers() if name in self.statistics])

    def _roots(
        self, step: _Step, outputs: tuple[Tensor, ...]
    ) -> tuple[list[Tensor], list[Tensor | None]]:
        """The tensors to differentiate and their incoming grads (None for the loss)."""
        if step.reads is None:  # the last stage: the loss
            return [outputs[0]], [None]
        grads = self._mail.pop(step.reads)
        floats = [t for t in outputs if _is_float(t)]
        if len(grads) != len(floats):
            raise RuntimeError(
                f"{step.instruction} got {len(grads)} output grads for {len(floats)} "
                "floating-point outputs"
            )
        pairs = [(t, g) for t, g in zip(floats, grads, strict=True) if t.requires_grad]
        return [t for t, _ in pairs], [g for _, g in pairs]

    def _send_input_grads(
        self, step: _Step, mb: int, inputs: tuple[Tensor, ...], grads: Sequence[Tensor | None]
    ) -> None:
        floats = [t for t in inputs if _is_float(t)]
        if step.writes is None:  # stage 0: the caller's inputs, applied once the step succeeded
            if any(t.requires_grad for t in floats):
                self._result.input_grads[mb] = tuple(
                    g for t, g in zip(floats, grads, strict=True) if t.requires_grad
                )
            return
        self._mail[step.writes] = tuple(
            torch.zeros_like(t) if g is None else g for t, g in zip(floats, grads, strict=True)
        )

    def _commit(self, stage: int) -> None:
        """Commit `stage`'s leaf grads into its parameters' `.grad` (the only gradient write
        of a step), under the cancel token: a cancelled step's worker raises here instead."""
        lock = self.abort.writing(f"rank {self.rank}'s gradient write") if self.abort else None
        with lock or nullcontext():
            self._leaves[stage].commit()

    def _backward(self, action: Action, step: _Step, train: bool) -> None:
        stage, mb = action.stage, action.microbatch
        inputs, outputs = self._stash.pop((stage, mb))
        roots, grads = self._roots(step, outputs)
        floats = [t for t in inputs if _is_float(t)]
        wanted = [t for t in floats if t.requires_grad]
        params = self._leaves[stage].leaves
        work = None
        if not self.schedule.splits_backward:
            if roots and (wanted or params):  # AccumulateGrad writes the step's leaves
                torch.autograd.backward(roots, grads, inputs=[*wanted, *params])
            dx: Sequence[Tensor | None] = [t.grad for t in wanted]
        else:
            dx, work = backward_input(
                roots, grads, wanted, params, save_weight_paths=not self.checkpoint_activations
            )
        by_id = {id(t): g for t, g in zip(wanted, dx, strict=True)}
        self._send_input_grads(step, mb, inputs, [by_id.get(id(t)) for t in floats])
        if work is not None:
            self._pending_w[(stage, mb)] = work

    def _weight(self, action: Action, step: _Step, train: bool) -> None:
        key = (action.stage, action.microbatch)
        if key not in self._pending_w:
            raise RuntimeError(f"{action} has no matching B before it on rank {self.rank}")
        accumulate_grads(*backward_weight(self._pending_w.pop(key)))  # into the step's leaves


# ---------------------------------------------------------------------------------------------
# Split backward (zero-bubble B and W)
# ---------------------------------------------------------------------------------------------


def _grad_node(t: Tensor) -> Node | None:
    """The autograd node gradients of `t` flow into (AccumulateGrad for a leaf)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    view_fn = t.view_as(t).grad_fn  # a leaf's AccumulateGrad is reached through a view
    return view_fn.next_functions[0][0] if view_fn is not None else None


def _ancestors(
    starts: Sequence[Node], parents: Mapping[Node, list[Node]], stop: set[Node]
) -> tuple[set[Node], set[Node]]:
    """Nodes reachable from `starts` towards the outputs, not expanding past `stop` nodes;
    returns (reached, the `stop` nodes met)."""
    reached, met = set(starts), set()
    queue = list(starts)
    while queue:
        for parent in parents.get(queue.pop(), ()):
            if parent in stop:
                met.add(parent)
            elif parent not in reached:
                reached.add(parent)
                queue.append(parent)
    return reached, met


@dataclass(eq=False)  # identity, not tensor-wise, comparison
class _WeightGroup:
    """Weights whose gradient paths meet the input-grad path at `nodes`; `grads[i]` are the
    gradients that flowed into nodes[i] during B."""

    params: list[Tensor]
    nodes: list[Node]
    grads: list[tuple[Tensor | None, ...]] = field(default_factory=list)


@dataclass
class WeightWork:
    """What B leaves for W: weight groups to finish from their saved node gradients, plus the
    outputs that do not depend on the stage inputs (their weight grads are computed whole)."""

    groups: list[_WeightGroup]
    roots: list[Tensor]
    grads: list[Tensor | None]
    params: list[Tensor]


def backward_input(
    roots: Sequence[Tensor],
    grads: Sequence[Tensor | None],
    inputs: Sequence[Tensor],
    params: Sequence[Tensor],
    *,
    save_weight_paths: bool = True,
) -> tuple[tuple[Tensor | None, ...], WeightWork]:
    """B of a split backward: the gradients of `inputs` only (graph kept for W).

    The weight grads are not computed here, but the gradient flowing into every autograd node
    where a weight's path leaves the input-grad path is captured with a node pre-hook, so W
    starts from those nodes and never re-walks the input-grad path (the idea behind
    torch.distributed.pipelining's stage_backward_input/stage_backward_weight). W then makes
    one backward call per weight group. With `save_weight_paths=False` (used under activation
    checkpointing, which recomputes the forward once per backward call) W is instead one
    backward from the outputs restricted to the weights, re-walking the input-grad path."""
    if not inputs or not save_weight_paths:
        dx: tuple[Tensor | None, ...] = tuple(None for _ in inputs)
        if inputs and roots:
            dx = torch.autograd.grad(
                list(roots), list(inputs), list(grads), retain_graph=True, allow_unused=True
            )
        return dx, WeightWork([], list(roots), list(grads), list(params))
    root_nodes = [_grad_node(r) for r in roots]
    input_nodes = [n for n in map(_grad_node, inputs) if n is not None]
    parents: dict[Node, list[Node]] = {}
    seen = {n for n in root_nodes if n is not None}
    queue = list(seen)
    while queue:
        node = queue.pop()
        for child, _ in node.next_functions:
            if child is not None:
                parents.setdefault(child, []).append(node)
                if child not in seen:
                    seen.add(child)
                    queue.append(child)
    on_input_path, _ = _ancestors(input_nodes, parents, set())
    # Outputs that do not depend on the inputs get their weight grads from a plain pass in W.
    rest = [i for i, n in enumerate(root_nodes) if n is not None and n not in on_input_path]
    linked = [i for i, n in enumerate(root_nodes) if n is not None and n in on_input_path]
    # Group weights by the input-path nodes their paths meet (weights sharing a node share a
    # group, so every meeting node is finished exactly once).
    groups: list[_WeightGroup] = []
    group_of: dict[Node, _WeightGroup] = {}
    for p in params:
        acc = _grad_node(p)
        if acc is None or acc not in seen:
            continue
        _, met = _ancestors([acc], parents, on_input_path)
        if not met:
            continue
        merged = {id(group_of[m]): group_of[m] for m in met if m in group_of}
        group = _WeightGroup([p], list(met))
        for other in merged.values():
            group.params += other.params
            group.nodes += [n for n in other.nodes if n not in group.nodes]
            groups.remove(other)
        groups.append(group)
        for m in group.nodes:
            group_of[m] = group
    handles = []
    for group in groups:
        group.grads = [() for _ in group.nodes]
        for i, node in enumerate(group.nodes):

            def save(
                grad_outputs: tuple[Tensor | None, ...], g: _WeightGroup = group, i: int = i
            ) -> None:
                g.grads[i] = grad_outputs

            handles.append(node.register_prehook(save))
    try:
        dx = tuple(None for _ in inputs)
        if linked:
            dx = torch.autograd.grad(
                [roots[i] for i in linked],
                list(inputs),
                [grads[i] for i in linked],
                retain_graph=True,
                allow_unused=True,
            )
    finally:
        for h in handles:
            h.remove()
    return dx, WeightWork(groups, [roots[i] for i in rest], [grads[i] for i in rest], list(params))


def backward_weight(work: WeightWork) -> tuple[list[Tensor], list[Tensor | None]]:
    """W of a split backward: the weight grads from what `backward_input` kept, as (params,
    grads) for the caller to accumulate."""
    params: list[Tensor] = []
    grads: list[Tensor | None] = []
    for group in work.groups:
        edges = [
            GradientEdge(n, k)
            for n, gs in zip(group.nodes, group.grads, strict=True)
            for k, g in enumerate(gs)
            if g is not None
        ]
        saved = [g for gs in group.grads for g in gs if g is not None]
        if not edges:
            continue
        # A meeting node below another one in the same group would also get gradient through
        # the upper one; pin it to what B saw, so nothing is counted twice.
        handles = [
            n.register_prehook(lambda _, gs=gs: gs)
            for n, gs in zip(group.nodes, group.grads, strict=True)
            if gs
        ]
        try:
            # Groups may share weight-only nodes; the graph is freed when `work` is dropped.
            got = torch.autograd.grad(
                edges, group.params, saved, retain_graph=True, allow_unused=True
            )
        finally:
            for h in handles:
                h.remove()
        params += group.params
        grads += got
    if work.roots and work.params:
        params += work.params
        grads += torch.autograd.grad(work.roots, work.params, work.grads, allow_unused=True)
    return params, grads


_HANDLERS: dict[Op, Callable[[RankRuntime, Action, _Step, bool], None]] = {
    Op.F: RankRuntime._forward,
    Op.B: RankRuntime._backward,
    Op.W: RankRuntime._weight,
}
