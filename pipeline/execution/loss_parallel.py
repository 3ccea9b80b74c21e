"""Loss parallelism: the user's loss_fn run on a column-parallel LM head's logits as they are,
split over the tp ranks along the classes (a DTensor Shard(-1)), under torch's
``loss_parallel()`` (a vocab-parallel cross entropy: all-reduces of the max, the sum of
exponentials and the target's logit instead of an all-gather of the logits), its backward
under it too.

The choice is made once, on the first training microbatch, on every tp rank alike (each sees
the same replicated values): the loss_fn runs under loss_parallel and again on the gathered
logits (no gradient), and loss parallelism is kept only when it ran, returned a scalar and
equals the gathered loss; otherwise (an op loss_parallel does not take, a plain tensor mixed
with the DTensor, a parameter of the loss itself, another value) every microbatch gathers
the logits, as without it. The plan's `loss` (partitioner.tp_plan.LossChoice) records which
and why, and one log line says it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from partitioner.tp_plan import LossChoice

log = logging.getLogger("hybridpipe")

LossFn = Callable[[Any, Any], Tensor]


def by_classes(t: Any) -> bool:
    """Whether `t` is a DTensor split over a 1-d mesh along its last dim (logits by class)."""
    return (isinstance(t, DTensor) and t.device_mesh.ndim == 1 and t.dim() > 0
            and t.placements[0].is_shard(t.dim() - 1))


def _whole(t: Any) -> Any:
    if isinstance(t, DTensor):
        return t.redistribute(t.device_mesh, [Replicate()]).to_local()
    return t


def _plain(loss: Any) -> Any:
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _reaches_other_leaves(loss: Tensor, leaves: list[Tensor]) -> bool:
    """Whether `loss`'s autograd graph reaches a leaf other than `leaves` (a parameter of the
    loss itself, which the wrapped backward would not give a gradient)."""
    mine = {id(leaf) for leaf in leaves}
    seen: set[int] = set()
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        variable = getattr(fn, "variable", None)
        if variable is not None and id(variable) not in mine:
            return True
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return False


class _UnderLossParallel(torch.autograd.Function):
    """The loss of `leaves` (the logits' local shards) computed by `compute` under
    loss_parallel, with its backward under loss_parallel as well (torch requires both)."""

    @staticmethod
    def forward(ctx: Any, compute: Callable[[list[Tensor]], Tensor], *locals_: Tensor
                ) -> Tensor:
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in locals_]
            loss = compute(leaves)
        ctx.leaves, ctx.loss = leaves, loss
        return loss.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        with loss_parallel():
            grads = torch.autograd.grad(ctx.loss, ctx.leaves, grad, allow_unused=True)
        return (None, *grads)


class ParallelLoss:
    """`loss_fn` taking a stage output whose logits may be split by class (`by_classes`): run
    under loss_parallel while `choice` allows it, else on the gathered output (see the module
    docstring). Outputs holding no such DTensor go to `loss_fn` as they are."""

    def __init__(self, loss_fn: LossFn, choice: LossChoice) -> None:
        self.loss_fn = loss_fn
        self.choice = choice
        self.__name__ = getattr(loss_fn, "__name__", type(loss_fn).__name__)

    def __call__(self, output: Any, target: Any) -> Tensor:
        values, spec = tree_flatten(output)
        split = [i for i, v in enumerate(values) if by_classes(v)]
        if not split:
            if self.choice.used == "undecided" and torch.is_grad_enabled():
                self.choice.used = "gathered"
                self.choice.why = ("the last stage's output holds no logits split by class "
                                   "(its output is not a column-parallel projection's)")
            return self.loss_fn(output, target)
        if self.choice.used == "gathered":
            return self.loss_fn(tree_map(_whole, output), target)
        if self.choice.used == "parallel":
            return self._parallel(values, spec, split, target)
        mesh, device = values[split[0]].device_mesh, values[split[0]].device
        try:
            loss = self._parallel(values, spec, split, target)
            with torch.no_grad():
                want = self.loss_fn(tree_map(_detached_whole, output), target)
            why = "" if _same(loss, want) else (
                f"under loss_parallel it gave {_described(loss)}, on the gathered logits "
                f"{_described(want)}")
        except Exception as err:  # noqa: BLE001 - any failure under DTensor means: gather
            why = (f"under loss_parallel it raised {type(err).__name__}: "
                   f"{str(err).splitlines()[0][:200]}")
        # Every tp rank decides alike (one flag all-reduced: loss parallel where all agree).
        agreed = torch.tensor([0.0 if why else 1.0], dtype=torch.float64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=mesh.get_group())
        if not why and float(agreed) < 1.0:
            why = "another tp rank's loss under loss_parallel differed or raised"
        if why:
            return self._fall_back(output, target, why)
        self.choice.used = "parallel"
        self.choice.why = ("the loss_fn ran under torch's loss_parallel on the logits "
                           "split by class and equalled the gathered loss")
        log.info("hybridpipe: loss parallel: %s", self.choice.why)
        return loss

    def _parallel(self, values: list[Any], spec: Any, split: list[int], target: Any
                  ) -> Tensor:
        """The loss under loss_parallel through `_UnderLossParallel`; a ValueError when the
        loss_fn returns no tensor or reads a tensor needing a gradient besides the logits."""
        made = [values[i] for i in split]

        def compute(leaves: list[Tensor]) -> Tensor:
            rebuilt = list(values)
            for i, leaf, d in zip(split, leaves, made, strict=True):
                rebuilt[i] = DTensor.from_local(leaf, d.device_mesh, d.placements,
                                                run_check=False, shape=d.shape,
                                                stride=d.stride())
            with loss_parallel():
                loss = _plain(self.loss_fn(tree_unflatten(rebuilt, spec), target))
            if not isinstance(loss, Tensor):
                raise ValueError(f"it returned {type(loss).__name__}")
            if loss.requires_grad and _reaches_other_leaves(loss, leaves):
                raise ValueError("the loss reads tensors needing a gradient besides the logits")
            return loss

        locals_ = [d.to_local() for d in made]
        return _UnderLossParallel.apply(compute, *locals_)

    def _fall_back(self, output: Any, target: Any, why: str) -> Tensor:
        self.choice.used = "gathered"
        self.choice.why = f"the logits are gathered: {why}"
        log.warning("hybridpipe: loss parallel not used, %s", self.choice.why)
        return self.loss_fn(tree_map(_whole, output), target)


def _detached_whole(t: Any) -> Any:
    return _whole(t).detach() if isinstance(t, Tensor) else t


def _same(loss: Tensor, want: Any) -> bool:
    """Whether the loss under loss_parallel equals `want`, the gathered logits' loss."""
    return (isinstance(want, Tensor) and want.shape == loss.shape
            and torch.allclose(loss.detach(), want.to(loss.dtype)))


def _described(value: Any) -> str:
    if isinstance(value, Tensor) and value.numel() == 1:
        return f"{float(value.detach()):.10g}"
    return f"a {type(value).__name__}"


def parallel_loss(loss_fn: LossFn | None, choice: LossChoice) -> LossFn | None:
    """`loss_fn` as a `ParallelLoss` recording into `choice` (None stays None; a ParallelLoss
    is unwrapped first, so a reload wraps the user's function once)."""
    if loss_fn is None:
        return None
    inner = loss_fn.loss_fn if isinstance(loss_fn, ParallelLoss) else loss_fn
    return ParallelLoss(inner, choice)
