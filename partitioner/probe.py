"""One unit of a captured graph run for its backward: its floating inputs become fresh leaves
(a parameter among them counts as a weight, as do the unit's own parameters), the tensors
autograd saves for backward are counted (its activation bytes), and `Probe.grad_of(wrt)` runs
the backward w.r.t. any of those: what the profiler times and the estimate counts FLOPs of."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map


@dataclass
class Probe:
    """The unit's outputs that need grad, their seed grads (ones), its input leaves, its
    weights and the bytes autograd saved for its backward."""

    outs: list[Tensor]
    grads: list[Tensor]
    leaves: list[Tensor]
    weights: list[Tensor]
    activation_bytes: float

    @property
    def has_backward(self) -> bool:
        return bool(self.outs) and bool(self.leaves or self.weights)

    def grad_of(self, wrt: list[Tensor]) -> Callable[[], Any]:
        """The backward from the outputs to `wrt` (repeatable: the graph is kept)."""
        return lambda: torch.autograd.grad(
            self.outs, wrt, self.grads, retain_graph=True, allow_unused=True
        )


def probe(
    run: Callable[[Any, Any, Any], Any], target: Any, args: Any, kwargs: Any, *,
    weights: list[Tensor], is_param: Callable[[Tensor], bool], key: Callable[[Tensor], Hashable],
    needs: Any = None,
) -> Probe:
    """Run ``run(target, args, kwargs)`` with grad on fresh leaves of its floating inputs
    (with `needs`, a tree of bools of (args, kwargs)'s structure: of those it marks, the
    others copied as they are). `weights`: the unit's own trainable parameters; `is_param`
    tells a parameter (a weight, not an activation, and not counted as saved); `key`
    identifies a saved tensor (saved twice, counted once)."""
    leaves: list[Tensor] = []
    weights = list(weights)

    def as_leaf(t: Any, need: Any = True) -> Any:
        if isinstance(t, Tensor) and t.is_floating_point() and need is not True:
            return t.clone()
        if isinstance(t, Tensor) and t.is_floating_point():
            leaf = t.detach().requires_grad_()
            # A parameter reaching a function node as an argument (get_attr) is a weight.
            (weights if is_param(t) else leaves).append(leaf)
            return leaf.clone()  # a non-leaf copy, so in-place ops in the node are legal
        return t

    saved: dict[Hashable, int] = {}

    def pack(t: Tensor) -> Tensor:
        if not is_param(t):
            saved[key(t)] = t.numel() * t.element_size()
        # Detached: a node saving its own output (rsqrt, exp, ...) would otherwise hold that
        # output, whose grad_fn is the node: a cycle in C++ that Python's gc never frees,
        # keeping the unit's graph, and with it references to its weights, alive for good.
        return t.detach()

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        a, kw = tree_map(as_leaf, (args, kwargs)) if needs is None else tree_map(
            as_leaf, (args, kwargs), needs)
        out = run(target, a, kw)
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor) and t.requires_grad]
    return Probe(outs, [torch.ones_like(t) for t in outs], leaves, weights,
                 float(sum(saved.values())))
