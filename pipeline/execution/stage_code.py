"""A stage's code apart from its state: the graph it runs, its boundary names and the captured
constants the graph reads (`StageCode`). Switching a held stage module to another code
(`take_code`), e.g. the same stage captured in the other train/eval mode, keeps the module object
with its parameters, buffers, hooks and sharding: only what `forward` does changes."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import fx, nn

from partitioner import StageModule
from partitioner.exported import retarget


@dataclass(frozen=True)
class StageCode:
    """What `take_code` sets on a stage module: its graph, input and output names, and the
    constants (tensors that are neither parameters nor buffers of the model) it reads."""

    graph: fx.Graph
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    constants: dict[str, torch.Tensor]


def _attributes(graph: fx.Graph) -> set[str]:
    return {str(n.target) for n in graph.nodes if n.op in ("get_attr", "call_module")}


def code_of(stage: StageModule) -> StageCode:
    """`stage`'s code now (its graph copied; the constants it reads, by name)."""
    state = {name for name, _ in (*stage.named_parameters(remove_duplicate=False),
                                  *stage.named_buffers(remove_duplicate=False))}
    read = {name: _lookup(stage, name) for name in _attributes(stage.graph) if name not in state}
    return StageCode(copy.deepcopy(stage.graph), tuple(stage.input_names),
                     tuple(stage.output_names),
                     {k: v for k, v in read.items() if isinstance(v, torch.Tensor)})


def _lookup(module: nn.Module, target: str) -> object:
    owner = module
    *path, leaf = target.split(".")
    for part in path:
        owner = getattr(owner, part)
    return getattr(owner, leaf)


def take_code(stage: StageModule, code: StageCode, device: torch.device) -> None:
    """Make `stage` run `code` on `device`. ValueError when the code reads a parameter,
    buffer or submodule the stage does not hold (it was cut from another plan)."""
    missing = []
    for name in sorted(_attributes(code.graph)):
        try:
            _lookup(stage, name)
        except AttributeError:
            value = code.constants.get(name)
            if value is None or value.is_meta:  # a constant captured on meta has no value
                missing.append(name)
                continue
            *path, leaf = name.split(".")
            owner: nn.Module = stage
            for part in path:
                owner = getattr(owner, part)
            setattr(owner, leaf, value.to(device))
    if missing:
        raise ValueError(
            f"stage {stage.index}'s code for the new mode reads {missing[:5]}, which the stage "
            "does not hold; build a Pipeline in this mode, or pass capture_method='fx'"
        )
    stage.graph = copy.deepcopy(code.graph)  # recompiles forward
    stage.input_names = list(code.input_names)
    stage.output_names = list(code.output_names)
    retarget(stage, device)
