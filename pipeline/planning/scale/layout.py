"""What one planned configuration is: a `Layout` (tensor, pipeline degrees, microbatches,
chunks, schedule, recompute, ZeRO, sequence parallelism) for a `Job` (a transformer spec on
a target, world size, global batch, precision), parsed from the CLI's --layout text, and
the checks that it fits the job (dp = world / (tp x pp), the batch split into dp x m
microbatches of whole sequences, tp inside a node)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from pipeline.planning.hardware.targets import Target
from pipeline.planning.scale.graph import GraphSpec
from pipeline.planning.scale.transformer import TransformerSpec
from scheduler import SCHEDULES
from scheduler.synthesize import SYNTH

RECOMPUTE = ("none", "selective", "full")
ZERO = ("none", "zero1", "fsdp")


@dataclass(frozen=True)
class Layout:
    """One configuration. `schedule` is a registered generator's name or "synth" (searched
    for this layout's costs); `zero`: "none" (all-reduce), "zero1" (optimizer state sharded
    over dp: reduce-scatter, update a shard, all-gather) or "fsdp" (FSDP2 per stage, kept
    unsharded through the step as pipeline stages are)."""

    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    virtual_stages: int = 1
    schedule: str = "1f1b"
    recompute: str = "none"
    zero: str = "none"
    sequence_parallel: bool = True

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "microbatches", "virtual_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"layout {name} must be >= 1, got {getattr(self, name)}")
        if self.schedule not in SCHEDULES and self.schedule != SYNTH:
            raise ValueError(f"layout schedule {self.schedule!r}: use one of "
                             f"{[*sorted(SCHEDULES), SYNTH]}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"layout recompute {self.recompute!r}: use one of {RECOMPUTE}")
        if self.zero not in ZERO:
            raise ValueError(f"layout zero {self.zero!r}: use one of {ZERO}")

    def describe(self) -> str:
        sp = ",sp" if self.sequence_parallel and self.tp > 1 else ""
        return (f"tp={self.tp},pp={self.pp},m={self.microbatches},v={self.virtual_stages},"
                f"{self.schedule},{self.recompute},{self.zero}{sp}")


_ALIASES = {"m": "microbatches", "v": "virtual_stages", "sp": "sequence_parallel",
            "sequence_parallel": "sequence_parallel"}


def parse_layout(text: str) -> Layout:
    """A `Layout` from "tp=8,pp=4,microbatches=28,virtual_stages=3,schedule=interleaved-1f1b,
    recompute=full[,zero=zero1,sp=0]" (m and v are accepted for the counts)."""
    known = {f.name for f in fields(Layout)}
    values: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = item.partition("=")
        key = _ALIASES.get(key, key)
        if not eq or key not in known:
            raise ValueError(f"--layout item {item!r}: give key=value with keys "
                             f"{', '.join(sorted(known))}")
        if key in ("schedule", "recompute", "zero"):
            values[key] = value
        elif key == "sequence_parallel":
            values[key] = value.lower() in ("1", "true", "yes", "on")
        else:
            try:
                values[key] = int(value)
            except ValueError:
                raise ValueError(f"--layout {key}={value!r} is not an integer") from None
    return Layout(**values)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Job:
    """What is planned: `spec` (a family by size, or a captured graph's priced units)
    trained on `world_size` devices of `target` with `batch_size` sequences per step in
    `precision` ("bf16"/"fp16": mixed precision with fp32 master weights; "fp32")."""

    spec: TransformerSpec | GraphSpec
    target: Target
    world_size: int
    batch_size: int
    precision: str = "bf16"

    @property
    def gpus_per_node(self) -> int:
        return self.target.network.gpus_per_node


def fit(job: Job, layout: Layout) -> tuple[int, int]:
    """(dp, microbatch size) of `layout` for `job`; ValueError saying why it does not fit."""
    tp, pp, m, v = layout.tp, layout.pp, layout.microbatches, layout.virtual_stages
    if job.world_size % (tp * pp):
        raise ValueError(f"tp x pp = {tp * pp} does not divide world size {job.world_size}")
    if tp > job.gpus_per_node:
        raise ValueError(f"tp={tp} spans nodes of {job.gpus_per_node} GPUs; keep tp <= "
                         f"{job.gpus_per_node}")
    job.spec.check_tp(tp)
    if isinstance(job.spec, GraphSpec) and layout.recompute != "none":
        raise ValueError(f"recompute={layout.recompute} is priced for the gpt:/llama: "
                         "families only; use recompute=none")
    dp = job.world_size // (tp * pp)
    if job.batch_size % (dp * m):
        raise ValueError(f"batch {job.batch_size} does not split into dp={dp} x "
                         f"microbatches={m} equal microbatches")
    if pp * v > job.spec.layers + 2:
        raise ValueError(f"pp x v = {pp * v} stages exceed the {job.spec.layers + 2} units "
                         "(embedding, blocks, head)")
    return dp, job.batch_size // (dp * m)
