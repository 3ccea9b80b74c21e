"""Checks and conversions at a stage's boundaries, for `RankRuntime`: a step's arguments, stage
inputs made leaves of the step's graph, stage outputs, the weighted loss, and the roots and
incoming gradients of a stage's backward."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from pipeline.execution.grads import is_float
from pipeline.execution.program import LossFn
from pipeline.planning.microbatch import check_output
from scheduler import Instruction

_NEEDS_LOSS_FN = "a training step needs loss_fn; pass loss_fn=... to Pipeline"
LOSS_SIGNATURE = "loss_fn(output, targets)"
_LOSS_EXAMPLE = ("e.g. nn.CrossEntropyLoss(), or lambda output, targets: "
                 "F.cross_entropy(output, targets)")


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _name_of(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def check_step_args(
    rank: int,
    microbatches: int,
    *,
    first: bool,
    last: bool,
    loss_fn: LossFn | None,
    inputs: Sequence[tuple[Tensor, ...]] | None,
    targets: Sequence[Any] | None,
    loss_weights: Sequence[float],
) -> None:
    """A training step's arguments for a rank that holds stage 0 (`first`) and/or the last
    stage (`last`): one input, target and loss weight per microbatch where needed."""
    m = microbatches
    if first and (inputs is None or len(inputs) != m):
        got = "none" if inputs is None else len(inputs)
        raise ValueError(
            f"rank {rank} runs stage 0 and needs {m} microbatch inputs, got {got}"
        )
    if last:
        if loss_fn is None:
            raise ValueError(_NEEDS_LOSS_FN)
        if targets is None or len(targets) != m or len(loss_weights) != m:
            raise ValueError(
                f"rank {rank} runs the last stage and needs {m} targets and loss "
                f"weights, got {None if targets is None else len(targets)} and "
                f"{len(loss_weights)}"
            )


def as_leaves(inputs: Sequence[Tensor], needs: Sequence[bool] | None) -> tuple[Tensor, ...]:
    """Stage inputs as leaves of this step's graph: for a message from another stage, the
    floating-point ones a gradient crosses (`needs`, per input, from the plan: their .grad
    is what B sends upstream); for the caller's inputs (`needs` None), those that require
    grad (they get their grads once the step succeeded)."""
    if needs is not None and len(needs) != len(inputs):
        raise RuntimeError(
            f"a stage got {len(inputs)} inputs from the stage before but its plan marks "
            f"{len(needs)}"
        )
    return tuple(
        t.detach().requires_grad_(True)
        if is_float(t) and (t.requires_grad if needs is None else needs[i]) else t
        for i, t in enumerate(inputs)
    )


def needing_grad(values: Sequence[Tensor], needs: Sequence[bool]) -> list[Tensor]:
    """The floating-point `values` a gradient crosses (`needs` per value, from the plan): what
    a B message holds, one grad each, in positional order."""
    return [t for t, need in zip(values, needs, strict=True) if need and is_float(t)]


def check_sent(outputs: Sequence[Tensor], needs: Sequence[bool], stage: int) -> None:
    """A stage's outputs against the plan's marks: one that requires grad where the plan says
    no gradient crosses it would lose its gradient, so it is an error (not a silent zero)."""
    wrong = [i for i, t in enumerate(outputs) if t.requires_grad and not needs[i]]
    if wrong:
        raise RuntimeError(
            f"stage {stage}'s outputs {wrong} require grad, but the plan found no gradient "
            "path to them (computed from buffers and integers alone): a buffer that requires "
            "grad? Register it as an nn.Parameter"
        )


def check_stage_outputs(outputs: Any, stage: int, *, last: bool) -> tuple[Any, ...]:
    """A stage module's return value: a tuple; the last stage's first item a model output,
    every other stage's items tensors."""
    if not isinstance(outputs, tuple):
        raise TypeError(
            f"stage {stage} returned a {type(outputs).__name__}; stage modules must return "
            "a tuple (the last stage a 1-tuple holding the model output)"
        )
    if last:
        check_output(outputs[0], stage)
        return outputs
    for i, t in enumerate(outputs):
        if not isinstance(t, Tensor):
            raise TypeError(
                f"stage {stage} output {i} is a {type(t).__name__}; values crossing stage "
                "boundaries must be tensors (cut the model elsewhere)"
            )
    return outputs


def check_loss_fn(loss_fn: object) -> LossFn | None:
    """`loss_fn` (None, or callable as ``loss_fn(output, targets)``); a TypeError naming it
    and the signature it needs otherwise."""
    if loss_fn is None:
        return None
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be callable as {LOSS_SIGNATURE}, got {_short_repr(loss_fn)} "
            f"(a {type(loss_fn).__name__}); {_LOSS_EXAMPLE}"
        )
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin without one: its first call tells
        return loss_fn
    try:
        signature.bind(None, None)
    except TypeError as err:
        raise TypeError(
            f"loss_fn {_name_of(loss_fn)}{signature} cannot be called as {LOSS_SIGNATURE} "
            f"({err}): the Pipeline calls it with the model's output and the targets of "
            f"each microbatch; {_LOSS_EXAMPLE}"
        ) from None
    return loss_fn


def _described(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _loss_note(err: Exception, loss_fn: LossFn, output: Any, target: Any, mb: int) -> str:
    """What a note on `err` (raised by the user's loss_fn) says: which function raised it, on
    which microbatch, and how it was called."""
    return (
        f"loss_fn {_name_of(loss_fn)} raised {type(err).__name__} on microbatch {mb}: "
        f"{str(err).rstrip('.')}. "
        f"It is called as {LOSS_SIGNATURE} with the model's output ({_described(output)}) "
        f"and that microbatch's targets ({_described(target)}); {_LOSS_EXAMPLE}"
    )


def weighted_loss(
    loss_fn: LossFn | None, output: Any, target: Any, weight: float, mb: int
) -> Tensor:
    """``loss_fn(output, target) * weight`` for microbatch `mb`, checked to be a scalar."""
    if loss_fn is None:
        raise ValueError(_NEEDS_LOSS_FN)
    try:
        raw = loss_fn(output, target)
    except Exception as err:
        # The user's own error object (type, message, attributes, traceback) with a note.
        err.add_note(_loss_note(err, loss_fn, output, target, mb))
        raise
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
    return raw * weight


def backward_roots(
    instruction: Instruction, outputs: tuple[Tensor, ...], grads: tuple[Tensor, ...] | None,
    needs: Sequence[bool],
) -> tuple[list[Tensor], list[Tensor | None]]:
    """The tensors a B differentiates and their incoming grads: the loss (grad None) when
    `grads` is None (the last stage), else the outputs a gradient crosses (`needing_grad`)
    that require grad."""
    if grads is None:
        return [outputs[0]], [None]
    crossing = needing_grad(outputs, needs)
    if len(grads) != len(crossing):
        raise RuntimeError(
            f"{instruction} got {len(grads)} output grads for {len(crossing)} "
            "floating-point outputs a gradient crosses"
        )
    pairs = [(t, g) for t, g in zip(crossing, grads, strict=True) if t.requires_grad]
    return [t for t, _ in pairs], [g for _, g in pairs]
