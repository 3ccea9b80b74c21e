"""Models built on the meta device: give the tensors a process holds real storage on its
device and real values, from the modules' own initialisation, the same whatever the layout.

`materialize` allocates only the held meta tensors (the other stages' stay on meta, costing
nothing), fills floating ones with NaN, then runs the initialisation of every module with one
in its subtree (children before parents, as ``model.apply`` does: a parent may re-initialise
its children's weights, as Hugging Face's GPT-2 scales ``c_proj.weight``), each under torch's
RNG seeded from the seed and the module's qualified name: a parameter gets the same values at
any pipeline layout, and in one process. A tensor the initialisation left (partly) unwritten
is a ValueError naming it: never ``to_empty`` garbage. The meta tensor objects take the new
values in place (``torch.utils.swap_tensors``; partitioner.rebind), so the model, the stage
modules, the captured graph modules and an optimizer built from ``pipe.parameters()`` before
the first step all hold them. Where torch refuses the swap (a weak reference of the user's to a
parameter), the new tensor replaces the meta one in every module holding it, and an optimizer
step over the meta one is an error saying what to do (pipeline.execution.replaced). Only the
meta tensors are written: while a module's initialisation runs, the other tensors under it
(loaded from a state dict already) are stood in for by meta ones, so filling the
non-persistent buffers a checkpoint lacks (Hugging Face's rotary ``inv_freq``) leaves the
loaded weights alone. Loading a state dict into meta tensors keeps the objects the same way
(`fill_in_place`, a tensor-parallel shard's too).

A module whose initialisation draws random numbers for tensors on stages of different processes
would draw differently (the other process's meta tensors consume none); capture keeps a leaf
module's tensors in one unit (Linear, Embedding, and a transformer block by default), so only
an init drawing across such units (a root-level one) could depend on the layout.

A tensor-parallel shard (a meta DTensor: tensor_parallel= on a model built on meta) is
initialised whole, as in the unsplit model, then cut to this process's shard at once, so
it keeps only its own shards (the stage's whole tensors exist while its init runs).

`meta_tensors` names the meta tensors a process's stages still hold, for the check before a
step (pipeline.execution.executor)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from partitioner.rebind import rebind, swap_in
from pipeline.execution.replaced import replaced

InitFn = Callable[[nn.Module], Any]
INIT_DEFAULT = "reset_parameters"


def seed_for(seed: int, name: str) -> int:
    """A 63-bit seed from the run's seed and a qualified name (SHA-256; stable everywhere)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _reset(module: nn.Module) -> None:
    for method in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, method, None)
        if callable(fn):
            fn()
            return


def resolve_init(model: nn.Module, init_fn: InitFn | str | None) -> InitFn:
    """The per-module initialiser: `init_fn` itself, or for "reset_parameters" (and None) each
    module's ``reset_parameters()``; a Hugging Face model (one with ``_init_weights``, which
    it applies per module itself) uses that, so its rotary ``inv_freq`` is computed too."""
    if callable(init_fn):
        return init_fn
    if init_fn not in (None, INIT_DEFAULT):
        raise ValueError(
            f"init_fn={init_fn!r}: give a callable taking a module (e.g. "
            "model._init_weights) or 'reset_parameters'"
        )
    hf = getattr(model, "_init_weights", None)
    if callable(hf) and hasattr(model, "config"):
        return hf
    return _reset


def _post_order(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) children first, each module once (its first name)."""
    seen: set[int] = set()
    out: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        out.append((name, module))

    visit("", model)
    return out


def _direct(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    for field, t in [*module._parameters.items(), *module._buffers.items()]:
        if t is not None:
            yield field, t


def meta_tensors(model: nn.Module, modules: Iterable[nn.Module]) -> list[str]:
    """The model's names of the parameters and buffers on meta that `modules` hold."""
    held = {id(t) for m in modules for t in (*m.parameters(), *m.buffers()) if t.is_meta}
    return _names(model, held)


def _names(model: nn.Module, ids: set[int]) -> list[str]:
    found: dict[int, str] = {}
    for path, module in model.named_modules():
        for field, t in _direct(module):
            if id(t) in ids and id(t) not in found:
                found[id(t)] = f"{path}.{field}" if path else field
    return sorted(found.values())


def materialize(
    model: nn.Module,
    modules: Sequence[nn.Module],
    device: torch.device | Sequence[torch.device],
    *,
    init_fn: InitFn | str | None = None,
    seed: int = 0,
    holders: Sequence[nn.Module] = (),
) -> list[str]:
    """Give every meta parameter and buffer that `modules` hold storage on `device` (one for
    all, or one per module: a tensor two modules hold goes to the first's) and its initial
    values (see the module docstring); returns their names. The tensor objects are kept
    (their contents replaced in place) where torch allows it. `model` is the whole model they
    come from (it names the tensors and owns the modules to initialise); `holders`: other
    modules holding the same tensors (the captured graph modules), updated too."""
    init = resolve_init(model, init_fn)
    places = [device] * len(modules) if isinstance(device, torch.device) else list(device)
    olds: dict[int, Tensor] = {}
    fresh: dict[int, Tensor] = {}
    for module, place in zip(modules, places, strict=True):
        for t in (*module.parameters(), *module.buffers()):
            if t.is_meta and id(t) not in olds:
                olds[id(t)], fresh[id(t)] = t, _fresh(t, place)
    if not olds:
        return []
    holders = [model, *modules, *holders]
    shards: dict[int, DTensor] = {
        key: t for key, t in olds.items() if isinstance(t, DTensor)}
    plain = {key: t for key, t in olds.items() if key not in shards}
    made = _replace(holders, plain, fresh)
    rebind(holders, {key: fresh[key] for key in shards})  # whole while the init runs
    made += [fresh[key] for key in shards]
    targets = {id(t): t for t in made}
    versions = {key: t._version for key, t in targets.items()}
    below: dict[int, torch.device] = {}  # module id -> device of a target in its subtree
    for path, module in _post_order(model):
        owned = [t.device for _, t in _direct(module) if id(t) in targets]
        owned += [below[id(c)] for c in module.children() if id(c) in below]
        if owned:
            below[id(module)] = owned[0]
            with _seeded(seed_for(seed, path), owned[0]), torch.no_grad(), \
                    _only(module, targets):
                init(module)
    try:
        _check_written(model, targets, versions, init_fn)
    except ValueError:
        # Back on meta: nothing half-made is left, and a retry starts afresh.
        rebind(holders, {id(fresh[key]): t for key, t in shards.items()})
        _replace(holders, {id(t): t for t in made[:len(plain)]},
                 {id(t): _fresh(old, torch.device("meta"))
                  for t, old in zip(made, plain.values(), strict=False)})
        raise
    names = _names(model, set(targets))
    _cut(holders, shards, fresh)
    return names


def _cut(holders: Sequence[nn.Module], shards: Mapping[int, DTensor],
         wholes: Mapping[int, Tensor]) -> None:
    """Each tensor-parallel shard (a meta DTensor), initialised whole (`wholes`, by its id),
    cut to this process's shard and swapped into the DTensor object in place (an optimizer
    over it trains it); the whole value is then dropped."""
    back: dict[int, Tensor] = {}
    for key, old in shards.items():
        whole = wholes[key]
        value = distribute_tensor(whole.detach(), old.device_mesh, old.placements,
                                  src_data_rank=None)
        new = nn.Parameter(value, requires_grad=old.requires_grad) \
            if isinstance(old, nn.Parameter) else value
        if swap_in(old, new):
            back[id(whole)] = old
        else:
            back[id(whole)] = new
            replaced([old])
    rebind(holders, back)


def _replace(holders: Sequence[nn.Module], olds: dict[int, Tensor], news: dict[int, Tensor]
             ) -> list[Tensor]:
    """Each of `olds` replaced by its new tensor in `news` (same keys): in place where torch
    allows it (partitioner.rebind.swap_in: an optimizer built from the parameters trains the
    new values), else rebound in `holders`, and then an optimizer step over the old parameter
    raises (`replaced`). Returns the tensors now holding the new values, in `olds`' order."""
    unswapped = {key: news[key] for key, old in olds.items() if not swap_in(old, news[key])}
    rebind(holders, unswapped)
    replaced([old for key, old in olds.items() if key in unswapped])
    return [unswapped.get(key, old) for key, old in olds.items()]


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """torch's CPU RNG (and `device`'s, on CUDA) seeded with `seed` for the block, restored
    after it."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        if devices:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


@contextmanager
def _only(module: nn.Module, targets: dict[int, Tensor]) -> Iterator[None]:
    """While the block runs, the real tensors under `module` that are not `targets` are
    replaced by meta stand-ins (writes to them do nothing)."""
    kept: list[tuple[dict[str, Any], str, Tensor]] = []
    for sub in module.modules():
        owned: tuple[dict[str, Any], ...] = (sub._parameters, sub._buffers)
        for slots in owned:
            for field, t in slots.items():
                if t is not None and not t.is_meta and id(t) not in targets:
                    kept.append((slots, field, t))
                    slots[field] = _fresh(t, torch.device("meta"))
    try:
        yield
    finally:
        for slots, field, t in reversed(kept):
            slots[field] = t


def fill_in_place(tensors: Mapping[str, Tensor], values: Mapping[str, Tensor]) -> None:
    """The meta ones of `tensors` about to be loaded from `values` (by key) given storage in
    place, on the value's device and in its dtype (what loading with ``assign=True`` gives),
    so the objects stay those the model, its stages and an optimizer hold; loading then copies
    into them. One torch will not swap stays on meta (loading assigns a new one; see
    `_replace`)."""
    for key, t in tensors.items():
        value = values.get(key)
        if value is None or not t.is_meta:
            continue
        if isinstance(t, DTensor) and isinstance(value, DTensor):
            made = _fresh_shard(t, value)
        elif not isinstance(t, DTensor) and not isinstance(value, DTensor):
            made = _fresh(t, value.device, value.dtype)
        else:
            continue
        if not swap_in(t, made):
            replaced([t])


def _fresh_shard(t: DTensor, value: DTensor) -> Tensor:
    """A DTensor like `t` (a meta tensor-parallel shard: its mesh, placements and global
    shape) with a local shard of its own on `value`'s device, in `value`'s dtype."""
    local = torch.empty(value.to_local().shape, dtype=value.dtype, device=value.device)
    new: Tensor = DTensor.from_local(local, t.device_mesh, t.placements, run_check=False,
                                     shape=t.shape, stride=t.stride())
    if isinstance(t, nn.Parameter):
        new = nn.Parameter(new, requires_grad=t.requires_grad)
    return new


def _fresh(t: Tensor, device: torch.device, dtype: torch.dtype | None = None) -> Tensor:
    """A new tensor like `t` (its class, requires_grad and attributes) on `device` (in
    `dtype`, else `t`'s); floating ones filled with NaN, so what an init leaves unwritten
    shows."""
    new = torch.empty(t.shape, dtype=dtype or t.dtype, device=device)
    if new.is_floating_point() or new.is_complex():
        new.fill_(float("nan"))
    if isinstance(t, nn.Parameter):
        new = nn.Parameter(new, requires_grad=t.requires_grad)
    new.__dict__.update(t.__dict__)
    return new


def _check_written(
    model: nn.Module, targets: dict[int, Tensor], versions: dict[int, int],
    init_fn: InitFn | str | None,
) -> None:
    missing = set()
    for key, t in targets.items():
        if t.is_floating_point() or t.is_complex():
            if bool(torch.isnan(t).any()):
                missing.add(key)
        elif t._version == versions[key]:
            missing.add(key)
    if not missing:
        return
    names = _names(model, missing)
    how = "each module's reset_parameters()" if not callable(init_fn) else f"init_fn={init_fn!r}"
    raise ValueError(
        f"the model was built on the meta device and {how} left {len(names)} tensor(s) (partly) "
        f"uninitialised: {', '.join(names[:20])}{' ...' if len(names) > 20 else ''}; pass "
        "init_fn=... that writes them (a function called on each module that owns one, e.g. "
        "model._init_weights for a Hugging Face model), or load them with "
        "pipe.load_state_dict / pipe.load_checkpoint"
    )
