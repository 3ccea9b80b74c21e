"""The whole model's state dict across the stages a process holds: its spec (key -> shape,
dtype), checks of a state dict against it, gathering it on global rank 0, and loading a whole
state dict into the held stages (meta tensors replaced)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from pipeline.execution.materialize import fill_in_place
from pipeline.execution.processes import Processes, laid_out_as

TensorSpec = tuple[tuple[int, ...], torch.dtype]


def model_spec(model: nn.Module) -> dict[str, TensorSpec]:
    """key -> (shape, dtype) of every entry of `model.state_dict()` (works on meta models)."""
    return {k: (tuple(t.shape), t.dtype) for k, t in model.state_dict().items()}


def local_state(stage_modules: Mapping[int, nn.Module]) -> dict[str, Tensor]:
    """The state (parameters and persistent buffers) of the stages held here, original keys."""
    out: dict[str, Tensor] = {}
    for module in stage_modules.values():
        out.update(module.state_dict(keep_vars=True))
    return out


def _short(keys: Sequence[str], limit: int = 20) -> str:
    keys = sorted(keys)
    more = f" ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def check_state_dict(
    state_dict: Mapping[str, Any], spec: Mapping[str, TensorSpec], *, strict: bool = True,
    source: str = "state_dict",
) -> None:
    """ValueError naming missing keys, unexpected keys (only when `strict`) and shape
    mismatches of `state_dict` against the whole model's `spec`."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"{source} is a {type(state_dict).__name__}; give a mapping of key -> tensor "
            "(e.g. model.state_dict())"
        )
    problems = []
    missing = [k for k in spec if k not in state_dict]
    unexpected = [k for k in state_dict if k not in spec]
    if missing and strict:
        problems.append(f"missing keys ({len(missing)}): {_short(missing)}")
    if unexpected and strict:
        problems.append(f"unexpected keys ({len(unexpected)}): {_short(unexpected)}")
    wrong = []
    for key, value in state_dict.items():
        if key in spec:
            if not isinstance(value, Tensor):
                wrong.append(f"{key}: a {type(value).__name__}, not a tensor")
            elif tuple(value.shape) != spec[key][0]:
                wrong.append(
                    f"{key}: shape {tuple(value.shape)} in {source}, {spec[key][0]} in the model"
                )
    if wrong:
        problems.append(f"mismatched entries ({len(wrong)}): " + "; ".join(wrong[:20]))
    if problems:
        raise ValueError(
            f"{source} does not fit this model: " + " | ".join(problems) + ". Load a state dict "
            "of the same model (or pass strict=False to skip missing and unexpected keys)"
        )


def _processes(processes: Processes | None, held: Mapping[int, nn.Module]) -> Processes:
    """`processes`, or this one process alone (holding every stage of `held`)."""
    if processes is not None:
        return processes
    return Processes(max(len(held), 1), torch.device("cpu"))


def _cpu(t: Tensor) -> Tensor:
    """A CPU copy of the whole of `t` (a sharded DTensor is all-gathered over its replicas:
    every process calls this for the same keys in the same order)."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().to("cpu", copy=True)


def gather_state_dict(
    stage_modules: Mapping[int, nn.Module], spec: Mapping[str, TensorSpec],
    processes: Processes | None = None,
) -> dict[str, Tensor] | None:
    """The whole model's state dict (original keys, spec order, CPU copies) on global rank 0
    (and in a single process); None on other ranks. Every process must call it."""
    mine = {k: _cpu(v) for k, v in local_state(stage_modules).items() if k in spec}
    parts = _processes(processes, stage_modules).gather(mine)
    if parts is None:
        return None
    merged: dict[str, Tensor] = {}
    for part in parts:
        merged.update(part)
    return {k: merged[k] for k in spec if k in merged}


def gather_named(
    tensors: Mapping[str, Tensor | None], processes: Processes | None = None
) -> dict[str, Tensor | None] | None:
    """Merge name -> tensor maps held by the pipeline ranks (replica 0) on global rank 0,
    e.g. ``{k: p.grad for k, p in pipe.named_parameters()}``; None on other ranks."""
    parts = _processes(processes, {}).gather(
        {k: None if v is None else _cpu(v) for k, v in tensors.items()})
    if parts is None:
        return None
    merged: dict[str, Tensor | None] = {}
    for part in parts:
        merged.update(part)
    return merged


def load_state_dict(
    stage_modules: Mapping[int, nn.Module],
    state_dict: Mapping[str, Any],
    spec: Mapping[str, TensorSpec],
    *,
    strict: bool = True,
    source: str = "state_dict",
    model: nn.Module | None = None,
) -> None:
    """Load a whole-model state dict into the stages held here (any layout). Checks the keys
    and shapes against the whole model first; meta tensors are replaced by the loaded ones,
    in `model` too (the stages' own attribute copies would otherwise part from it); a
    sharded (shard="full") parameter takes this process's shard of its whole value."""
    check_state_dict(state_dict, spec, strict=strict, source=source)
    for module in stage_modules.values():
        own = module.state_dict(keep_vars=True)
        part = {k: laid_out_as(own[k], state_dict[k]) for k in own if k in state_dict}
        fill_in_place(own, part)  # the objects kept: an optimizer over them trains them
        on_meta = any(t.is_meta for k, t in module.state_dict(keep_vars=True).items()
                      if k in part)
        with torch.no_grad():
            # strict=False: the stage's own keys are a subset of the whole model's, checked above.
            module.load_state_dict(part, strict=False, assign=on_meta)
        if on_meta and model is not None:
            _share_with(model, module)


def _share_with(model: nn.Module, stage: nn.Module) -> None:
    """Put the stage's tensors into `model` where the model still has a meta tensor at the
    same name (fx copies a directly referenced parameter into the stage's own container
    module, so assigning it there leaves the model's meta one)."""
    for name, tensor in [*stage.named_parameters(), *stage.named_buffers()]:
        path, _, attr = name.rpartition(".")
        owner = model.get_submodule(path)
        current = getattr(owner, attr, None)
        if isinstance(current, Tensor) and current.is_meta and current is not tensor:
            if isinstance(tensor, nn.Parameter):
                owner._parameters[attr] = tensor
            else:
                owner._buffers[attr] = tensor
