"""Schedule IR, generators, synthesis from costs, validator and cost simulator. Pure Python:
imports nothing of ours and no torch."""

from scheduler.generators import SCHEDULES, build_schedule
from scheduler.ir import Action, Op, Schedule
from scheduler.lowering import (
    Compute,
    Instruction,
    MessageKey,
    Recv,
    Send,
    consumer_stage,
    describe_message,
    forward_only,
    incoming,
    lower,
    producer,
    receive_order,
)
from scheduler.simulate import rank_costs_to_stages, simulate
from scheduler.synthesize import SYNTH, lower_bound, synthesize
from scheduler.timeline import Event, Timeline, format_amount, format_bytes
from scheduler.validate import validate

__all__ = [
    "Action",
    "Op",
    "Schedule",
    "Event",
    "Timeline",
    "format_amount",
    "format_bytes",
    "SCHEDULES",
    "build_schedule",
    "validate",
    "simulate",
    "synthesize",
    "SYNTH",
    "lower_bound",
    "rank_costs_to_stages",
    "lower",
    "receive_order",
    "Compute",
    "Send",
    "Recv",
    "Instruction",
    "MessageKey",
    "consumer_stage",
    "describe_message",
    "producer",
    "incoming",
    "forward_only",
]
