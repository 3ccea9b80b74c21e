"""The schedule IR: `Action` (one compute step of one stage on one microbatch) and `Schedule`
(each rank's ordered Actions plus the stage->rank placement), with a text form that round-trips."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum


class Op(str, Enum):
    """What an Action computes.

    F: forward of one stage on one microbatch (the last stage also computes the loss).
    B: backward. In schedules that split backward it computes the input gradient only;
       otherwise it is the full backward (input and weight gradients).
    W: weight gradient of a split backward; pairs with the B of the same stage and microbatch.
    """

    F = "F"
    B = "B"
    W = "W"

    def __str__(self) -> str:
        return self.value


_ACTION_RE = re.compile(r"^\s*(\d+)\s*([FBW])\s*(\d+)\s*$")


@dataclass(frozen=True, order=True)
class Action:
    """One compute step: `stage` runs `op` on `microbatch`. Text form: "2F0"."""

    stage: int
    op: Op
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the text form, e.g. ``Action.parse("2F0") == Action(2, Op.F, 0)``."""
        match = _ACTION_RE.match(text)
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected <stage><F|B|W><microbatch>, e.g. '2F0'"
            )
        return cls(int(match.group(1)), Op(match.group(2)), int(match.group(3)))


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered Actions for one training step.

    `placement[s]` is the rank that runs stage `s`; `num_stages` = ranks x virtual stages per
    rank. `splits_backward` says whether B is input-grad only (a W follows for each B).
    Communication is not part of the schedule: `scheduler.lowering.lower` derives it.
    """

    num_ranks: int
    num_stages: int
    num_microbatches: int
    placement: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    splits_backward: bool
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        if len(self.placement) != self.num_stages:
            raise ValueError(
                f"placement has {len(self.placement)} entries for {self.num_stages} stages; "
                "give one rank per stage"
            )
        if len(self.actions) != self.num_ranks:
            raise ValueError(
                f"actions has {len(self.actions)} rank lists for {self.num_ranks} ranks; "
                "give one list per rank (an empty list is allowed)"
            )

    @property
    def virtual_stages(self) -> int:
        """Model chunks (stages) per rank."""
        return self.num_stages // self.num_ranks

    def stages_of(self, rank: int) -> list[int]:
        """The stages placed on `rank`, in increasing order."""
        return [s for s, r in enumerate(self.placement) if r == rank]

    def to_text(self) -> str:
        """One line per rank, actions separated by spaces (e.g. "0F0 0F1 0B0 0B1")."""
        return "\n".join(" ".join(str(a) for a in rank_actions) for rank_actions in self.actions)

    @classmethod
    def from_text(cls, text: str, name: str = "custom") -> Schedule:
        """Build a Schedule from `to_text()` output (or a hand-written file of that form).

        Ranks are lines; the placement is where each stage's actions stand; stage and
        microbatch counts are the largest indices + 1; backward is split if any W appears.
        Lines starting with '#' are comments. Call `scheduler.validate` before running it.
        """
        lines = [ln for ln in text.strip().splitlines() if not ln.lstrip().startswith("#")]
        if not lines:
            raise ValueError("schedule text is empty: give one line of actions per rank")
        actions = tuple(tuple(Action.parse(tok) for tok in ln.split()) for ln in lines)
        return cls.from_actions(actions, name=name)

    @classmethod
    def from_actions(
        cls, actions: Sequence[Iterable[Action]], name: str = "custom"
    ) -> Schedule:
        """Build a Schedule from per-rank action lists, inferring sizes and placement."""
        per_rank = tuple(tuple(rank_actions) for rank_actions in actions)
        every = [a for rank_actions in per_rank for a in rank_actions]
        if not every:
            raise ValueError("schedule has no actions: give at least one action per stage")
        num_stages = max(a.stage for a in every) + 1
        num_microbatches = max(a.microbatch for a in every) + 1
        where: dict[int, int] = {}
        for rank, rank_actions in enumerate(per_rank):
            for a in rank_actions:
                if where.setdefault(a.stage, rank) != rank:
                    raise ValueError(
                        f"stage {a.stage} has actions on rank {where[a.stage]} and rank {rank} "
                        f"(at {a}); each stage must run on exactly one rank"
                    )
        missing = [s for s in range(num_stages) if s not in where]
        if missing:
            raise ValueError(f"stages {missing} have no actions; every stage needs its actions")
        return cls(
            num_ranks=len(per_rank),
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            placement=tuple(where[s] for s in range(num_stages)),
            actions=per_rank,
            splits_backward=any(a.op is Op.W for a in every),
            name=name,
        )
