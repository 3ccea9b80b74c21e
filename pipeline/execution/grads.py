"""Gradient writes of a pipeline step: a stage's step-private parameter leaves (`StepLeaves`),
committing their grads into the parameters (`accumulate_grads`), applying stage 0's input grads to
the caller's inputs (`apply_input_grads`), and the running statistics a recomputed forward must
put back (`running_statistics`; pipeline.execution.activations.recompute puts them back).

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

In-place accumulation across steps (``Pipeline(grad_accumulation="in_place")``): the
parameters the caller leaves with a `.grad` (pipeline.facade.running.run_step does so only for
a parameter one stage of this process trains alone, and not tied to another rank) start their
leaf with that very tensor as its grad, so AccumulateGrad adds into it in place: no second copy
of the gradients. The trade: a failed or cancelled step may have added part of its gradients
into those `.grad`, and a cancelled worker still inside its backward may add more until it
returns; by default (`.grad` cleared for the step) none of that can happen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias, cast

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


def is_float(t: Tensor) -> bool:
    """Whether `t` can carry a gradient (floating point or complex)."""
    return t.is_floating_point() or t.is_complex()


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
        wanted = [t for t in inputs[m] if is_float(t) and t.requires_grad]
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
            g = laid_out_like(p, g)
            seen = merged.get(id(p))
            merged[id(p)] = (p, g) if seen is None else (p, seen[1] + g)
    pairs = list(merged.values())
    adds = [(p.grad, g) for p, g in pairs if p.grad is not None]
    for p, g in pairs:
        if p.grad is None:
            p.grad = g if owned else g.detach().clone(memory_format=torch.preserve_format)
    if adds:
        torch._foreach_add_([a for a, _ in adds], [g for _, g in adds])


def laid_out_like(p: Tensor, g: Tensor) -> Tensor:
    """A DTensor gradient in its parameter's placement: under sequence parallelism a
    replicated weight read by token-sharded activations (a norm's) gets partial sums, reduced
    here once (Megatron-LM's all-reduce of such gradients)."""
    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
        return g.redistribute(p.device_mesh, p.placements)
    return g


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
                if p.grad is not None:  # accumulating across steps: AccumulateGrad adds in place
                    leaf.grad = p.grad
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
        """Move the leaves' grads into the parameters' `.grad` (stolen, or added; a leaf that
        accumulated into the parameter's own `.grad` has nothing left to move)."""
        pairs = [(p, leaf.grad) for p, leaf in self.pairs if leaf.grad is not p.grad]
        for _, leaf in self.pairs:
            leaf.grad = None
        accumulate_grads([p for p, _ in pairs], [g for _, g in pairs], owned=True)
