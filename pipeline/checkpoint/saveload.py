"""The checkpoint entry points: `save_checkpoint` (every process writes its own stages' model
and optimizer tensors with DCP on its own, no collectives (pipeline.checkpoint.parts); global
rank 0 merges DCP's index and writes the metadata, then the new version goes live)
and `load_checkpoint` (everything checked and read before anything changes), with
`read_checkpoint` for the live version's metadata."""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from pipeline.checkpoint.background import AsyncWriter
from pipeline.checkpoint.checksums import (
    ALGORITHM,
    ChecksummingWriter,
    mismatch,
    recorded,
    write_index_checksums,
    write_rank_checksums,
)
from pipeline.checkpoint.extra import check_extra
from pipeline.checkpoint.files import (
    _META,
    _POINTER,
    _checkpoint_root,
    _commit,
    _disk_full,
    _live_version,
    _nbytes,
    _no_space,
    _prepare_version,
    _single_process_quiet,
    atomic_save,
    failure_reason,
    versions,
)
from pipeline.checkpoint.optim import (
    FLAT,
    NESTED,
    _held_names,
    _nested,
    _of_params,
    _optimizer_plan,
    _param_names,
    _qualname,
)
from pipeline.checkpoint.parts import merge_parts, strided_pieces
from pipeline.checkpoint.state_dict import (
    TensorSpec,
    _processes,
    _short,
    load_state_dict,
    local_state,
)
from pipeline.execution.processes import (
    Processes,
    hyperparameters_loaded,
    laid_out_as,
    local_optimizer,
)

FORMAT = "hybridpipe-checkpoint"
VERSION = 2


def _state_to_save(
    stage_modules: Mapping[int, nn.Module], spec: Mapping[str, TensorSpec],
    optimizer: torch.optim.Optimizer | None, model: nn.Module | None,
) -> tuple[dict[str, Tensor], dict[str, Any], dict[str, Any] | None]:
    """This process's tensors to write (model and optimizer, DCP keys), the optimizer's
    non-tensor values (for hybridpipe.pt) and the optimizer's type and group count."""
    tensors: dict[str, Tensor] = {
        f"model.{k}": v.detach() for k, v in local_state(stage_modules).items() if k in spec
    }
    values: dict[str, Any] = {}
    if optimizer is None:
        return tensors, values, None
    if model is None:
        raise TypeError("saving optimizer state needs model= (to name its parameters)")
    optimizer = local_optimizer(optimizer)  # ZeRO: the state this replica owns
    names = _param_names(model, optimizer)
    held = _held_names(stage_modules, names)
    flat = get_optimizer_state_dict(model, optimizer, options=FLAT)
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
    return tensors, values, {"type": _qualname(optimizer), "groups": len(optimizer.param_groups)}


def _written_here(
    tensors: dict[str, Tensor], processes: Processes, optimizer: torch.optim.Optimizer | None
) -> dict[str, Tensor]:
    """The tensors this process writes, so that none is written twice: replica 0 writes what
    the replicas hold alike (plain tensors; optimizer state unless ZeRO shards it), the other
    replicas only their own shards (DTensor shards, ZeRO's optimizer state). Without DCP's
    collectives nothing else dedupes them (`parts.merge` keeps one copy if some slip by)."""
    if processes.dp_rank == 0:
        return tensors
    zero = optimizer is not None and local_optimizer(optimizer) is not optimizer
    return {k: v for k, v in tensors.items()
            if isinstance(v, DTensor) or (zero and k.startswith("optim."))}


def _go_live(root: Path, name: str, meta: dict[str, Any], keep: int, world: int) -> None:
    """(Global rank 0, every process's files written) merge DCP's index parts, write
    hybridpipe.pt, switch to the new version."""
    merge_parts(root / name, world)
    atomic_save(meta, root / name / _META)
    write_index_checksums(root / name, (_META, ".metadata"))
    _commit(root, name, keep)


def save_checkpoint(
    path: str | os.PathLike[str],
    stage_modules: Mapping[int, nn.Module],
    spec: Mapping[str, TensorSpec],
    processes: Processes | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    model: nn.Module | None = None,
    extra: Any = None,
    keep: int = 1,
    writer: AsyncWriter | None = None,
    unit_costs: Mapping[str, Any] | None = None,
) -> None:
    """Write this process's model (+ optimizer) state into the checkpoint directory `path`
    (see the module docstring), atomically, with the layout it ran at and `unit_costs` (global
    rank 0's: the run's profiled or measured unit costs as plain data,
    partitioner.unit_costs.costs_as_data, which an elastic restart re-plans from). Every
    process must call it; it returns once the new version is live (all ranks wait). `model`
    names the optimizer's parameters. `extra` must load back with
    ``torch.load(weights_only=True)`` (`check_extra`, at once). A full disk is an
    OSError(ENOSPC) saying so; the previous checkpoint stays live, and what the failed save
    wrote is removed. `keep`: versions kept (the newest; older ones are deleted
    when a new one goes live). With `writer` the save is asynchronous: it first waits for the
    writer's previous save, then returns once this process's tensors are staged (copied), and
    the new version goes live in the background (`AsyncWriter.wait`)."""
    check_extra(extra)
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1 (versions kept), got {keep!r}")
    root = _checkpoint_root(path)
    tensors, values, optimizer_info = _state_to_save(stage_modules, spec, optimizer, model)
    procs = _processes(processes, stage_modules)
    tensors = strided_pieces(_written_here(tensors, procs, optimizer))
    need = _nbytes(tensors)
    with procs.guard("checkpoint save"):
        if writer is not None:
            writer.wait()  # one save in flight at a time
        leads = procs.rank == 0
        name = procs.agree(_prepare_version(root) if leads else None)
        parts = procs.gather(values, replicas=optimizer is not None)
        version = root / name

        def discard() -> None:
            if leads:
                shutil.rmtree(version, ignore_errors=True)

        finish = None
        if parts is not None:  # global rank 0
            layout = {"stages": procs.stages, "data_parallel": procs.data_parallel}
            meta = {
                "format": FORMAT, "version": VERSION, "checksums": ALGORITHM,
                "spec": _spec_to_json(spec),
                "layout": layout, "unit_costs": unit_costs or {}, "optimizer": optimizer_info,
                "values": {k: v for part in parts for k, v in part.items()}, "extra": extra,
            }
            finish = functools.partial(_go_live, root, name, meta, keep, procs.world_size)
        try:
            if shutil.disk_usage(root).free < need:
                raise _disk_full(root, need)
            if writer is not None:
                writer.start(tensors, version, finish=finish, discard=discard, root=root,
                             need=need)
                return
            storage = ChecksummingWriter(version, procs.rank)
            with _single_process_quiet():  # each process on its own: no DCP collectives
                dcp.save(tensors, storage_writer=storage, no_dist=True)
            write_rank_checksums(version, storage.global_rank, storage.sums)
            procs.barrier("the checksums")  # every process's are written before it goes live
            if finish is not None:
                finish()
        except BaseException as err:
            discard()
            if _no_space(err):
                raise _disk_full(root, need) from err
            raise
        procs.barrier("the end of the save")


def _spec_to_json(spec: Mapping[str, TensorSpec]) -> dict[str, list[Any]]:
    return {
        k: [list(shape), str(dtype).removeprefix("torch.")] for k, (shape, dtype) in spec.items()
    }


def read_checkpoint(
    path: str | os.PathLike[str], version: str | None = None
) -> tuple[Path, dict[str, Any]]:
    """The live version directory of checkpoint `path` (or the retained `version`, e.g.
    "v-000003") and its ``hybridpipe.pt``, checked."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"no checkpoint at {os.fspath(path)!r}")
    live = _live_version(root) if root.is_dir() else None
    if version is not None and live is not None:
        if version not in versions(root):
            raise ValueError(
                f"checkpoint {os.fspath(path)!r} has no version {version!r}; it holds "
                f"{versions(root)}"
            )
        live = version
    if live is None or not (root / live / _META).is_file():
        raise ValueError(
            f"{os.fspath(path)!r} is not a hybridpipe checkpoint (no {_POINTER!r} naming a "
            f"saved version); give a directory written by save_checkpoint, or for a plain "
            "state dict file use pipe.load_state_dict(torch.load(path))"
        )
    sums = recorded(root / live)
    for name in (_META, ".metadata"):
        reason = None if sums is None else mismatch(root / live / name, sums)
        if reason is not None:
            what = "DCP's index" if name == ".metadata" else "its metadata"
            raise ValueError(
                f"checkpoint {os.fspath(path)!r} is damaged: {what} {str(root / live / name)!r}:"
                f" {reason}. Nothing was loaded; restore the file, or load an older version"
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
    if meta.get("checksums") and sums is None:
        raise ValueError(
            f"{os.fspath(path)!r} version {live!r} lacks its checksum lists (written with every "
            "version): it was damaged; load an older version (save with keep= to retain some)"
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


def _read(version: Path, buffers: dict[str, Tensor], source: str) -> None:
    """Read `buffers` (DCP keys) from `version`. Reading needs no coordination: each process
    reads its own keys (no_dist). A data file that is missing, short, changed since it was
    written (its CRC32C differs from the one in checksums.json: checked before reading) or
    unreadable is a ValueError naming it."""
    storage = FileSystemReader(version).read_metadata().storage_data
    files: dict[str, dict[str, Tensor]] = {}
    for index, info in storage.items():
        if index.fqn in buffers:
            files.setdefault(info.relative_path, {})[index.fqn] = buffers[index.fqn]
    sums = recorded(version)
    for name, part in sorted(files.items()):
        need = max(i.offset + i.length for i in storage.values() if i.relative_path == name)
        reason = _file_problem(version / name, need, sums)
        if reason is not None:
            raise _damaged(source, version / name, part, reason)
    try:
        with _single_process_quiet():
            dcp.load(buffers, storage_reader=FileSystemReader(version), no_dist=True)
        return
    except (Exception, CheckpointException) as err:  # DCP's is a BaseException
        failure = err
    for name, part in sorted(files.items()):  # which file DCP could not read
        try:
            with _single_process_quiet():
                dcp.load(part, storage_reader=FileSystemReader(version), no_dist=True)
        except (Exception, CheckpointException) as err:
            reason = f"it cannot be read ({failure_reason(err)})"
            raise _damaged(source, version / name, part, reason) from None
    raise ValueError(
        f"{source} could not be read ({failure_reason(failure)}); nothing was loaded"
    ) from failure


def _file_problem(file: Path, need: int, sums: dict[str, list[int]] | None) -> str | None:
    """Why a data file cannot be trusted (missing, truncated, changed), or None."""
    if not file.is_file():
        return "it is missing"
    if file.stat().st_size < need:
        return f"it is truncated ({file.stat().st_size} bytes, {need} expected)"
    return None if sums is None else mismatch(file, sums)


def _damaged(source: str, file: Path, part: Mapping[str, Tensor], reason: str) -> ValueError:
    return ValueError(
        f"{source} is damaged: data file {str(file)!r} holding {len(part)} of this "
        f"process's tensors ({_short(list(part))}): {reason}. Nothing was loaded; restore "
        "the file, or load an older version (save with keep= to retain some)"
    )


def _targets(
    stage_modules: Mapping[int, nn.Module], model: nn.Module | None
) -> Callable[[str], Tensor | None]:
    """The tensor a checkpoint key is read into (``model.<key>``: the held state;
    ``optim.state.<param>.<name>``: the parameter), to read a sharded one's shard only."""
    state = local_state(stage_modules)
    params = dict(model.named_parameters()) if model is not None else {}

    def target(key: str) -> Tensor | None:
        if key.startswith("model."):
            return state.get(key[len("model."):])
        return params.get(key[len("optim.state."):].rpartition(".")[0])

    return target


def _buffer(like: Tensor | None, item: TensorStorageMetadata) -> Tensor:
    """Where a stored tensor is read: this process's shard of a DTensor target (on its
    device, a meta one's too), else the whole tensor; a fused projection's strided shard
    (``_StridedShard``, no contiguous block of the tensor) is read whole and cut after."""
    dtype = item.properties.dtype
    if not isinstance(like, DTensor) or tuple(like.shape) != tuple(item.size) or any(
            isinstance(p, _StridedShard) for p in like.placements):
        return torch.empty(item.size, dtype=dtype)
    mesh = like.device_mesh
    local = torch.empty(like.to_local().shape, dtype=dtype, device=mesh.device_type)
    return DTensor.from_local(local, mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def load_checkpoint(
    path: str | os.PathLike[str],
    stage_modules: Mapping[int, nn.Module],
    spec: Mapping[str, TensorSpec],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    model: nn.Module | None = None,
    version_name: str | None = None,
) -> Any:
    """Load a checkpoint written by `save_checkpoint` at any layout into the stages held here
    (and `optimizer`, whose parameters `model` names); returns the saved `extra`. By default
    the live version; `version_name`: a retained older one (`files.versions`). Everything is
    checked, and this process's tensors read, before the stages or the optimizer change: a
    checkpoint of another model or optimizer is a ValueError and changes nothing. Under
    torch.distributed every process must call it."""
    version, meta = read_checkpoint(path, version_name)
    source = f"checkpoint {os.fspath(path)!r}"
    _check_model(source, meta, spec)
    try:
        stored = FileSystemReader(version).read_metadata().state_dict_metadata
    except Exception as err:
        raise ValueError(
            f"{source} is damaged: DCP's index {str(version / '.metadata')!r} cannot be read "
            f"({failure_reason(err)}). Nothing was loaded; restore the file, or load an older "
            "version"
        ) from None
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
    outer, inner = optimizer, None if optimizer is None else local_optimizer(optimizer)
    if inner is not None:
        if model is None:
            raise TypeError("loading optimizer state needs model= (to name its parameters)")
        names = _param_names(model, inner)
        opt_keys, flat = _optimizer_plan(
            source, meta, stored, inner, names, _held_names(stage_modules, names)
        )
        keys += opt_keys
    targets = _targets(stage_modules, model)
    buffers: dict[str, Any] = {}
    for key in keys:
        item = stored[key]
        if not isinstance(item, TensorStorageMetadata):
            raise ValueError(f"{source} holds {key!r} as bytes, not a tensor; it was damaged")
        buffers[key] = _buffer(targets(key), item)
    if buffers:
        _read(version, buffers, source)
    for key, value in buffers.items():  # a whole tensor read for a shard: cut it (the model's
        like = targets(key)  # are cut as they load, by load_state_dict)
        if key.startswith("optim.") and like is not None and like.shape == value.shape:
            buffers[key] = laid_out_as(like, value)
    # Everything is checked and read: change the stages, then the optimizer (whose state
    # takes its parameters' device: a meta model's get theirs as they load).
    state = {k[len("model."):]: v for k, v in buffers.items() if k.startswith("model.")}
    load_state_dict(stage_modules, state, spec, strict=False, source=source, model=model)
    if outer is not None and inner is not None and model is not None:
        flat.update({k[len("optim."):]: v for k, v in buffers.items() if k.startswith("optim.")})
        set_optimizer_state_dict(
            model, inner,
            _nested(flat, inner, names, _held_names(stage_modules, names)),
            options=NESTED,
        )
        hyperparameters_loaded(outer)
    return meta["extra"]
