"""What the processes of a distributed job must share, as comparable text: the settings of
`Pipeline(...)` (stages, data_parallel, schedule and its text, microbatches, virtual stages,
loss weighting, a fingerprint of the model's parameter names and shapes) and the structure
and dtypes of each process's first batch; and the message naming every setting that differs,
its value on each rank and the fix. The distributed executor compares them at setup
(pipeline.execution.distributed.agreement); nothing here needs torch.distributed."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from scheduler import SCHEDULES, Schedule


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


def pipeline_settings(
    *,
    stages: int,
    data_parallel: int,
    schedule: object,
    built: Schedule | None,
    microbatches: int | str | None,
    virtual_stages: int | str | None,
    loss_fn: object,
    model: nn.Module,
    shard: str | None = None,
) -> dict[str, Setting | None]:
    """The settings of `Pipeline(...)` that every process must share. `schedule` is the
    argument as given, `built` the Schedule when it is known already."""
    named = isinstance(schedule, str) and (schedule in SCHEDULES or schedule == "auto")
    return {
        "stages": Setting(str(stages)),
        "data_parallel": Setting(str(data_parallel)),
        "schedule": Setting(repr(schedule) if named else "a custom Schedule"),
        "schedule text": None if built is None else schedule_setting(built),
        "microbatches": Setting(
            str(built.num_microbatches) if built is not None
            else "not given" if microbatches is None else str(microbatches)),
        "virtual_stages": Setting(  # as built where known, so a default equals its value
            str(built.virtual_stages) if built is not None
            else "default" if virtual_stages is None else str(virtual_stages)),
        "loss weighting": Setting(
            f"{_loss_text(loss_fn)}, each microbatch weighted by its share of the batch"),
        "model parameters": model_setting(model),
        "shard": Setting(repr(shard)),
    }


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
                     f"    fix: {FIXES.get(name, 'make it the same on every process')}")
    if not parts:
        return None
    return (f"the processes built their Pipelines with different settings (found at {what}, "
            "before any tensor moved):\n" + "\n".join(parts))
