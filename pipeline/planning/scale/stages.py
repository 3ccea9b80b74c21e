"""Stage costs of one layout: the unit chain (embedding, `layers` x the one priced block,
head) with each block's tensor-parallel collectives (Megatron's pairs: 2 all-reduces of the
b x s x h activation in the forward and 2 in the backward on the tp group, or an all-gather
and a reduce-scatter each under sequence parallelism, which also runs the element-wise work
on whole hidden vectors on 1/tp of the tokens; the vocabulary-parallel embedding's
forward and the head's input-grad one more) and its recompute policy ("selective": the
attention core redone in B, its seq x seq tensors not held; "full": the block's forward
redone in B, only its input held), cut into pp x v stages by a min-max partition of
F + B + W (binary search on the bottleneck with a greedy feasibility probe: exact up to
the search's tolerance and linear in the chain, where partitioner.solver's dynamic
programme is quadratic: a search prices thousands of cuts of 100+ units).

Each unit's W also pays the gradient accumulation the executor does between microbatches
(`p.grad += g`, one multi-tensor add per microbatch after the first: the accumulated
gradient and the new one read, the sum written), memory-bound."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeline.planning.hardware.collectives import Placement, collective_seconds
from pipeline.planning.scale.layout import Job, Layout
from pipeline.planning.scale.pricing import UnitPrice
from pipeline.planning.scale.transformer import TransformerSpec
from pipeline.planning.scale.units import DTYPES, Units


@dataclass(frozen=True)
class Working:
    """One unit's bytes for one microbatch beyond what the rank holds when each phase starts
    (pricing.UnitPrice's working sets; the recompute working set is in `backward` and
    `input_grad`): held from its F to its B (or W), F's temporaries, a whole backward's, a
    split B's and what it keeps until W, W's beyond the weight grads it makes, and those
    weight grads (`grads`: elements)."""

    held: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    input_grad: float = 0.0
    kept: float = 0.0
    weight_grad: float = 0.0
    grads: int = 0


@dataclass(frozen=True)
class UnitCost:
    """One unit of the chain for one microbatch: seconds of F, B, W; activation bytes held
    per in-flight microbatch; extra bytes while it recomputes; parameters; output bytes
    sent to the next stage; its working sets (`memory`)."""

    forward: float
    input_grad: float
    weight_grad: float
    held: float
    working: float
    parameters: int
    output: float
    memory: Working = Working()


@dataclass(frozen=True)
class StageCosts:
    """Per stage: F, B, W seconds, held activation bytes per microbatch, the largest
    recompute working set, parameters, the bytes crossing to the next stage, its unit count
    and its largest unit's parameters; its units' working sets in chain order (`units`)."""

    forward: list[float]
    input_grad: list[float]
    weight_grad: list[float]
    held: list[float]
    working: list[float]
    parameters: list[int]
    boundary: list[float]
    sizes: list[int]
    largest_unit: list[int]
    units: list[tuple[Working, ...]]


def tp_collective(job: Job, layout: Layout, nbytes: float) -> float:
    """One Megatron tp collective point on `nbytes` (all-reduce, or all-gather +
    reduce-scatter under sequence parallelism) on the tp group inside a node."""
    if layout.tp == 1:
        return 0.0
    net = job.target.network
    group = Placement(layout.tp, min(layout.tp, job.gpus_per_node))
    if layout.sequence_parallel:
        return (collective_seconds(net, "all_gather", nbytes, group)
                + collective_seconds(net, "reduce_scatter", nbytes, group))
    return collective_seconds(net, "all_reduce", nbytes, group)


def working_sets(unit: UnitPrice, held: float, redo: float = 0.0, shard: float = 1.0) -> Working:
    """`unit`'s working sets holding `held` bytes per microbatch, `redo` more in its B while
    it recomputes, its activation bytes cut by `shard` (sequence parallelism)."""
    return Working(held, unit.forward_extra / shard, unit.backward_extra / shard + redo,
                   unit.input_extra / shard + redo, unit.kept_for_weight / shard,
                   unit.weight_extra / shard, unit.parameters)


def accumulate_seconds(job: Job, layout: Layout, parameters: int) -> float:
    """Seconds per microbatch (averaged over the step's microbatches) of accumulating the
    gradients of `parameters` weights: (m - 1) of m microbatches add their gradient into
    `.grad` (3 gradient-sized transfers), memory-bound. The same for every ZeRO choice (a
    simulation is shared by them): `predict.finish` takes it off FSDP without a pipeline,
    whose gradients are reduce-scattered per microbatch."""
    m = layout.microbatches
    if m <= 1:
        return 0.0
    target = job.target
    nbytes = 3 * parameters * (4 if job.precision == "fp32" else 2)
    return nbytes / (target.memory_bandwidth * target.memory_efficiency) * (m - 1) / m


def _block(units: Units, layout: Layout, comm: float) -> UnitCost:
    blk, full, t = units.block, units.block_unsharded, layout.tp
    sp = layout.sequence_parallel and t > 1
    saved, core = (full.saved / t, full.saved_core / t) if sp else (blk.saved, blk.saved_core)
    # Sequence parallelism runs the norms, dropouts and residuals on 1/t of the tokens.
    cut = 1 - 1 / t if sp else 0.0
    f, b, w = (x - r * cut for x, r in zip((blk.forward, blk.input_grad, blk.weight_grad),
                                           blk.replicated, strict=True))
    f, b = f + 2 * comm, b + 2 * comm
    held, working = saved, 0.0
    if layout.recompute == "selective":
        b, held, working = b + blk.core_seconds, saved - core, core
    elif layout.recompute == "full":
        b, held, working = b + f, blk.input_bytes / t if sp else blk.input_bytes, saved
    return UnitCost(f, b, w, held, working, blk.parameters, blk.output_bytes / t,
                    working_sets(blk, held, working, t if sp else 1.0))


def _edge(unit: UnitPrice, f_comm: float, b_comm: float, out: float) -> UnitCost:
    return UnitCost(unit.forward + f_comm, unit.input_grad + b_comm, unit.weight_grad,
                    unit.saved, 0.0, unit.parameters, out, working_sets(unit, unit.saved))


def unit_chain(job: Job, layout: Layout, units: Units) -> list[UnitCost]:
    """The chain's units in order, costed for `layout`."""
    spec = job.spec
    if not isinstance(spec, TransformerSpec):
        return [UnitCost(u.forward, u.input_grad,
                         u.weight_grad + accumulate_seconds(job, layout, u.parameters),
                         u.saved, 0.0, u.parameters, u.output_bytes, working_sets(u, u.saved))
                for u in units.chain]
    act = units.microbatch_size * spec.seq * spec.hidden * (
        DTYPES[job.precision].itemsize)
    comm = tp_collective(job, layout, act)
    blk = _block(units, layout, comm)
    embed = _edge(units.embed, comm, 0.0, blk.output)
    head = _edge(units.head, 0.0, comm, 0.0)
    chain = [replace(u, weight_grad=u.weight_grad + accumulate_seconds(job, layout, u.parameters))
             for u in (embed, blk, head)]
    return [chain[0], *([chain[1]] * spec.layers), chain[2]]


def _packed(costs: list[float], cap: float) -> list[int]:
    sizes, load = [0], 0.0
    for c in costs:
        if sizes[-1] and load + c > cap:
            sizes.append(0)
            load = 0.0
        sizes[-1] += 1
        load += c
    return sizes


def balanced(costs: list[float], stages: int) -> list[int]:
    """Contiguous stage sizes of `costs` (each >= 1) minimising the largest stage sum."""
    lo, hi = max(costs), sum(costs)
    for _ in range(60):
        mid = (lo + hi) / 2
        if len(_packed(costs, mid)) <= stages:
            hi = mid
        else:
            lo = mid
    sizes = _packed(costs, hi)
    while len(sizes) < stages:  # split the longest stage: its parts cost no more
        i = max(range(len(sizes)), key=lambda k: sizes[k])
        sizes[i:i + 1] = [sizes[i] - sizes[i] // 2, sizes[i] // 2]
    return sizes


def stage_costs(job: Job, layout: Layout, units: Units) -> StageCosts:
    """The chain cut into pp x v stages, balanced on F + B + W."""
    chain = unit_chain(job, layout, units)
    sizes = balanced([u.forward + u.input_grad + u.weight_grad for u in chain],
                     layout.pp * layout.virtual_stages)
    stages: list[list[UnitCost]] = []
    start = 0
    for size in sizes:
        stages.append(chain[start:start + size])
        start += size
    return StageCosts(
        forward=[sum(u.forward for u in s) for s in stages],
        input_grad=[sum(u.input_grad for u in s) for s in stages],
        weight_grad=[sum(u.weight_grad for u in s) for s in stages],
        held=[sum(u.held for u in s) for s in stages],
        working=[max(u.working for u in s) for s in stages],
        parameters=[sum(u.parameters for u in s) for s in stages],
        boundary=[s[-1].output for s in stages],
        sizes=sizes,
        largest_unit=[max(u.parameters for u in s) for s in stages],
        units=[tuple(u.memory for u in s) for s in stages],
    )
