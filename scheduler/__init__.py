"""Schedule IR, generators, validator and cost simulator. Pure Python: imports nothing of ours
and no torch."""

from scheduler.ir import Action, Op, Schedule
from scheduler.timeline import Event, Timeline

__all__ = ["Action", "Op", "Schedule", "Event", "Timeline"]
