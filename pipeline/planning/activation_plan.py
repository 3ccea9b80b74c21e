"""The price of each activation policy per stage, and the per-stage choice behind
``checkpoint_activations="auto"``: for every rank, the cheapest policies (least time added to
its forwards and backwards) that keep the rank's peak (parameters x optimizer factor + the
held activations, at the peak the schedule's action order makes) under the memory limit.

Prices come from the units' measurements (`PolicyCosts`, partitioner.activation_cost) summed
over a stage:
- "none": keeps ``kept["none"]`` bytes per microbatch, adds nothing;
- "full": keeps ``kept["full"]`` (block inputs), adds ``added["full"]`` x (F + B) to B (the
  recomputation and the checkpoint's own work, measured);
- "selective": keeps ``kept["selective"]``, adds ``added["selective"]`` x (F + B) to B (the
  partial recomputation and the caching of the saved ops' outputs, measured);
- "offload": keeps nothing on the device, adds the copy out to F and the copy back to B
  (``offload_time`` each way); on a CPU device (no ``offload_time``) it is "none".
Under a split-backward schedule a recomputing stage's B recomputes and takes the input grads,
its W the weight grads from what B computed (pipeline.execution.activations.graph: nothing is
recomputed twice), which B keeps for W (``held_to_w``). Peaks
count a microbatch's activations from its F to its last backward (B, or W under a split
backward), and what its B keeps for its W from B to W."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

from partitioner import Plan, PolicyCosts, UnitCosts
from pipeline.planning.activation_policies import FULL, NONE, OFFLOAD, POLICIES, SELECTIVE
from scheduler import Op, Schedule

RECOMPUTING = (FULL, SELECTIVE)


@dataclass(frozen=True)
class PolicyPrices:
    """Per policy name, per stage, for one microbatch: bytes kept for the backward, and
    seconds added to the forward and to the backward."""

    kept: dict[str, list[float]]
    forward: dict[str, list[float]]
    backward: dict[str, list[float]]
    # Bytes a split backward's B keeps for its W on top (the recomputing policies').
    held_to_w: dict[str, list[float]] = field(default_factory=dict)

    def scaled(self, factor: float) -> PolicyPrices:
        """For a microbatch `factor` times the measured one (bytes and times linear)."""
        def times(d: dict[str, list[float]]) -> dict[str, list[float]]:
            return {k: [x * factor for x in v] for k, v in d.items()}
        return PolicyPrices(times(self.kept), times(self.forward), times(self.backward),
                            times(self.held_to_w))

    def held(self, policies: Sequence[str]) -> list[float]:
        """Per stage, what its policy's B keeps for its W (0 where not priced)."""
        return [self.held_to_w[p][s] if p in self.held_to_w else 0.0
                for s, p in enumerate(policies)]

    def at_speed(self, factors: Sequence[float]) -> PolicyPrices:
        """With the recomputing policies' times scaled per stage by `factors` (a stage's
        measured compute over its profiled one: recomputation is compute, and runs as fast
        as the stage does; the copies of "offload" are not)."""
        def times(d: dict[str, list[float]]) -> dict[str, list[float]]:
            return {k: [x * f for x, f in zip(v, factors, strict=True)]
                    if k in RECOMPUTING else list(v) for k, v in d.items()}
        return PolicyPrices(dict(self.kept), times(self.forward), times(self.backward),
                            dict(self.held_to_w))


def priced(costs: Mapping[str, UnitCosts], stages: Sequence[Sequence[str]]
           ) -> PolicyPrices | None:
    """The prices of `stages` (unit names per stage) from the units' `costs` once priced
    (partitioner.activation_cost) and profiled; None before."""
    units = [v for stage in stages for v in stage]
    if not units or not all(v in costs and costs[v].policies is not None for v in units):
        return None
    unit = {v: (costs[v], cast(PolicyCosts, costs[v].policies)) for v in units}

    def shared(stage: Sequence[str]) -> float:  # values several blocks read: once a stage
        reads: dict[str, float] = {}
        for v in stage:
            reads.update(unit[v][1].shared_reads)
        return float(sum(reads.values()))

    def kept(policy: str) -> list[float]:  # a later stage's inputs a gradient reaches need it
        return [float(sum(unit[v][1].kept[policy] for v in s)) if k == 0
                else float(sum(unit[v][1].kept_later[policy] for v in s)) + shared(s)
                for k, s in enumerate(stages)]

    def added(stage: Sequence[str], policy: str) -> float:
        return float(sum((c.forward + c.backward) * p.added[policy]
                         for c, p in (unit[v] for v in stage)))

    def offload(stage: Sequence[str]) -> float:
        return float(sum(unit[v][1].offload_time or 0.0 for v in stage))

    zero = [0.0] * len(stages)
    on_host = all(p.offload_time is None for _, p in unit.values())  # a CPU device
    moved = zero if on_host else [offload(s) for s in stages]
    kept_none = kept(NONE)
    return PolicyPrices(
        kept={NONE: kept_none, FULL: kept(FULL), SELECTIVE: kept(SELECTIVE),
              OFFLOAD: list(kept_none) if on_host else list(zero)},
        forward={NONE: list(zero), FULL: list(zero), SELECTIVE: list(zero), OFFLOAD: moved},
        backward={NONE: list(zero), FULL: [added(s, FULL) for s in stages],
                  SELECTIVE: [added(s, SELECTIVE) for s in stages], OFFLOAD: moved},
        held_to_w={p: [float(sum(unit[v][1].held_to_w[p] for v in s)) for s in stages]
                   for p in RECOMPUTING},
    )


def rank_peak(schedule: Schedule, rank: int, kept: Sequence[float],
              held: Sequence[float] = ()) -> float:
    """The rank's peak held activation bytes: a microbatch's `kept[stage]` from its F to its
    backward (B, or W under a split backward: the graph a B leaves for its W holds them),
    and under a split backward `held[stage]` (what its B keeps for its W) from B to W."""
    held = list(held) or [0.0] * len(kept)
    now = peak = 0.0
    for a in schedule.actions[rank]:
        if a.op is Op.F:
            now += kept[a.stage]
        elif a.op is Op.B and schedule.splits_backward:
            now += held[a.stage]
        elif a.op is Op.B:
            now -= kept[a.stage]
        elif a.op is Op.W:
            now -= kept[a.stage] + held[a.stage]
        peak = max(peak, now)
    return peak


def peaks(schedule: Schedule, prices: PolicyPrices, policies: Sequence[str]) -> list[float]:
    """Each rank's peak held activation bytes under `policies` (one name per stage)."""
    kept = [prices.kept[p][s] for s, p in enumerate(policies)]
    held = prices.held(policies)
    return [rank_peak(schedule, r, kept, held) for r in range(schedule.num_ranks)]


@dataclass(frozen=True)
class ActivationChoice:
    """The policy per stage and each rank's predicted peak of held activation bytes."""

    policies: tuple[str, ...]
    peaks: tuple[float, ...]


def choose(schedule: Schedule, prices: PolicyPrices, fixed: Sequence[float],
           limit: float | None, *, cheapest: bool = True) -> ActivationChoice | None:
    """Per rank, the policies of its stages adding the least time whose peak plus the rank's
    `fixed` bytes (parameters x optimizer factor) fits `limit` (no limit: "none"
    everywhere); None when some rank fits under no combination. With `cheapest=False`, the
    policies of the smallest peak instead (what a rank needs at least)."""
    policies = [NONE] * schedule.num_stages
    peaks_: list[float] = []
    m = schedule.num_microbatches
    for rank in range(schedule.num_ranks):
        stages = schedule.stages_of(rank)
        best: tuple[float, float, tuple[str, ...]] | None = None
        for combo in itertools.product(POLICIES, repeat=len(stages)):
            trial = list(policies)
            for s, p in zip(stages, combo, strict=True):
                trial[s] = p
            peak = rank_peak(schedule, rank, [prices.kept[p][s] for s, p in enumerate(trial)],
                             prices.held(trial))
            if limit is not None and peak + fixed[rank] > limit:
                continue
            added = m * sum(prices.forward[p][s] + prices.backward[p][s]
                            for s, p in zip(stages, combo, strict=True))
            key = (added, peak) if cheapest else (peak, added)
            if best is None or key < best[:2]:
                best = (*key, combo)
            if limit is None and cheapest:
                break  # "none" first: nothing to save
        if best is None:
            return None
        for s, p in zip(stages, best[2], strict=True):
            policies[s] = p
        peaks_.append(best[1] if cheapest else best[0])
    return ActivationChoice(tuple(policies), tuple(peaks_))


def planned_activations(plan: Plan, prices: PolicyPrices | None, schedule: Schedule,
                        memory_limit: float | None, optimizer_factor: float) -> Plan:
    """`plan` with the policy per stage that ``checkpoint_activations="auto"`` runs (see
    `choose`; `prices` of its stages) and the ranks' predicted peaks; a ValueError naming
    the least each rank needs and the limit when no choice fits."""
    if prices is None:
        raise RuntimeError("the units were not priced (partitioner.activation_cost)")
    fixed = [0.0] * schedule.num_ranks
    for stage, rank in enumerate(schedule.placement):
        fixed[rank] += plan.stage_params[stage] * optimizer_factor
    choice = choose(schedule, prices, fixed, memory_limit)
    if choice is None:
        lowest = choose(schedule, prices, fixed, None, cheapest=False)
        need = [f + p for f, p in zip(fixed, lowest.peaks, strict=True)] if lowest else []
        raise ValueError(
            f'checkpoint_activations="auto": no policy per stage keeps every rank under '
            f"memory_limit={memory_limit:.4g} bytes (the least each rank needs, parameters x "
            f"{optimizer_factor:g} included: {[f'{b:.4g}' for b in need]}); raise "
            "memory_limit, add stages or microbatches"
        )
    return replace(plan, activations=list(choice.policies),
                   activation_peaks=list(choice.peaks))
