"""Checks of the inputs a captured graph is run on: the call structure a batch stands for,
whether a batch's shapes fit the dims torch.export made static or dynamic, and the train/eval
modes an export bakes in (`modes`, `mode_sensitive`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from partitioner.autocast import op_of
from partitioner.captured import Captured


def call_structure(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The (args, kwargs) a batch stands for: a tensor is the one positional argument, a
    tuple/list the positional arguments, a dict the keyword arguments (e.g. input_ids,
    attention_mask)."""
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, tuple | list):
        return tuple(batch), {}
    if isinstance(batch, dict):
        return (), dict(batch)
    raise TypeError(
        f"inputs must be a tensor, a tuple/list (positional arguments) or a dict (keyword "
        f"arguments) of tensors, got {type(batch).__name__}"
    )



def modes(model: nn.Module) -> tuple[bool, ...]:
    return tuple(m.training for m in model.modules())


def mode_sensitive(gm: fx.GraphModule) -> bool:
    """Whether the exported graph holds ops whose train/eval behaviour it baked in: dropout
    with p > 0 (also an attention's dropout_p), batch or instance norm."""
    for n in gm.graph.nodes:
        name = str(op_of(n.target))
        if "dropout" in name and not (len(n.args) > 1 and n.args[1] == 0):
            return True
        if "batch_norm" in name or "instance_norm" in name:
            return True
        if _argument(n, "dropout_p"):  # attention dropout (scaled_dot_product_attention)
            return True
    return False


def _argument(node: fx.Node, name: str) -> Any:
    """The value of the argument `name` of an op node (by its schema), or None."""
    if name in node.kwargs:
        return node.kwargs[name]
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.name == name:
            return node.args[i] if i < len(node.args) else None
    return None


def input_dims(gm: fx.GraphModule) -> list[tuple[Any, ...] | None]:
    """Per flat input: its dims as ints (static) or sympy expressions (dynamic); None for
    inputs traced without shapes (fx)."""
    dims: list[tuple[Any, ...] | None] = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        value = n.meta.get("val")
        if not isinstance(value, torch.Tensor):
            dims.append(None)
            continue
        dims.append(
            tuple(s.node.expr if isinstance(s, torch.SymInt) else int(s) for s in value.shape)
        )
    return dims


def check_inputs(captured: Captured, leaves: Sequence[Any], what: str = "inputs") -> None:
    """ValueError, before anything runs, when a microbatch's input shapes cannot run on the
    captured graph: a static dim differs, or a dynamic one leaves its range or breaks an
    equality the capture found (e.g. two inputs sharing a sequence length)."""
    dims, names = captured.input_dims, captured.inputs
    if len(leaves) != len(names):
        raise ValueError(
            f"{what} have {len(leaves)} tensors but the model was captured with {len(names)} "
            f"({', '.join(names)}); give every batch the same inputs"
        )
    bound: dict[Any, int] = {}
    exprs: list[tuple[str, int, Any, int]] = []
    for name, want, t in zip(names, dims, leaves, strict=True):
        if want is None or not isinstance(t, torch.Tensor):
            continue
        if t.dim() != len(want):
            raise ValueError(
                f"{what} {name!r} has {t.dim()} dims {tuple(t.shape)} but was captured with "
                f"{len(want)}; give tensors of the captured rank"
            )
        for d, (w, got) in enumerate(zip(want, t.shape, strict=True)):
            if isinstance(w, int):
                if w != got:
                    raise ValueError(
                        f"{what} {name!r} has size {got} in dim {d} (shape {tuple(t.shape)}) but "
                        f"the model was captured with {w} there, a size torch.export made "
                        f"static (the model's code fixes it, or the example had size 1); build "
                        f"the Pipeline with example_input of the shape you train with"
                    )
            elif getattr(w, "is_Symbol", False):
                if w in bound and bound[w] != got:
                    raise ValueError(
                        f"{what} {name!r} has size {got} in dim {d} but the capture found it "
                        f"equal to another input's size {bound[w]}; keep those sizes equal"
                    )
                bound[w] = int(got)
                low, high = captured.ranges.get(w, (0, float("inf")))
                # export assumes dynamic sizes >= 2 (it specialises 0 and 1); the graph's ops
                # are the same for 1, so only a bound the model's code set is enforced.
                if not (1 if low == 2 else low) <= got <= high:
                    raise ValueError(
                        f"{what} {name!r} has size {got} in dim {d}; the captured model allows "
                        f"{low}..{high} there"
                    )
            else:
                exprs.append((name, d, w, int(got)))
    for name, d, w, got in exprs:
        value = w.subs(bound)
        if value.is_number and int(value) != got:
            raise ValueError(
                f"{what} {name!r} has size {got} in dim {d}; the captured model needs {value} "
                "there (torch.export fixed it from the example and the model's code); build the "
                "Pipeline with example_input of the shape you train with"
            )
