"""The optimizer's part of a checkpoint: naming its parameters by the model's keys, selecting
the held stages' entries of the flattened state, checking a saved optimizer against the given
one (type, param groups) and rebuilding the nested state dict to load."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
NESTED = StateDictOptions(strict=False)  # a parameter with no saved state starts without


def _qualname(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """id -> the model's name of every parameter (a tied one: its first name, everywhere);
    ValueError if the optimizer holds another."""
    names = {id(p): k for k, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    "the optimizer holds a parameter that is not one of this pipeline's; build "
                    "it over pipe.parameters()"
                )
    return names


def _held_names(stage_modules: Mapping[int, nn.Module], names: Mapping[int, str]) -> set[str]:
    """The model's names of the parameters the held stages use (a tied weight held under its
    second name, e.g. by the last stage, still goes by the model's first name)."""
    return {names[id(p)] for m in stage_modules.values() for p in m.parameters() if id(p) in names}


def _of_params(flat: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """The entries ``state.<name>.*`` and ``param_groups.<name>.*`` of a flattened optimizer
    state dict for the parameters `names`."""
    prefixes = tuple(f"{kind}.{n}." for n in names for kind in ("state", "param_groups"))
    return {k: v for k, v in flat.items() if k.startswith(prefixes)}


def _optimizer_plan(
    source: str, meta: Mapping[str, Any], stored: Mapping[str, Any],
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], held: set[str],
) -> tuple[list[str], dict[str, Any]]:
    """Check the checkpoint's optimizer against `optimizer`; the DCP keys of its tensors for
    the `held` parameters and its flat non-tensor values (keys without ``optim.``)."""
    info = meta["optimizer"]
    if info is None:
        raise ValueError(
            f"{source} has no optimizer state; save it with save_checkpoint(path, "
            "optimizer=...) or load without optimizer"
        )
    if info["type"] != _qualname(optimizer):
        raise ValueError(
            f"{source} holds the state of a {info['type']}, but the optimizer given is a "
            f"{_qualname(optimizer)}; build the same optimizer type as the saved run (or load "
            "without optimizer= and start the optimizer afresh)"
        )
    if info["groups"] != len(optimizer.param_groups):
        raise ValueError(
            f"{source}'s optimizer has {info['groups']} param groups, this one has "
            f"{len(optimizer.param_groups)}; build the optimizer with the same param groups as "
            "the saved run"
        )
    values: dict[str, Any] = meta["values"]
    wrong = []
    tensor_keys: list[str] = []
    flat: dict[str, Any] = {}
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            name = names[id(p)]
            if name not in held:
                continue
            saved = values.get(f"optim.group.{name}")
            if saved != i:
                wrong.append(f"{name} (group {i} here, "
                             f"{'absent' if saved is None else f'group {saved}'} there)")
                continue
            for prefix in (f"optim.state.{name}.", f"optim.param_groups.{name}."):
                tensor_keys += [k for k in stored if k.startswith(prefix)]
                flat.update({k[len("optim."):]: v for k, v in values.items()
                             if k.startswith(prefix)})
    if wrong:
        raise ValueError(
            f"{source}'s optimizer groups its parameters differently ({len(wrong)}): "
            + "; ".join(wrong[:10]) + ". Build the optimizer with the same param groups, in the "
            "same order, as the saved run"
        )
    return tensor_keys, flat


def _nested(
    flat: Mapping[str, Any], optimizer: torch.optim.Optimizer, names: Mapping[int, str],
    held: set[str],
) -> dict[str, Any]:
    """The FQN-keyed (unflattened) optimizer state dict from flattened keys ``state.<fqn>.<k>``
    and ``param_groups.<fqn>.<hyper>``. torch's own unflattening only restores the state keys
    the target optimizer already has, so a checkpoint's momentum buffers would not reach an
    SGD built with momentum=0 (its hyper-parameters come from the checkpoint too). Only the
    `held` parameters get state; a group without any keeps its own hyper-parameters."""
    state: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    for group in optimizer.param_groups:
        fqns = [names[id(p)] for p in group["params"]]
        hyper = {k: v for k, v in group.items() if k != "params"}
        loaded = [f for f in fqns if f in held]
        if loaded:
            prefix = f"param_groups.{loaded[0]}."
            hyper = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}
        groups.append({**hyper, "params": fqns})
        for fqn in loaded:
            prefix = f"state.{fqn}."
            own = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}
            if own:
                state[fqn] = own
    return {"state": state, "param_groups": groups}
