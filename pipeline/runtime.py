"""The action interpreter shared by both executors: `RankRuntime` runs one rank's ordered
scheduler Actions over its stage modules, moving tensors between ranks through a `Transport`,
and records measured `Event`s. Also the microbatch split/merge helpers and the `Executor`
protocol that `Pipeline` dispatches to.

Action kinds (one "Roughly:" line each; pairing rules in brackets):

- F  Roughly: ``x = recv(F) or microbatch; y = stage(*x); send(F, y) or loss = fn(y, t) * w``
     [each F(s, m) is followed on the same rank by exactly one B(s, m)]
- B  full:  Roughly: ``backward(y, dy); send(B, x.grad)``
     split: Roughly: ``dx = grad(y, x, dy, retain_graph=True); send(B, dx)`` (input grads only)
     [when the schedule splits backward, each B(s, m) is followed by exactly one W(s, m)]
- W  Roughly: ``backward(saved node grads, inputs=stage params)`` (weight grads only)

Same-rank handoffs (stage s and s+1 on one rank, as in interleaved or zbv schedules) stay in
this object; only cross-rank tensors go through the Transport.

Split backward: B runs `torch.autograd.grad` w.r.t. the stage inputs only (graph kept), and
captures with node pre-hooks the gradient arriving where each weight's path leaves the
input-grad path; W starts from those saved gradients (`backward_input` / `backward_weight`), so
the activation-grad path is walked once. Stage outputs that do not depend on the stage inputs
(and stage 0, whose inputs need no grad) get their weight grads from a plain pass in W.
Under activation checkpointing W is one backward from the outputs restricted to the weights,
since each backward call recomputes the checkpointed forward.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, Node
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

from scheduler import Action, Event, Op, Schedule, Timeline

Batch: TypeAlias = Any
"""A tensor, or a tuple/list/dict (possibly nested) whose leaves are tensors."""

LossFn: TypeAlias = Callable[[Any, Any], Tensor]


class PipelineAborted(RuntimeError):
    """Raised inside a worker when another worker failed and the step is being cancelled."""


class Transport(Protocol):
    """Moves tensors between ranks. One instance per rank (it knows its own rank).

    send(op, stage, microbatch, tensors):
        op F: the outputs of `stage`, for the rank that runs stage + 1.
        op B: the input grads of `stage`, for the rank that runs stage - 1.
        Must not block for long (queue it, or post an isend).
    recv(op, stage, microbatch) -> tensors:
        op F: the inputs of `stage` (sent by stage - 1's F).
        op B: the grads of `stage`'s outputs (sent by stage + 1's B).
        Blocks until they arrive (on this rank's device, ready for its compute stream) or a
        timeout passes; then raises an error naming rank, stage, op, microbatch and the timeout.

    B payloads hold one tensor per floating-point output of `stage - 1` (= floating-point input
    of `stage`), in positional order; zeros stand for a missing gradient.
    """

    def send(self, op: Op, stage: int, microbatch: int, tensors: tuple[Tensor, ...]) -> None: ...

    def recv(self, op: Op, stage: int, microbatch: int) -> tuple[Tensor, ...]: ...


@dataclass
class RankResult:
    """What one rank's run produced.

    `losses[m]`: the weighted loss of microbatch m (detached; only on the last stage's rank).
    `outputs[m]`: the model output of microbatch m (only on the last stage's rank; only from
    `run_forward`). `events`: the executed actions with measured perf_counter times.
    """

    events: list[Event] = field(default_factory=list)
    losses: dict[int, Tensor] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)


@dataclass
class StepResult:
    """What an executor's training step returns: the whole-batch loss (sum of the weighted
    microbatch losses, detached, 0-dim; None on processes that do not hold the last stage)
    and the measured Timeline of the step."""

    loss: Tensor | None
    trace: Timeline


class Executor(Protocol):
    """What `Pipeline` dispatches to (LocalExecutor: threads in one process; the distributed
    executor: one process per rank). Inputs arrive already split into microbatches;
    `inputs[m]` is the positional-argument tuple of stage 0 for microbatch m."""

    def run_step(
        self,
        inputs: Sequence[tuple[Tensor, ...]],
        targets: Sequence[Any],
        loss_weights: Sequence[float],
    ) -> StepResult:
        """Forward and backward over all microbatches by the schedule; grads accumulate on the
        parameters. On failure, raise the first error (partial grads are the caller's to drop)."""
        ...

    def forward(self, inputs: Sequence[tuple[Tensor, ...]]) -> list[Any]:
        """Forward only; the model output per microbatch. Keeps an autograd graph only when
        grad mode is enabled in the caller."""
        ...

    def close(self) -> None:
        """Release workers, queues and process groups; idempotent."""
        ...


# ---------------------------------------------------------------------------------------------
# Microbatch helpers
# ---------------------------------------------------------------------------------------------


def _leaves(batch: Batch, what: str, path: str = "") -> list[tuple[str, Tensor]]:
    if isinstance(batch, Tensor):
        return [(path or what, batch)]
    if isinstance(batch, (tuple, list)):
        out: list[tuple[str, Tensor]] = []
        for i, item in enumerate(batch):
            out.extend(_leaves(item, what, f"{path or what}[{i}]"))
        return out
    if isinstance(batch, dict):
        out = []
        for key, item in batch.items():
            out.extend(_leaves(item, what, f"{path or what}[{key!r}]"))
        return out
    raise TypeError(f"{path or what} is a {type(batch).__name__}, not a tensor")


def batch_size(batch: Batch, what: str = "inputs") -> int:
    """The common dim-0 size of every tensor in `batch`; ValueError if they differ."""
    try:
        leaves = _leaves(batch, what)
    except TypeError as err:
        raise TypeError(
            f"{err}; {what} must be a tensor or a tuple/list/dict of tensors (split along dim 0)"
        ) from None
    if not leaves:
        raise ValueError(f"{what} holds no tensors; give at least one tensor with a batch dim")
    sizes = {}
    for name, t in leaves:
        if t.dim() == 0:
            raise ValueError(f"{name} is a 0-dim tensor; every tensor needs a batch dim (dim 0)")
        sizes[name] = t.shape[0]
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"{what} tensors have different batch sizes {sizes}; give every tensor the same dim 0"
        )
    return next(iter(sizes.values()))


def _split(batch: Batch, chunks: int) -> list[Batch]:
    if isinstance(batch, Tensor):
        return list(torch.tensor_split(batch, chunks, dim=0))
    if isinstance(batch, (tuple, list)):
        columns = [_split(item, chunks) for item in batch]
        return [type(batch)(col[i] for col in columns) for i in range(chunks)]
    columns_by_key = {key: _split(item, chunks) for key, item in batch.items()}
    return [{key: col[i] for key, col in columns_by_key.items()} for i in range(chunks)]


def split_microbatches(batch: Batch, chunks: int, what: str = "inputs") -> list[Batch]:
    """Split `batch` along dim 0 into `chunks` microbatches (sizes differ by at most one, larger
    first, as `torch.tensor_split`). Structure (tuple/list/dict) is kept in every microbatch."""
    if chunks < 1:
        raise ValueError(f"microbatches must be >= 1, got {chunks}")
    size = batch_size(batch, what)
    if size < chunks:
        raise ValueError(
            f"{what} batch size {size} is smaller than the microbatch count {chunks}; "
            f"give a batch of at least {chunks} samples or use microbatches <= {size}"
        )
    return _split(batch, chunks)


def microbatch_sizes(total: int, chunks: int) -> list[int]:
    """The sizes `split_microbatches` produces for a batch of `total` samples."""
    base, extra = divmod(total, chunks)
    return [base + 1 if i < extra else base for i in range(chunks)]


def merge_microbatches(parts: Sequence[Batch]) -> Batch:
    """Concatenate per-microbatch outputs along dim 0, keeping their tuple/list/dict structure."""
    first = parts[0]
    if isinstance(first, Tensor):
        return torch.cat(list(parts), dim=0)
    if isinstance(first, (tuple, list)):
        return type(first)(merge_microbatches([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, dict):
        return {key: merge_microbatches([p[key] for p in parts]) for key in first}
    raise TypeError(f"cannot merge outputs of type {type(first).__name__}")


def check_output(value: Any, stage: int) -> None:
    """TypeError unless `value` is a tensor or a (nested) tuple/list/dict of tensors."""
    try:
        _leaves(value, f"stage {stage} output")
    except TypeError as err:
        raise TypeError(
            f"{err}; stage {stage} is the last stage: make the model return a tensor or a "
            "tuple/dict of tensors (compute other values outside the model)"
        ) from None


def forward_actions(schedule: Schedule, rank: int, microbatches: int) -> list[Action]:
    """A forward-only action list for `rank`: its stages' F actions in (stage, microbatch) order.
    That order is a projection of one global topological order, so it cannot deadlock."""
    return [
        Action(stage, Op.F, m) for stage in schedule.stages_of(rank) for m in range(microbatches)
    ]


def _is_float(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


# ---------------------------------------------------------------------------------------------
# RankRuntime
# ---------------------------------------------------------------------------------------------


class RankRuntime:
    """Runs one rank's ordered actions of a `Schedule` over that rank's stage modules.

    `stages` maps stage index -> module for the stages placed on `rank` (StageModule contract:
    `forward(*inputs) -> tuple`; the last stage returns a 1-tuple holding the model output).
    Stage modules must already live on `device`; the transport delivers tensors there.

    `loss_fn(output, target)` is applied by the last stage to each microbatch and multiplied by
    that microbatch's weight (its share of the batch for mean-reduced losses), so summed grads
    equal the whole batch's. `on_stage_done(stage)` is called right after the last backward
    action (B, or W when backward is split) of each stage in a step, e.g. to start that stage's
    gradient all-reduce. `abort`, when set by anyone, stops this rank before its next action.

    The runtime keeps per-step state (stashed activations, pending weight grads, same-rank
    handoffs) and checks it is empty at the end of each step.
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
        abort: threading.Event | None = None,
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
        self.on_stage_done = on_stage_done
        self.abort = abort
        self.last_stage = schedule.num_stages - 1
        self._params: dict[int, list[Tensor]] = {}  # trainable parameters, read each step
        self._done_after = self._last_backward_index(schedule.actions[rank])
        # Per-step state; all empty between steps (checked by _check_buffers_empty).
        self._stash: dict[tuple[int, int], tuple[tuple[Tensor, ...], tuple[Tensor, ...]]] = {}
        self._pending_w: dict[tuple[int, int], WeightWork] = {}
        self._local: dict[tuple[Op, int, int], tuple[Tensor, ...]] = {}
        self._inputs: Sequence[tuple[Tensor, ...]] = ()
        self._targets: Sequence[Any] = ()
        self._weights: Sequence[float] = ()
        self._result = RankResult()
        self._started = 0.0  # start of the running action's compute (after its receives)

    def _last_backward_index(self, actions: Sequence[Action]) -> dict[int, int]:
        final_op = Op.W if self.schedule.splits_backward else Op.B
        done: dict[int, int] = {}
        for i, a in enumerate(actions):
            if a.op is final_op:
                done[a.stage] = i
        return done

    # -- public entry points ------------------------------------------------------------------

    def run_step(
        self,
        inputs: Sequence[tuple[Tensor, ...]] | None,
        targets: Sequence[Any] | None,
        loss_weights: Sequence[float],
    ) -> RankResult:
        """Run this rank's actions for one training step.

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
            with torch.enable_grad():
                for index, action in enumerate(self.schedule.actions[self.rank]):
                    self._execute(action, train=True)
                    if self._done_after.get(action.stage) == index and self.on_stage_done:
                        self.on_stage_done(action.stage)
            self._check_buffers_empty()
            return self._result
        finally:
            self._end()

    def run_forward(
        self, inputs: Sequence[tuple[Tensor, ...]] | None, microbatches: int, *, grad: bool
    ) -> RankResult:
        """Forward only over `microbatches` microbatches (no loss). With `grad=False` no graph
        is built; with `grad=True` tensors cross stages without detaching, so the returned
        outputs stay connected to every stage's parameters (backward then runs unpipelined)."""
        self._begin(inputs or (), (), ())
        try:
            with torch.set_grad_enabled(grad):
                for action in forward_actions(self.schedule, self.rank, microbatches):
                    self._execute(action, train=False)
            self._check_buffers_empty()
            return self._result
        finally:
            self._end()

    # -- per-step bookkeeping ------------------------------------------------------------------

    def _begin(
        self,
        inputs: Sequence[tuple[Tensor, ...]],
        targets: Sequence[Any],
        weights: Sequence[float],
    ) -> None:
        self._inputs, self._targets, self._weights = inputs, targets, weights
        self._result = RankResult()
        self._params = {
            s: [p for p in m.parameters() if p.requires_grad] for s, m in self.stages.items()
        }

    def _end(self) -> None:
        # Drop everything a failed step may have left, so the next step starts clean.
        self._stash.clear()
        self._pending_w.clear()
        self._local.clear()
        self._inputs, self._targets, self._weights = (), (), ()

    def _check_buffers_empty(self) -> None:
        left = {
            "stashed activations": sorted(self._stash),
            "pending weight grads": sorted(self._pending_w),
            "undelivered same-rank tensors": sorted(self._local),
        }
        left = {k: v for k, v in left.items() if v}
        if left:
            raise RuntimeError(
                f"rank {self.rank} ended the step of schedule {self.schedule.name!r} with "
                f"leftovers {left}: the schedule is missing the actions that consume them"
            )

    # -- actions --------------------------------------------------------------------------------

    def _execute(self, action: Action, *, train: bool) -> None:
        if self.abort is not None and self.abort.is_set():
            raise PipelineAborted(
                f"rank {self.rank} cancelled before {action}: another rank failed"
            )
        handler = _HANDLERS.get(action.op)
        if handler is None:
            raise ValueError(f"unknown action kind {action.op!r} in {action}")
        self._started = time.perf_counter()
        try:
            with record_function(f"hybridpipe {action}"):
                handler(self, action, train)
        except Exception as err:
            if not isinstance(err, PipelineAborted):
                err.add_note(f"while running action {action} on pipeline rank {self.rank}")
            raise
        end = time.perf_counter()
        self._result.events.append(
            Event(self.rank, action.stage, action.op, action.microbatch, self._started, end)
        )

    def _receive(self, op: Op, stage: int, mb: int) -> tuple[Tensor, ...]:
        key = (op, stage, mb)
        if key in self._local:
            return self._local.pop(key)
        tensors = self.transport.recv(op, stage, mb)
        # The Event times compute only: waiting for a peer is idle time, not this action's.
        self._started = time.perf_counter()
        return tensors

    def _deliver(self, op: Op, stage: int, mb: int, tensors: tuple[Tensor, ...]) -> None:
        """Hand F outputs of `stage` to stage+1, or B input-grads of `stage` to stage-1."""
        peer = stage + 1 if op is Op.F else stage - 1
        if peer in self.stages:
            self._local[(op, peer, mb)] = tensors
        else:
            self.transport.send(op, stage, mb, tensors)

    def _forward(self, action: Action, train: bool) -> None:
        stage, mb = action.stage, action.microbatch
        module = self.stages[stage]
        if stage == 0:
            inputs = tuple(self._inputs[mb])
        else:
            inputs = self._receive(Op.F, stage, mb)
            if train:
                # Leaves of this stage's graph: their .grad is what B sends upstream.
                inputs = tuple(
                    t.detach().requires_grad_(True) if _is_float(t) else t for t in inputs
                )
        # The module gets clones of the leaves, as in the unsplit model a stage's first op
        # may work in place on its input (e.g. ReLU(inplace=True)), which a leaf forbids.
        args = tuple(t.clone() if t.requires_grad and t.is_leaf else t for t in inputs)
        if train and self.checkpoint_activations:
            outputs = checkpoint(module, *args, use_reentrant=False)
        else:
            outputs = module(*args)
        if not isinstance(outputs, tuple):
            raise TypeError(
                f"stage {stage} returned a {type(outputs).__name__}; stage modules must return "
                "a tuple (the last stage a 1-tuple holding the model output)"
            )
        if stage == self.last_stage:
            output = outputs[0]
            check_output(output, stage)
            if not train:
                self._result.outputs[mb] = output
                return
            loss_fn = self.loss_fn
            if loss_fn is None:
                raise ValueError("a training step needs loss_fn; pass loss_fn=... to Pipeline")
            loss = loss_fn(output, self._targets[mb]) * self._weights[mb]
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                raise TypeError(
                    f"loss_fn returned {type(loss).__name__} "
                    f"{tuple(loss.shape) if isinstance(loss, Tensor) else ''}; it must return a "
                    "scalar tensor (use a mean- or sum-reduced loss)"
                )
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
            self._deliver(Op.F, stage, mb, tuple(t.detach() for t in outputs))
        else:
            self._deliver(Op.F, stage, mb, outputs)

    def _roots(
        self, stage: int, mb: int, outputs: tuple[Tensor, ...]
    ) -> tuple[list[Tensor], list[Tensor | None]]:
        """The tensors to differentiate and their incoming grads (None for the loss)."""
        if stage == self.last_stage:
            return [outputs[0]], [None]
        grads = self._receive(Op.B, stage, mb)
        floats = [t for t in outputs if _is_float(t)]
        if len(grads) != len(floats):
            raise RuntimeError(
                f"stage {stage} microbatch {mb} got {len(grads)} output grads for "
                f"{len(floats)} floating-point outputs"
            )
        pairs = [(t, g) for t, g in zip(floats, grads, strict=True) if t.requires_grad]
        return [t for t, _ in pairs], [g for _, g in pairs]

    def _send_input_grads(
        self, stage: int, mb: int, inputs: tuple[Tensor, ...], grads: Sequence[Tensor | None]
    ) -> None:
        if stage == 0:
            return
        floats = [t for t in inputs if _is_float(t)]
        payload = tuple(
            torch.zeros_like(t) if g is None else g for t, g in zip(floats, grads, strict=True)
        )
        self._deliver(Op.B, stage, mb, payload)

    def _backward(self, action: Action, train: bool) -> None:
        stage, mb = action.stage, action.microbatch
        inputs, outputs = self._stash.pop((stage, mb))
        roots, grads = self._roots(stage, mb, outputs)
        floats = [t for t in inputs if _is_float(t)] if stage > 0 else []
        if not self.schedule.splits_backward:
            if roots:
                torch.autograd.backward(roots, grads)
            self._send_input_grads(stage, mb, inputs, [t.grad for t in floats])
            return
        wanted = [t for t in floats if t.requires_grad]
        dx, work = backward_input(
            roots,
            grads,
            wanted,
            self._params[stage],
            save_weight_paths=not self.checkpoint_activations,
        )
        by_id = {id(t): g for t, g in zip(wanted, dx, strict=True)}
        self._send_input_grads(stage, mb, inputs, [by_id.get(id(t)) for t in floats])
        self._pending_w[(stage, mb)] = work

    def _weight(self, action: Action, train: bool) -> None:
        stage, mb = action.stage, action.microbatch
        if (stage, mb) not in self._pending_w:
            raise RuntimeError(f"{action} has no matching B before it on rank {self.rank}")
        backward_weight(self._pending_w.pop((stage, mb)))


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


def backward_weight(work: WeightWork) -> None:
    """W of a split backward: weight grads from what `backward_input` kept, into `.grad`."""
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
            # backward (not grad): AccumulateGrad adds into .grad, locked per parameter, so a
            # weight shared with a stage on another thread accumulates safely.
            # Groups may share weight-only nodes; the graph is freed when `work` is dropped.
            torch.autograd.backward(edges, saved, inputs=group.params, retain_graph=True)
        finally:
            for h in handles:
                h.remove()
    if work.roots and work.params:
        torch.autograd.backward(work.roots, work.grads, inputs=work.params)


_HANDLERS: dict[Op, Callable[[RankRuntime, Action, bool], None]] = {
    Op.F: RankRuntime._forward,
    Op.B: RankRuntime._backward,
    Op.W: RankRuntime._weight,
}
