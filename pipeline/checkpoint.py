"""Model and optimizer state of a pipeline under the original model's keys, for any layout:
gather the full state dict, load a full state dict into whichever stages this process holds,
and save/load checkpoints atomically (temp file, fsync, os.replace).

A process holds some stages (`stage_modules`: stage index -> module); their state_dict keys
are the original model's. `spec` (from `model_spec`) is the whole model's key -> (shape,
dtype), taken before other stages' parameters were freed, so every process can check a state
dict against the whole model.

Checkpoint file (one file, written by global rank 0): ``{"format", "version", "spec", "model":
full state dict, "optimizer": {"state": {param name: state}, "param_groups": [... "params":
[param names]]} or None, "extra": user data, "layout": {"stages", "data_parallel"}}``. Optimizer
state is keyed by parameter name, so a run saved at one (stages, data_parallel) resumes at
another or in one process. Every process reads the file with ``torch.load(mmap=True)`` and
copies only its stages' tensors: the file must be on storage every node can read.

Large models without materialising them whole: build the model on the meta device (``with
torch.device("meta"): model = Model()``) and, under torchrun, make the Pipeline with a meta
example input and an explicit balance (profiling needs real tensors)::

    pipe = Pipeline(model, stages=4, balance="parameters", example_input=x.to("meta"), ...)
    pipe.load_state_dict(torch.load("weights.pt", mmap=True))
    optimizer = torch.optim.AdamW(pipe.parameters())

Each process captures and splits the model without allocating it, then takes only its own
stages' tensors from the memory-mapped file (the meta parameters are replaced by them; other
stages' bytes are never read). In one process, leave example_input out and load before the
first step. Build the optimizer after loading.
"""

from __future__ import annotations

import glob
import os
import tempfile
from collections.abc import Collection, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipeline.distributed import DistContext

FORMAT = "hybridpipe-checkpoint"
VERSION = 1
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


def _stage_params(stage_modules: Mapping[int, nn.Module]) -> dict[str, nn.Parameter]:
    return {k: p for m in stage_modules.values() for k, p in m.named_parameters()}


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


# ---------------------------------------------------------------------------------------------
# Gather and load
# ---------------------------------------------------------------------------------------------


def _gather_to_rank0(part: dict[str, Any], ctx: DistContext | None) -> list[dict[str, Any]] | None:
    """Every pipeline rank's `part` (replica 0) on global rank 0, None elsewhere."""
    if ctx is None:
        return [part]
    if ctx.layout.dp_rank != 0:
        return None
    if ctx.layout.stages == 1:
        return [part] if ctx.layout.rank == 0 else None
    parts: list[Any] = [None] * ctx.layout.stages if ctx.layout.rank == 0 else []
    with ctx.guard("state gather"):
        dist.gather_object(
            part, parts if ctx.layout.rank == 0 else None, dst=0, group=ctx.pp_group
        )
    return parts if ctx.layout.rank == 0 else None


def _cpu(t: Tensor) -> Tensor:
    return t.detach().to("cpu", copy=True)


def gather_state_dict(
    stage_modules: Mapping[int, nn.Module], spec: Mapping[str, TensorSpec],
    ctx: DistContext | None = None,
) -> dict[str, Tensor] | None:
    """The whole model's state dict (original keys, spec order, CPU copies) on global rank 0
    (and in a single process); None on other ranks. Every process must call it."""
    mine = {k: _cpu(v) for k, v in local_state(stage_modules).items() if k in spec}
    parts = _gather_to_rank0(mine, ctx)
    if parts is None:
        return None
    merged: dict[str, Tensor] = {}
    for part in parts:
        merged.update(part)
    return {k: merged[k] for k in spec if k in merged}


def gather_named(
    tensors: Mapping[str, Tensor | None], ctx: DistContext | None = None
) -> dict[str, Tensor | None] | None:
    """Merge name -> tensor maps held by the pipeline ranks (replica 0) on global rank 0,
    e.g. ``{k: p.grad for k, p in pipe.named_parameters()}``; None on other ranks."""
    parts = _gather_to_rank0({k: None if v is None else _cpu(v) for k, v in tensors.items()}, ctx)
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
) -> None:
    """Load a whole-model state dict into the stages held here (any layout). Checks the keys
    and shapes against the whole model first; meta tensors are replaced by the loaded ones."""
    check_state_dict(state_dict, spec, strict=strict, source=source)
    for module in stage_modules.values():
        own = module.state_dict(keep_vars=True)
        part = {k: state_dict[k] for k in own if k in state_dict}
        on_meta = any(t.is_meta for t in own.values())
        with torch.no_grad():
            # strict=False: the stage's own keys are a subset of the whole model's, checked above.
            module.load_state_dict(part, strict=False, assign=on_meta)


# ---------------------------------------------------------------------------------------------
# Optimizer state by parameter name
# ---------------------------------------------------------------------------------------------


def _names_in(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> list[list[str]]:
    groups = []
    for group in optimizer.param_groups:
        row = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    "the optimizer holds a parameter that is not one of this pipeline's; build "
                    "it over pipe.parameters()"
                )
            row.append(names[id(p)])
        groups.append(row)
    return groups


def _dedupe(names: list[str]) -> list[str]:
    return list(dict.fromkeys(names))


def optimizer_state(
    optimizer: torch.optim.Optimizer, named_params: Mapping[str, nn.Parameter],
    keep: Collection[str] | None = None,
) -> dict[str, Any]:
    """`optimizer.state_dict()` keyed by parameter name instead of position; only the state
    of the parameters in `keep` (default all), e.g. those of the stages held here."""
    names = {id(p): k for k, p in named_params.items()}
    order = [k for row in _names_in(optimizer, names) for k in row]
    sd = optimizer.state_dict()
    state = {
        order[i]: {k: _cpu(v) if isinstance(v, Tensor) else v for k, v in s.items()}
        for i, s in sd["state"].items()
        if keep is None or order[i] in keep
    }
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [order[i] for i in g["params"]]}
        for g in sd["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def _merge_optimizer_states(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for part in parts:
        state.update(part["state"])
        for i, g in enumerate(part["param_groups"]):
            if i == len(groups):
                groups.append({**g, "params": list(g["params"])})
            else:
                groups[i]["params"] = _dedupe(groups[i]["params"] + g["params"])
    return {"state": state, "param_groups": groups}


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    saved: Mapping[str, Any],
    named_params: Mapping[str, nn.Parameter],
    keep: Collection[str] | None = None,
) -> None:
    """Load name-keyed optimizer state (from `optimizer_state`, any layout) into `optimizer`,
    which must have the same number of param groups; each group takes the saved group's
    hyper-parameters, each parameter (of `keep`, default all) its saved state."""
    names = {id(p): k for k, p in named_params.items()}
    rows = _names_in(optimizer, names)
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(rows):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved_groups)} param groups, this one has "
            f"{len(rows)}; build the optimizer with the same param groups as the saved run"
        )
    index = {k: i for i, k in enumerate(k for row in rows for k in row)}
    groups, start = [], 0
    for row, saved_group in zip(rows, saved_groups, strict=True):
        hyper = {k: v for k, v in saved_group.items() if k != "params"}
        groups.append({**hyper, "params": list(range(start, start + len(row)))})
        start += len(row)
    state = {
        index[k]: v for k, v in saved["state"].items()
        if k in index and (keep is None or k in keep)
    }
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ---------------------------------------------------------------------------------------------
# Checkpoint files
# ---------------------------------------------------------------------------------------------


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """torch.save `obj` to `path` so that a crash at any moment leaves either the old file or
    the new one: write a temp file in the same directory, fsync it, os.replace it over `path`,
    fsync the directory. Temp files left by a killed writer are removed first."""
    path = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    for stale in glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(name)}.*.tmp")):
        os.unlink(stale)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _spec_to_json(spec: Mapping[str, TensorSpec]) -> dict[str, list[Any]]:
    return {
        k: [list(shape), str(dtype).removeprefix("torch.")] for k, (shape, dtype) in spec.items()
    }


def save_checkpoint(
    path: str | os.PathLike[str],
    stage_modules: Mapping[int, nn.Module],
    spec: Mapping[str, TensorSpec],
    ctx: DistContext | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    named_params: Mapping[str, nn.Parameter] | None = None,
    extra: Any = None,
) -> None:
    """Write model (+ optimizer) state to one file at `path`, atomically, from global rank 0.
    Every process must call it; it returns once the file is in place (all ranks wait).
    `named_params` names every parameter the optimizer may hold (default: the stages').
    `extra` is plain data (numbers, strings, lists, dicts, tensors): files are read back with
    ``torch.load(weights_only=True)``."""
    model = gather_state_dict(stage_modules, spec, ctx)
    opt_parts: list[dict[str, Any]] | None = None
    if optimizer is not None:
        named = named_params if named_params is not None else _stage_params(stage_modules)
        mine = _stage_params(stage_modules)
        opt_parts = _gather_to_rank0(optimizer_state(optimizer, named, keep=mine), ctx)
    # Under torch.distributed a failed write (disk full...) must stop the other ranks too.
    with ctx.guard("checkpoint save") if ctx is not None else nullcontext():
        if model is not None:
            layout = (
                {"stages": ctx.layout.stages, "data_parallel": ctx.layout.data_parallel}
                if ctx is not None else {"stages": len(stage_modules), "data_parallel": 1}
            )
            atomic_save(
                {
                    "format": FORMAT,
                    "version": VERSION,
                    "spec": _spec_to_json(spec),
                    "model": model,
                    "optimizer": (
                        None if opt_parts is None else _merge_optimizer_states(opt_parts)
                    ),
                    "extra": extra,
                    "layout": layout,
                },
                path,
            )
        if ctx is not None:
            done = torch.zeros(1, device=ctx.device)
            ctx.wait_work(dist.all_reduce(done, async_op=True), None, "the end of the save")


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Open a checkpoint file (memory-mapped) and check it is one of ours."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {os.fspath(path)!r}")
    try:
        data = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:
        raise ValueError(
            f"{os.fspath(path)!r} is not a readable hybridpipe checkpoint ({err}); give a file "
            "written by save_checkpoint"
        ) from err
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(
            f"{os.fspath(path)!r} is not a hybridpipe checkpoint (no format tag {FORMAT!r}); "
            "for a plain state dict use pipe.load_state_dict(torch.load(path))"
        )
    if data.get("version") != VERSION:
        raise ValueError(
            f"{os.fspath(path)!r} has checkpoint version {data.get('version')}; this hybridpipe "
            f"reads version {VERSION}"
        )
    return data


def load_checkpoint(
    path: str | os.PathLike[str],
    stage_modules: Mapping[int, nn.Module],
    spec: Mapping[str, TensorSpec],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    named_params: Mapping[str, nn.Parameter] | None = None,
) -> Any:
    """Load a checkpoint written by `save_checkpoint` at any layout into the stages held here
    (and `optimizer`); returns the saved `extra`. A checkpoint of another model is a
    ValueError listing the differing keys and shapes."""
    data = read_checkpoint(path)
    saved_spec = {k: tuple(v[0]) for k, v in data["spec"].items()}
    ours = {k: s for k, (s, _) in spec.items()}
    if saved_spec != ours:
        missing = [k for k in ours if k not in saved_spec]
        unexpected = [k for k in saved_spec if k not in ours]
        shapes = [f"{k}: {saved_spec[k]} vs {ours[k]}" for k in ours
                  if k in saved_spec and saved_spec[k] != ours[k]]
        parts = [
            f"{what} ({len(keys)}): {text}"
            for what, keys, text in (
                ("keys only in this model", missing, _short(missing)),
                ("keys only in the checkpoint", unexpected, _short(unexpected)),
                ("shapes (checkpoint vs model)", shapes, "; ".join(shapes[:20])),
            )
            if keys
        ]
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} was saved from a different model: "
            + " | ".join(parts) + ". Load it into the model it was saved from"
        )
    load_state_dict(stage_modules, data["model"], spec, source=f"checkpoint {os.fspath(path)!r}")
    if optimizer is not None:
        if data["optimizer"] is None:
            raise ValueError(
                f"checkpoint {os.fspath(path)!r} has no optimizer state; save it with "
                "save_checkpoint(path, optimizer=...) or load without optimizer"
            )
        named = named_params if named_params is not None else _stage_params(stage_modules)
        load_optimizer_state(optimizer, data["optimizer"], named, keep=_stage_params(stage_modules))
    return data["extra"]
