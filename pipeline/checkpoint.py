"""Model and optimizer state of a pipeline under the original model's keys, for any layout:
gather the full state dict, load a full state dict into whichever stages this process holds,
and save/load sharded checkpoints with torch.distributed.checkpoint (DCP), atomically.

A process holds some stages (`stage_modules`: stage index -> module); their state_dict keys
are the original model's. `spec` (from `model_spec`) is the whole model's key -> (shape,
dtype), taken before other stages' parameters were freed, so every process can check a state
dict against the whole model.

Checkpoint directory (`save_checkpoint`): ``PATH/current`` names the live version directory
``PATH/v-000007``, which holds DCP's files and ``hybridpipe.pt``. Every process writes its own
stages' tensors (`dcp.save`; data-parallel replicas hold the same keys and DCP writes each key
once) under ``model.<key>``, and its optimizer's tensors under the keys of
``get_optimizer_state_dict(model, optimizer, flatten_optimizer_state_dict=True)`` prefixed
``optim.`` (``optim.state.<param name>.<state key>``): keys are the model's own names, so any
(stages, data_parallel) layout, or one process, loads any other's checkpoint by reading exactly
its own keys. ``hybridpipe.pt`` (global rank 0; read with ``weights_only=True``) holds the
format tag, the model's key -> shape spec, the saved layout, the optimizer's type, group count,
each parameter's group and its non-tensor values (hyper-parameters), and ``extra``.

Atomic: a save writes a new version directory (files fsynced by DCP), then replaces
``current`` (temp file, fsync, os.replace, directory fsync), then deletes older versions. A
writer killed at any moment leaves ``current`` naming the previous, complete version; the next
save removes what the dead writer left. The directory must be on storage every process can
read and write.

Loads are all-or-nothing: `load_checkpoint` checks the format, the model's keys and shapes,
the optimizer's type, param groups and per-parameter state, reads this process's tensors into
fresh buffers, and only then changes the optimizer and the stages.

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

import errno
import io
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from pipeline.execution.distributed import DistContext, agree

FORMAT = "hybridpipe-checkpoint"
VERSION = 2
TensorSpec = tuple[tuple[int, ...], torch.dtype]
_POINTER = "current"  # names the live version directory
_META = "hybridpipe.pt"
_VERSION = re.compile(r"v-(\d{6,})")
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
_NESTED = StateDictOptions(strict=False)  # a parameter with no saved state starts without


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
    model: nn.Module | None = None,
) -> None:
    """Load a whole-model state dict into the stages held here (any layout). Checks the keys
    and shapes against the whole model first; meta tensors are replaced by the loaded ones,
    in `model` too (the stages' own attribute copies would otherwise part from it)."""
    check_state_dict(state_dict, spec, strict=strict, source=source)
    for module in stage_modules.values():
        own = module.state_dict(keep_vars=True)
        part = {k: state_dict[k] for k in own if k in state_dict}
        on_meta = any(t.is_meta for t in own.values())
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


# ---------------------------------------------------------------------------------------------
# Checkpoint directories
# ---------------------------------------------------------------------------------------------


def _is_rank0(ctx: DistContext | None) -> bool:
    return ctx is None or ctx.layout.rank == 0


def _agree(value: Any, ctx: DistContext | None) -> Any:
    return value if ctx is None else agree(value)


def _qualname(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process when torch.distributed is not initialised: here
    that is meant (one process, or a load where each process reads its own keys)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save `obj` to `path` so that a crash at any moment leaves either the old file or
    the new one: a temp file in the same directory, fsync, os.replace, directory fsync."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
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
    _fsync_dir(path.parent)


def _checkpoint_root(path: str | os.PathLike[str]) -> Path:
    root = Path(path).absolute()
    if root.exists() and not root.is_dir():
        raise ValueError(
            f"checkpoint path {os.fspath(path)!r} is a file; a checkpoint is a directory "
            "(sharded, one set of files per process): give a directory path"
        )
    return root


def _live_version(root: Path) -> str | None:
    pointer = root / _POINTER
    if not pointer.is_file():
        return None
    return pointer.read_text().strip() or None


def _prepare_version(root: Path) -> str:
    """(Global rank 0) remove what a killed writer left, create the next version directory."""
    root.mkdir(parents=True, exist_ok=True)
    live = _live_version(root)
    numbers = [0]
    for entry in root.iterdir():
        match = _VERSION.fullmatch(entry.name)
        if match:
            numbers.append(int(match.group(1)))
            if entry.name != live:
                shutil.rmtree(entry)
        elif entry.name.startswith(f".{_POINTER}.") and entry.name.endswith(".tmp"):
            entry.unlink()
    name = f"v-{max(numbers) + 1:06d}"
    (root / name).mkdir()
    return name


def _commit(root: Path, name: str) -> None:
    """(Global rank 0) make `name` the live version, then delete the older ones."""
    fd, tmp = tempfile.mkstemp(prefix=f".{_POINTER}.", suffix=".tmp", dir=root)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / _POINTER)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(root)
    for entry in root.iterdir():
        if _VERSION.fullmatch(entry.name) and entry.name != name:
            shutil.rmtree(entry, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# What checkpoints can hold, and a full disk
# ---------------------------------------------------------------------------------------------


def _loads_back(value: Any) -> bool:
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:
        return False
    return True


def _first_unloadable(value: Any, where: str) -> tuple[str, Any]:
    """The path and value of the first leaf of `value` that does not load back."""
    if isinstance(value, Mapping):
        items: Iterable[tuple[str, Any]] = ((f"{where}[{k!r}]", v) for k, v in value.items())
    elif isinstance(value, (list, tuple, set)):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(value))
    else:
        return where, value
    for path, item in items:
        if not _loads_back(item):
            return _first_unloadable(item, path)
    return where, value


def check_extra(extra: Any) -> None:
    """TypeError (naming the value and the fix) unless `extra` loads back from a checkpoint,
    which is read with ``torch.load(weights_only=True)``: numbers, strings, bytes, None,
    lists, tuples, sets, dicts, tensors, dtypes (and types allowed with
    ``torch.serialization.add_safe_globals``)."""
    if _loads_back(extra):
        return
    where, value = _first_unloadable(extra, "extra")
    name = f"{type(value).__module__}.{type(value).__qualname__}"
    raise TypeError(
        f"{where} is a {name} ({_short_repr(value)}), which a checkpoint cannot load back (it "
        "is read with torch.load(weights_only=True)); convert it to plain data first: "
        "float(x) / int(x) for numpy scalars, torch.from_numpy(a) or a.tolist() for arrays "
        "(np.random.get_state() holds one), str(path) for a Path, vars(namespace) for an "
        "argparse Namespace, dataclasses.asdict(obj) for a dataclass; or allow the type with "
        "torch.serialization.add_safe_globals([...])"
    )


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _nbytes(tensors: Mapping[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _no_space(err: BaseException, seen: set[int] | None = None) -> bool:
    """Whether `err` (or what caused it, or a DCP rank failure inside it) is a full disk."""
    seen = set() if seen is None else seen
    if id(err) in seen:
        return False
    seen.add(id(err))
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if "No space left on device" in str(err) or "unexpected pos" in str(err):
        return True  # torch's writers report a short write as "enforce fail ... unexpected pos"
    inner = [e for e in (err.__cause__, err.__context__) if e is not None]
    if isinstance(err, CheckpointException):
        inner += [exc for exc, _ in err.failures.values()]
    return any(_no_space(e, seen) for e in inner)


def _disk_full(root: Path, need: int) -> OSError:
    free = shutil.disk_usage(root).free
    return OSError(
        errno.ENOSPC,
        f"no space left on the device of checkpoint {os.fspath(root)!r}: this process writes "
        f"{need / 2**20:.1f} MiB and {free / 2**20:.1f} MiB are free. Free space or save "
        "elsewhere; the previous checkpoint is untouched",
    )


# ---------------------------------------------------------------------------------------------
# Save and load
# ---------------------------------------------------------------------------------------------


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


def save_checkpoint(
    path: str | os.PathLike[str],
    stage_modules: Mapping[int, nn.Module],
    spec: Mapping[str, TensorSpec],
    ctx: DistContext | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    model: nn.Module | None = None,
    extra: Any = None,
) -> None:
    """Write this process's model (+ optimizer) state into the checkpoint directory `path`
    (see the module docstring), atomically. Every process must call it; it returns once the
    new version is live (all ranks wait). `model` names the optimizer's parameters. `extra`
    must load back with ``torch.load(weights_only=True)`` (`check_extra`, at once). A full
    disk is an OSError(ENOSPC) saying so; the previous checkpoint stays live."""
    check_extra(extra)
    root = _checkpoint_root(path)
    tensors: dict[str, Tensor] = {
        f"model.{k}": v.detach() for k, v in local_state(stage_modules).items() if k in spec
    }
    values: dict[str, Any] = {}
    optimizer_info = None
    if optimizer is not None:
        if model is None:
            raise TypeError("saving optimizer state needs model= (to name its parameters)")
        names = _param_names(model, optimizer)
        held = _held_names(stage_modules, names)
        flat = get_optimizer_state_dict(model, optimizer, options=_FLAT)
        # Only the held stages' parameters: an optimizer built before the plan was made also
        # holds the (emptied) parameters of other processes' stages, with stale state.
        for key, value in _of_params(flat, held).items():
            if isinstance(value, Tensor):
                tensors[f"optim.{key}"] = value.detach()
            else:
                values[f"optim.{key}"] = value
        for i, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if names[id(p)] in held:
                    values[f"optim.group.{names[id(p)]}"] = i
        optimizer_info = {"type": _qualname(optimizer), "groups": len(optimizer.param_groups)}
    need = _nbytes(tensors)
    with ctx.guard("checkpoint save") if ctx is not None else nullcontext():
        name = _agree(_prepare_version(root) if _is_rank0(ctx) else None, ctx)
        parts = _gather_to_rank0(values, ctx)
        version = root / name
        try:
            if shutil.disk_usage(root).free < need:
                raise _disk_full(root, need)
            with _single_process_quiet():
                dcp.save(tensors, storage_writer=FileSystemWriter(version), no_dist=ctx is None)
            if parts is not None:  # global rank 0
                merged = {k: v for part in parts for k, v in part.items()}
                layout = (
                    {"stages": ctx.layout.stages, "data_parallel": ctx.layout.data_parallel}
                    if ctx is not None else {"stages": len(stage_modules), "data_parallel": 1}
                )
                meta = {
                    "format": FORMAT, "version": VERSION, "spec": _spec_to_json(spec),
                    "layout": layout, "optimizer": optimizer_info, "values": merged,
                    "extra": extra,
                }
                atomic_save(meta, version / _META)
                _commit(root, name)
        except BaseException as err:
            if _is_rank0(ctx):
                shutil.rmtree(version, ignore_errors=True)
            if _no_space(err):
                raise _disk_full(root, need) from err
            raise
        if ctx is not None:
            done = torch.zeros(1, device=ctx.device)
            ctx.wait_work(dist.all_reduce(done, async_op=True), None, "the end of the save")


def _spec_to_json(spec: Mapping[str, TensorSpec]) -> dict[str, list[Any]]:
    return {
        k: [list(shape), str(dtype).removeprefix("torch.")] for k, (shape, dtype) in spec.items()
    }


def read_checkpoint(path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    """The live version directory of checkpoint `path` and its ``hybridpipe.pt``, checked."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"no checkpoint at {os.fspath(path)!r}")
    live = _live_version(root) if root.is_dir() else None
    if live is None or not (root / live / _META).is_file():
        raise ValueError(
            f"{os.fspath(path)!r} is not a hybridpipe checkpoint (no {_POINTER!r} naming a "
            f"saved version); give a directory written by save_checkpoint, or for a plain "
            "state dict file use pipe.load_state_dict(torch.load(path))"
        )
    try:
        meta = torch.load(root / live / _META, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(
            f"{os.fspath(path)!r} is not a readable hybridpipe checkpoint ({err}); give a "
            "directory written by save_checkpoint"
        ) from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(
            f"{os.fspath(path)!r} is not a hybridpipe checkpoint (no format tag {FORMAT!r})"
        )
    if meta.get("version") != VERSION:
        raise ValueError(
            f"{os.fspath(path)!r} has checkpoint version {meta.get('version')}; this hybridpipe "
            f"reads version {VERSION}"
        )
    return root / live, meta


def _check_model(source: str, meta: Mapping[str, Any], spec: Mapping[str, TensorSpec]) -> None:
    saved_spec = {k: tuple(v[0]) for k, v in meta["spec"].items()}
    ours = {k: s for k, (s, _) in spec.items()}
    if saved_spec == ours:
        return
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
        f"{source} was saved from a different model: " + " | ".join(parts)
        + ". Load it into the model it was saved from"
    )


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


def load_checkpoint(
    path: str | os.PathLike[str],
    stage_modules: Mapping[int, nn.Module],
    spec: Mapping[str, TensorSpec],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    model: nn.Module | None = None,
) -> Any:
    """Load a checkpoint written by `save_checkpoint` at any layout into the stages held here
    (and `optimizer`, whose parameters `model` names); returns the saved `extra`. Everything is
    checked, and this process's tensors read, before the stages or the optimizer change: a
    checkpoint of another model or optimizer is a ValueError and changes nothing. Under
    torch.distributed every process must call it."""
    version, meta = read_checkpoint(path)
    source = f"checkpoint {os.fspath(path)!r}"
    _check_model(source, meta, spec)
    stored = FileSystemReader(version).read_metadata().state_dict_metadata
    own = [k for k in local_state(stage_modules) if k in spec]
    absent = [k for k in own if f"model.{k}" not in stored]
    if absent:
        raise ValueError(
            f"{source} is incomplete: no tensors for {len(absent)} keys ({_short(absent)}); "
            "it was not written by save_checkpoint, or was damaged"
        )
    keys = [f"model.{k}" for k in own]
    flat: dict[str, Any] = {}
    names: dict[int, str] = {}
    if optimizer is not None:
        if model is None:
            raise TypeError("loading optimizer state needs model= (to name its parameters)")
        names = _param_names(model, optimizer)
        opt_keys, flat = _optimizer_plan(
            source, meta, stored, optimizer, names, _held_names(stage_modules, names)
        )
        keys += opt_keys
    buffers: dict[str, Any] = {}
    for key in keys:
        item = stored[key]
        if not isinstance(item, TensorStorageMetadata):
            raise ValueError(f"{source} holds {key!r} as bytes, not a tensor; it was damaged")
        buffers[key] = torch.empty(item.size, dtype=item.properties.dtype)
    if buffers:
        # Reading needs no coordination: each process reads its own keys (no_dist).
        with _single_process_quiet():
            dcp.load(buffers, storage_reader=FileSystemReader(version), no_dist=True)
    # Everything is checked and read: change the optimizer, then the stages.
    if optimizer is not None and model is not None:
        flat.update({k[len("optim."):]: v for k, v in buffers.items() if k.startswith("optim.")})
        set_optimizer_state_dict(
            model, optimizer,
            _nested(flat, optimizer, names, _held_names(stage_modules, names)),
            options=_NESTED,
        )
    state = {k[len("model."):]: v for k, v in buffers.items() if k.startswith("model.")}
    load_state_dict(stage_modules, state, spec, strict=False, source=source, model=model)
    return meta["extra"]
