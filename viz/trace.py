"""Export a Timeline as a Chrome / Perfetto trace (the Trace Event Format's JSON object form):
one process per rank, one complete ("X") event per Event, times in microseconds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scheduler import Timeline
from viz.style import OP_NAMES


def to_chrome_trace(
    timeline: Timeline, path: str | Path | None = None, *, seconds_per_unit: float = 1.0
) -> dict[str, Any]:
    """The trace as a JSON-able dict; also written to `path` when given.

    Event times are multiplied by `seconds_per_unit` to get seconds (1.0 for measured
    timelines, which are in seconds; for simulated timelines in cost units it sets how long a
    unit looks), then written relative to the step's first event in microseconds. Each event's
    args carry stage, op and microbatch; `otherData` carries the step figures. Open the file in
    https://ui.perfetto.dev or chrome://tracing.
    """
    if not isinstance(timeline, Timeline):
        raise TypeError(
            f"to_chrome_trace needs a scheduler.Timeline, got {type(timeline).__name__}"
        )
    if not seconds_per_unit > 0:
        raise ValueError(f"seconds_per_unit must be positive, got {seconds_per_unit!r}")
    us = 1e6 * seconds_per_unit
    t0 = min((e.start for e in timeline.events), default=0.0)
    events: list[dict[str, Any]] = []
    for rank in range(timeline.num_ranks):
        events.append(_meta("process_name", rank, {"name": f"rank {rank}"}))
        events.append(_meta("process_sort_index", rank, {"sort_index": rank}))
        events.append(_meta("thread_name", rank, {"name": "compute"}))
    for e in sorted(timeline.events, key=lambda e: (e.rank, e.start)):
        events.append(
            {
                "name": f"{e.op.value}{e.microbatch} (stage {e.stage})",
                "cat": OP_NAMES[e.op],
                "ph": "X",
                "ts": round((e.start - t0) * us, 3),
                "dur": round(e.duration * us, 3),
                "pid": e.rank,
                "tid": 0,
                "args": {"stage": e.stage, "op": e.op.value, "microbatch": e.microbatch},
            }
        )
    trace: dict[str, Any] = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "schedule": timeline.name,
            "step_time_s": timeline.step_time * seconds_per_unit,
            "bubble_fraction": timeline.bubble_fraction,
            "peak_inflight": list(timeline.peak_inflight),
        },
    }
    if path is not None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(trace, indent=1))
    return trace


def _meta(name: str, pid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": 0, "args": args}
