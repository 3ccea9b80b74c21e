"""Memory per GPU of one layout, per pipeline rank:

- parameters, gradients and optimizer state (Rajbhandari et al., ZeRO, SC20): mixed
  precision keeps a 16-bit weight (2 bytes), a 16-bit gradient (2) and fp32 master weight,
  momentum and variance (12); fp32 keeps 4 + 4 + 8. ZeRO-1 shards the optimizer state over
  the dp replicas. FSDP2 shards all three; without a pipeline (pp=1) it reshards after each
  unit's forward (ZeRO-3: only the unit running and the one prefetched are gathered, with
  their gradients), while per pipeline stage (torchtitan keeps stages unsharded through
  the step: reshard_after_forward off) it holds the gathered weights and the unsharded
  gradients during the step;
- the activations the rank's stages hold for the schedule's in-flight microbatches
  (scheduler.simulate.peak_held: 1F1B's first rank holds p);
- the recompute working set (one block's activations while it is redone);
- communication buffers: the p2p send and receive of the largest boundary, and two
  25 MiB gradient buckets under data parallelism (torch DDP's bucket_cap_mb default).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pipeline.planning.scale.layout import Job, Layout
from pipeline.planning.scale.stages import StageCosts
from scheduler import Schedule
from scheduler.simulate import peak_held

BUCKET = 25 * 2**20


def param_bytes(precision: str) -> int:
    """Bytes of one weight (and of its gradient) in `precision`."""
    return 4 if precision == "fp32" else 2


@dataclass(frozen=True)
class Memory:
    """One pipeline rank's bytes per GPU by part."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    recompute: float
    buffers: float

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer + self.activations
                + self.recompute + self.buffers)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}


def state(params: float, precision: str, zero: str, dp: int, reshard: bool = False
          ) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes of `params` parameters (`reshard`: FSDP
    resharding after forward, all three sharded)."""
    pb = param_bytes(precision)
    kept = 8 if precision == "fp32" else 12
    if zero == "fsdp" and reshard:
        return params * pb / dp, params * pb / dp, params * kept / dp
    if zero == "zero1":
        return params * pb, params * pb, params * kept / dp
    if zero == "fsdp":
        return params * pb * (1 + 1 / dp), params * pb, params * kept / dp
    return params * pb, params * pb, params * kept


def zero3(layout: Layout) -> bool:
    """Whether FSDP reshards after forward (no pipeline: ZeRO-3 per unit)."""
    return layout.zero == "fsdp" and layout.pp == 1


def memory_per_rank(job: Job, layout: Layout, costs: StageCosts, schedule: Schedule,
                    dp: int) -> list[Memory]:
    """Each pipeline rank's `Memory` at its peak."""
    held = peak_held(schedule, costs.held)
    out = []
    for rank in range(schedule.num_ranks):
        stages = schedule.stages_of(rank)
        params = sum(costs.parameters[s] for s in stages)
        reshard = zero3(layout)
        weights, grads, optimizer = state(params, job.precision, layout.zero, dp, reshard)
        buffers = 2 * max(costs.boundary[s] for s in stages) + (2 * BUCKET if dp > 1 else 0)
        if reshard:  # the unit running and the one prefetched, weights and gradients
            buffers += 2 * 2 * max(costs.largest_unit[s] for s in stages) * param_bytes(
                job.precision)
        out.append(Memory(weights, grads, optimizer, held[rank],
                          max(costs.working[s] for s in stages), buffers))
    return out
