"""The ``schedule=`` setting when it is not a schedule's name: a `scheduler.Schedule`, or the
path of a schedule text file (one line of actions per rank, as `Schedule.to_text` writes),
loaded (`load_custom`), then checked against the other settings and validated
(`checked_custom`) before anything runs."""

from __future__ import annotations

import os
from pathlib import Path

from scheduler import SCHEDULES, Schedule, validate

AUTO = "auto"


def load_custom(spec: object) -> Schedule | None:
    """The custom schedule `spec` gives (a Schedule, or one read from a text file), None for
    a registered schedule's name or "auto"; a ValueError or TypeError naming the fix for
    anything else."""
    if isinstance(spec, Schedule):
        return spec
    if isinstance(spec, str) and (spec in SCHEDULES or spec == AUTO):
        return None
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec)
        if path.is_file():
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"schedule file {str(spec)!r} is not text (byte {err.start} is "
                    f"{err.object[err.start:err.start + 1]!r}, not UTF-8); give a text file "
                    "with one line of actions per rank, e.g. written by Schedule.to_text()"
                ) from None
            return Schedule.from_text(text, name=path.stem)
        raise ValueError(
            f"schedule {str(spec)!r} is neither a known schedule nor a file; choose one of "
            f"{sorted(SCHEDULES)}, pass a scheduler.Schedule, or a schedule text file's path"
        )
    raise TypeError(
        f"schedule must be a name, a path or a scheduler.Schedule, got {type(spec).__name__}"
    )


def checked_custom(schedule: Schedule, ranks: int, microbatches: int | None,
                   virtual_stages: int | None) -> Schedule:
    """`schedule` checked against the settings (`ranks` pipeline ranks, `microbatches` and
    `virtual_stages` when given) and validated."""
    if schedule.num_ranks != ranks:
        raise ValueError(
            f"schedule {schedule.name!r} has {schedule.num_ranks} ranks but stages="
            f"{ranks}; make them equal"
        )
    if microbatches not in (None, schedule.num_microbatches):
        raise ValueError(
            f"schedule {schedule.name!r} runs {schedule.num_microbatches} microbatches but "
            f"microbatches={microbatches}; drop microbatches or make them equal"
        )
    if virtual_stages not in (None, schedule.virtual_stages):
        raise ValueError(
            f"schedule {schedule.name!r} has {schedule.virtual_stages} stages per rank but "
            f"virtual_stages={virtual_stages}; drop virtual_stages or make them equal"
        )
    if schedule.num_stages % schedule.num_ranks:
        raise ValueError(
            f"schedule {schedule.name!r} has {schedule.num_stages} stages on "
            f"{schedule.num_ranks} ranks; give every rank the same number of stages"
        )
    validate(schedule)
    return schedule
