"""The settings of `Pipeline(...)`: `PipelineSettings`, the one frozen record the planner and
the executor are built with (checked once, by pipeline.facade.arguments), and what the processes
of a distributed job must share, as comparable text: every field of that record that is not
this process's own (timeouts, devices), the schedule's text, the loss weighting, a fingerprint
of the model's parameter names and shapes, and the structure and dtypes of each process's
first batch; with the message naming every setting that differs, its value on each rank and
the fix. The executor's processes compare them at setup, through the agreement of its
`Coordination` (pipeline.planning.decision); nothing here needs torch.distributed."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from scheduler import SCHEDULES, Schedule

_OWN = {"per_process": True}  # a field each process may set for itself: not compared


SHARD_MODES = (None, "optimizer", "full")


def check_shard(shard: object) -> str | None:
    """`shard` if it is a mode; TypeError/ValueError naming the value and the modes."""
    if shard is not None and not isinstance(shard, str):
        raise TypeError(
            f"shard must be None, 'optimizer' or 'full', got {shard!r} "
            f"({type(shard).__name__})"
        )
    if shard not in SHARD_MODES:
        raise ValueError(
            f"shard={shard!r} is not a sharding mode; use shard=None (replicas keep everything), "
            "'optimizer' (ZeRO-1: the optimizer state is sharded over the replicas) or 'full' "
            "(FSDP2: parameters, gradients and optimizer state sharded)"
        )
    return shard


@dataclass(frozen=True)
class PipelineSettings:
    """Every setting of ``Pipeline(...)`` but the model, the loss and the data (their meaning
    is in the `Pipeline` docstring), as checked once by pipeline.facade.arguments: the planner
    and the executor are built with it and nothing is assigned into them afterwards. `stages`
    (and `tensor_parallel`) is "auto" until the layout is chosen (`laid_out`). `compile` is
    None (eager) or the torch.compile arguments; `tensor_parallel`, `tp_plan` and
    `sequence_parallel` are the width of each stage (docs/tensor-parallel.md)."""

    stages: int | str
    schedule: str | os.PathLike[str] | Schedule = "1f1b"
    microbatches: int | str | None = None
    virtual_stages: int | str | None = None
    balance: str | tuple[int, ...] = "profile"
    memory_limit: float | None = None
    checkpoint_activations: object = "none"
    data_parallel: int | None = None
    leaf_modules: tuple[type, ...] | None = None
    rebalance: bool = False
    capture_method: str = "auto"
    mixed_precision: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    dynamic_dims: tuple[int, ...] = ()
    grad_accumulation: str = "atomic"
    shard: str | None = None
    compile: Mapping[str, Any] | None = None
    tensor_parallel: int | str = 1
    tp_plan: Mapping[str, Any] | None = None
    sequence_parallel: bool = False
    devices: tuple[torch.device, ...] | None = field(default=None, metadata=_OWN)
    timeout: float = field(default=120.0, metadata=_OWN)
    compile_timeout: float = field(default=1800.0, metadata=_OWN)

    @property
    def ranks(self) -> int:
        """The pipeline ranks (`stages` once the layout is chosen)."""
        if not isinstance(self.stages, int):
            raise RuntimeError('stages="auto" has no layout yet: use PipelineSettings.laid_out')
        return self.stages

    @property
    def auto_activations(self) -> bool:
        """checkpoint_activations="auto": the planner chooses a policy per stage."""
        return self.checkpoint_activations == "auto"

    @property
    def tp_degree(self) -> int:
        """The tensor-parallel ranks per stage (`tensor_parallel` once the layout is chosen)."""
        if not isinstance(self.tensor_parallel, int):
            raise RuntimeError('tensor_parallel="auto" has no layout yet: use '
                               "PipelineSettings.laid_out")
        return self.tensor_parallel

    def laid_out(
        self, *, stages: int, data_parallel: int, schedule: str | Schedule, microbatches: int,
        virtual_stages: int, tensor_parallel: int | None = None,
    ) -> PipelineSettings:
        """These settings with the layout stages="auto" (or tensor_parallel="auto") chose for
        the world; sequence parallelism only where the chosen tp splits anything."""
        tp = self.tensor_parallel if tensor_parallel is None else tensor_parallel
        return dataclasses.replace(
            self, stages=stages, data_parallel=data_parallel, schedule=schedule,
            microbatches=microbatches, virtual_stages=virtual_stages, tensor_parallel=tp,
            sequence_parallel=self.sequence_parallel and tp != 1,
            tp_plan=self.tp_plan if tp != 1 else None,
        )


@dataclass(frozen=True)
class Setting:
    """One compared setting: `text` is compared and shown; `lines` (a schedule's text, a
    parameter list) locate the first difference."""

    text: str
    lines: tuple[str, ...] = ()


Settings = Mapping[str, Setting | None]  # None: not known on this process, not compared

FIXES: dict[str, str] = {
    "stages": "pass the same stages=... to Pipeline on every process",
    "data_parallel": "pass the same data_parallel=... on every process, or none anywhere "
    "(it defaults to world size // stages)",
    "schedule": "pass the same schedule=... on every process",
    "schedule text": "give every process the same schedule: copy the same schedule file to "
    "every node, or build the same Schedule (and run the same code version everywhere)",
    "microbatches": "pass the same microbatches=... on every process, or none anywhere "
    "(global rank 0 then picks it from its first batch)",
    "virtual_stages": "pass the same virtual_stages=... on every process",
    "loss weighting": "pass the same loss_fn (same class and reduction) on every process: "
    "each replica's loss and gradients are averaged with equal weight",
    "input dtypes": "give every process inputs of the same structure and dtypes (the same "
    "data pipeline and collate function everywhere)",
    "model parameters": "build the same model (same code and config) on every process",
    "shard": "pass the same shard=... (None, 'optimizer' or 'full') on every process",
    "train/eval mode": "call pipe.train() / pipe.eval() (or model.train() / model.eval()) at the "
    "same point of the loop on every process",
}


# ---------------------------------------------------------------------------------------------
# What is compared
# ---------------------------------------------------------------------------------------------


def _loss_text(loss_fn: object) -> str:
    if loss_fn is None:
        return "none (forward only)"
    if isinstance(loss_fn, nn.Module):
        reduction = getattr(loss_fn, "reduction", None)
        name = type(loss_fn).__qualname__
        return name if reduction is None else f"{name}(reduction={reduction!r})"
    fn = getattr(loss_fn, "func", loss_fn)  # functools.partial
    name = getattr(fn, "__qualname__", type(fn).__qualname__)
    return f"{getattr(fn, '__module__', '?')}.{name}"


def schedule_setting(schedule: Schedule) -> Setting:
    text = schedule.to_text()
    digest = hashlib.blake2b(text.encode(), digest_size=6).hexdigest()
    actions = sum(len(a) for a in schedule.actions)
    return Setting(f"{schedule.name!r}: {actions} actions, digest {digest}",
                   tuple(text.splitlines()))


def model_setting(model: nn.Module) -> Setting:
    lines = tuple(f"{k} {tuple(p.shape)} {p.dtype}" for k, p in model.named_parameters())
    digest = hashlib.blake2b("\n".join(lines).encode(), digest_size=6).hexdigest()
    numel = sum(p.numel() for p in model.parameters())
    return Setting(f"{len(lines)} tensors, {numel:,} values, digest {digest}", lines)


def _text(value: object) -> str:
    """A setting as text that is the same on every process that set the same value (never an
    object's address)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, Tensor)):
        return str(value) if isinstance(value, torch.dtype) else repr(value)
    if isinstance(value, os.PathLike):
        return repr(os.fspath(value))
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {_text(v)}" for k, v in sorted(
            value.items(), key=lambda kv: str(kv[0]))) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    if dataclasses.is_dataclass(value):
        return repr(value)
    named = value if isinstance(value, type) or callable(value) else type(value)
    return f"{getattr(named, '__module__', '?')}.{getattr(named, '__qualname__', '?')}"


def compared_settings(
    settings: PipelineSettings, *, data_parallel: int, built: Schedule | None,
    loss_fn: object, model: nn.Module,
) -> dict[str, Setting | None]:
    """What every process must share of `settings` (each field but a process's own; the
    schedule as named, with its text where `built` is known; `data_parallel` as resolved),
    with the loss weighting and the model's fingerprint."""
    schedule = settings.schedule
    named = isinstance(schedule, str) and (schedule in SCHEDULES or schedule == "auto")
    compared: dict[str, Setting | None] = {
        "stages": Setting(str(settings.stages)),
        "data_parallel": Setting(str(data_parallel)),
        "schedule": Setting(repr(schedule) if named else "a custom Schedule"),
        "schedule text": None if built is None else schedule_setting(built),
        "microbatches": Setting(
            str(built.num_microbatches) if built is not None
            else "not given" if settings.microbatches is None else str(settings.microbatches)),
        "virtual_stages": Setting(  # as built where known, so a default equals its value
            str(built.virtual_stages) if built is not None
            else "default" if settings.virtual_stages is None else str(settings.virtual_stages)),
        "loss weighting": Setting(
            f"{_loss_text(loss_fn)}, each microbatch weighted by its share of the batch"),
        "model parameters": model_setting(model),
        "shard": Setting(repr(settings.shard)),
    }
    for f in dataclasses.fields(settings):
        if f.name not in compared and not f.metadata.get("per_process"):
            compared[f.name] = Setting(_text(getattr(settings, f.name)))
    return compared


def _structure(value: object) -> str:
    if isinstance(value, Tensor):
        return str(value.dtype).removeprefix("torch.")
    if isinstance(value, tuple):
        inner = ", ".join(_structure(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(_structure(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_structure(v)}" for k, v in value.items()) + "}"
    return type(value).__name__


def mode_setting(model: nn.Module) -> Setting:
    """The train/eval mode of every module (the modules in train mode listed by name)."""
    training = [name or "(the model)" for name, m in model.named_modules() if m.training]
    count = sum(1 for _ in model.modules())
    text = ("train" if len(training) == count else "eval" if not training
            else f"{len(training)} of {count} modules in train mode")
    return Setting(text, tuple(training))


def input_settings(args: tuple[Any, ...] | None) -> dict[str, Setting | None]:
    """The structure and dtypes of this process's inputs (not compared where there are none)."""
    return {"input dtypes": None if args is None else Setting(_structure(args))}


# ---------------------------------------------------------------------------------------------
# The message
# ---------------------------------------------------------------------------------------------


def _ranks(ranks: Sequence[int]) -> str:
    """'rank 3' / 'ranks 0, 2-5'."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][-1] == r - 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def _first_difference(a: Setting, ra: int, b: Setting, rb: int) -> str:
    for i in range(max(len(a.lines), len(b.lines))):
        la = a.lines[i] if i < len(a.lines) else "(none)"
        lb = b.lines[i] if i < len(b.lines) else "(none)"
        if la != lb:
            return f"\n    first difference, line {i + 1}: {la!r} on rank {ra}, {lb!r} on rank {rb}"
    return ""


def mismatch_message(what: str, per_rank: Sequence[Settings]) -> str | None:
    """None if every setting known on two or more ranks has one value; else one message naming
    each differing setting, its value on each rank and the fix."""
    names = list(dict.fromkeys(name for settings in per_rank for name in settings))
    parts = []
    for name in names:
        fix = FIXES.get(name, f"pass the same {name}=... to Pipeline on every process")
        known = {r: v for r, s in enumerate(per_rank) if (v := s.get(name)) is not None}
        groups: dict[str, list[int]] = {}
        for r, setting in known.items():
            groups.setdefault(setting.text, []).append(r)
        if len(groups) < 2:
            continue
        values = "; ".join(f"{text} on {_ranks(ranks)}" for text, ranks in groups.items())
        (ra, *_), (rb, *_) = list(groups.values())[:2]
        diff = _first_difference(known[ra], ra, known[rb], rb)
        parts.append(f"  {name}: {values}{diff}\n"
                     f"    fix: {fix}")
    if not parts:
        return None
    return (f"the processes built their Pipelines with different settings (found at {what}, "
            "before any tensor moved):\n" + "\n".join(parts))
