"""Recompute policies ("full", "selective") at graph level: each block of a stage (the
regions of pipeline.execution.compiled.regions, cut by partitioner.blocks' rule) is traced
once per input signature into its joint forward+backward graph (the compiled stages' trace,
`trace_joint`), which is cut by what the policy keeps instead of by AOTAutograd's min-cut:

- "full": the block's inputs (parameters included) and the outputs of random ops (dropout's
  mask: kept, so the backward needs no RNG replay and draws nothing);
- "selective": those and the outputs of the `Selective.save` ops (matmuls, attention) that
  partitioner.selective_keep's rule chooses: among the ones the backward would recompute,
  the most recompute FLOPs per byte while the block keeps at most the budget (its inputs and
  random outputs charged first).

The backward graph then recomputes every forward node it needs that the forward did not keep.
Both graphs run as plain fx code (nothing compiled) in the compiled stages' autograd node
(`RegionFunction`): no saved-tensor hooks per tensor, no recomputation frames, no dispatch
mode per op, so rank threads sharing the GIL wait on each other far less than under
``torch.utils.checkpoint``. A split-backward schedule runs the backward as the input-grad
graph in B and the weight-grad graph in W (`split_backward`): W starts from what B computed
and never recomputes.

A region that cannot be traced (a BatchNorm's running statistics or any buffer updated in
place, data-dependent control flow, a non-tensor value crossing it) or that calls a module of
the user's whole (``leaf_modules=``: its Python, side effects included, runs as written) runs
under ``torch.utils.checkpoint`` instead (pipeline.execution.activations.recompute; a debug
log line says so): same results, the checkpoint's speed."""

from __future__ import annotations

import copy
import logging
import operator
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn

from partitioner.activation_cost import BlockFigures
from partitioner.blocks import BlockChain
from partitioner.selective_keep import Candidate, KeepPlan, choose, keep_plan, op_flops
from pipeline.execution.activations.recompute import (
    Checkpointed,
    Recomputed,
    Restoring,
    UpdatedBuffers,
)
from pipeline.execution.compiled.joint import Partition
from pipeline.execution.compiled.options import CompileOptions
from pipeline.execution.compiled.regions import Region, outline, regions_of
from pipeline.execution.compiled.runner import (
    Artefact,
    CompileStats,
    RegionFunction,
    RegionRunner,
    _gate,
)
from pipeline.planning.activation_policies import FULL, SELECTIVE, Policy, Selective

log = logging.getLogger("hybridpipe")
# "selective": the plan each traced forward graph keeps (the pricing reads its FLOPs).
_PLANS: weakref.WeakKeyDictionary[fx.GraphModule, KeepPlan] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class _AsTraced(CompileOptions):
    """Graphs run as traced (nothing compiled, no decompositions); `policy` tells the
    artefacts of different policies apart."""

    policy: tuple[Any, ...] = ()

    def compile(self, gm: Callable[..., Any]) -> Callable[..., Any]:
        return gm

    def decompositions(self) -> None:
        return None

    def key(self) -> tuple[Any, ...]:
        return ("graph recompute", *self.policy)


def _policy_key(policy: Policy) -> tuple[Any, ...]:
    if isinstance(policy, Selective):
        return ("selective", tuple(map(str, policy.save)), policy.budget)
    return (str(policy),)


def forward_nodes(joint: fx.GraphModule) -> list[fx.Node]:
    """The joint graph's forward: every node that does not depend on a tangent."""
    backward: set[fx.Node] = set()
    forward = []
    for node in joint.graph.nodes:
        if node.op == "output":
            continue
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
                a in backward for a in node.all_input_nodes):
            backward.add(node)
        else:
            forward.append(node)
    return forward


def _values(node: fx.Node) -> list[fx.Node]:
    """The nodes holding `node`'s tensors: itself, or the items of a multi-output op."""
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):
        return [u for u in node.users if u.target is operator.getitem
                and isinstance(u.meta.get("val"), Tensor)]
    return [node] if isinstance(value, Tensor) else []


def _nbytes(nodes: Sequence[fx.Node]) -> float:
    return float(sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in nodes))


def _random(node: fx.Node) -> bool:
    """Whether the op draws random numbers (fused attention only with a dropout)."""
    target = node.target
    if not (isinstance(target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in target.tags):
        return False
    for i, arg in enumerate(target._schema.arguments):
        if arg.name == "dropout_p":
            p = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", 0.0)
            return bool(p != 0.0)
    return True


def _cut(joint: fx.GraphModule, saved: Sequence[fx.Node], num_outputs: int
         ) -> tuple[fx.GraphModule, fx.GraphModule]:
    from torch._functorch.partitioners import _extract_fwd_bwd_modules

    forward, backward = _extract_fwd_bwd_modules(joint, list(saved), [],
                                                 num_fwd_outputs=num_outputs)
    # The extraction copies a random op whose items the backward takes as saved values; its
    # result unused, it would still draw (fx keeps random ops as impure): dropped.
    for node in reversed(backward.graph.nodes):
        if node.op == "call_function" and not node.users:
            backward.graph.erase_node(node)
    backward.recompile()
    return forward, backward


def always_kept(forward: Sequence[fx.Node]) -> list[fx.Node]:
    """What every recompute policy keeps: the primals and the random ops' outputs."""
    primals = [n for n in forward if n.op == "placeholder"]
    return primals + [v for n in forward if n.op == "call_function" and _random(n)
                      for v in _values(n)]


def candidates(forward: Sequence[fx.Node], save: Sequence[Any], recomputed: set[str]
               ) -> list[tuple[Candidate, list[fx.Node]]]:
    """The calls of the `save` ops in the forward (with the nodes of their outputs), and
    whether the backward (keeping nothing else) recomputes them: `recomputed` names the
    nodes it runs."""
    wanted = set(save)
    counts: dict[Any, int] = {}
    found = []
    for node in forward:
        if node.op != "call_function" or node.target not in wanted:
            continue
        values = _values(node)
        ordinal = counts[node.target] = counts.get(node.target, -1) + 1
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
        flops = op_flops(node.target, args, kwargs, node.meta.get("val"))
        found.append((Candidate(node.target, ordinal, _nbytes(values), flops,
                                node.name in recomputed), values))
    return found


def keep_choice(joint: fx.GraphModule, num_outputs: int, policy: Policy,
                none: Callable[[], KeepPlan]) -> tuple[list[fx.Node], KeepPlan | None]:
    """The nodes the forward keeps under `policy`, and under "selective" the plan chosen
    (the module docstring's rule). `none()`: a plan with the block's "none" bytes and the
    inputs it is charged (selective_keep.keep_plan's figures), for the budget."""
    forward = forward_nodes(joint)
    kept = always_kept(forward)
    if not isinstance(policy, Selective):
        return kept, None
    _, backward = _cut(joint, kept, num_outputs)
    recomputed = {n.name for n in backward.graph.nodes if n.op == "call_function"}
    found = candidates(forward, policy.save, recomputed)
    probe = none()
    randoms = _nbytes([n for n in kept if n.op != "placeholder"])
    charged = probe.input_bytes + randoms
    room = None if policy.budget is None else policy.budget * probe.none_bytes - charged
    chosen = {id(c) for c in choose([c for c, _ in found], room)}
    keep: dict[Any, set[int]] = {}
    for c, values in found:
        if id(c) in chosen:
            keep.setdefault(c.func, set()).add(c.ordinal)
            kept += values
    plan = KeepPlan({f: frozenset(k) for f, k in keep.items()}, probe.none_bytes,
                    probe.input_bytes,
                    charged + sum(c.nbytes for c, _ in found if id(c) in chosen),
                    tuple(c for c, _ in found))
    return kept, plan


class RecomputeRunner(RegionRunner):
    """One region of a stage run at graph level under a recompute policy (see the module
    docstring); a call that needs no grad runs the region as it is. `graph_calls` and
    `checkpointed_calls` count the training calls of each path."""

    def __init__(self, region: Region, owner: nn.Module, policy: Policy,
                 restoring: Restoring, stats: CompileStats,
                 where: str, splits: bool) -> None:
        super().__init__(region, owner, _AsTraced(policy=_policy_key(policy)), stats, where,
                         splits, quiet=True)
        self.policy = policy
        self.fallback = Checkpointed(self.run, policy, restoring, self.weights)
        self.last: Artefact | None = None  # the artefact of the last graph-level call
        self.graph_calls = 0
        self.checkpointed_calls = 0
        opaque = [type(m).__name__ for m in self.gm.children()
                  if not type(m).__module__.startswith("torch.nn")]
        if opaque:  # a user's leaf module: its Python (side effects too) runs as written
            self.eager = f"it calls a leaf module whole ({opaque[0]})"
            self._runs_eager(self.name, self.eager)

    def _partition(self) -> Partition:
        return self._keep

    def _keep(self, joint: fx.GraphModule, args: tuple[Tensor, ...], num_outputs: int
              ) -> tuple[fx.GraphModule, fx.GraphModule]:
        policy = self.policy
        save = policy.save if isinstance(policy, Selective) else ()
        weights, inputs = args[: self.weights], args[self.weights:]

        def none() -> KeepPlan:  # the attributes as the parameters they are (not counted)
            # On fake tensors: a real probing forward would hold the block's "none" bytes
            # on top of the step's (the first step's peak over the plan).
            return keep_plan(lambda *a: self.run(*weights, *a), inputs, save, None, fake=True)

        kept, plan = keep_choice(joint, num_outputs, policy, none)
        forward, backward = _cut(joint, kept, num_outputs)
        if plan is not None:
            _PLANS[forward] = plan
        return forward, backward

    @property
    def plan(self) -> KeepPlan | None:
        """"selective": the plan of the artefact the last graph-level call ran."""
        return None if self.last is None else _PLANS.get(self.last.joint.forward)

    def _runs_eager(self, what: str, reason: str) -> None:
        log.debug("hybridpipe recompute: %s runs under torch.utils.checkpoint: %s",
                  what, reason)

    @property
    def checkpoints(self) -> bool:
        """Whether a training call of this region ran under torch.utils.checkpoint."""
        return self.checkpointed_calls > 0

    def __call__(self, *flat: Any) -> Any:
        if not (torch.is_grad_enabled()
                and any(isinstance(t, Tensor) and t.requires_grad for t in flat)):
            return self.run(*flat)
        if self.eager is None:
            device_type = next((t.device.type for t in flat if isinstance(t, Tensor)), "cpu")
            art: Any = None
            try:
                art = self._artefact(flat, True, device_type)
            except Exception as err:  # noqa: BLE001 - a region that cannot be traced
                self.eager = f"it could not be traced ({type(err).__name__}: {err})"[:300]
                self._runs_eager(self.name, self.eager)
            if isinstance(art, Artefact):
                self.graph_calls += 1
                self.last = art
                if not self.splits:
                    return RegionFunction.apply(art, device_type, False, *flat)
                return RegionFunction.apply(art, device_type, True, *map(_gate, flat))
        self.checkpointed_calls += 1
        return self.fallback(*flat)


def _sizes_read(module: fx.GraphModule) -> fx.GraphModule:
    """`module` with each size it takes as a number (a block after the one that read it off
    a tensor) read off a tensor it takes instead, where one has that size: sizes are not
    values a region takes, but what it reads from its inputs' shapes (regions.py)."""
    graph = copy.deepcopy(module.graph)
    placeholders = list(graph.find_nodes(op="placeholder"))
    tensors = [p for p in placeholders if isinstance(p.meta.get("val"), Tensor)]
    changed = False
    for node in placeholders:
        value = node.meta.get("val")
        if not isinstance(value, torch.SymInt) or not node.users:
            continue
        found = next(((t, d) for t in tensors for d, size in enumerate(t.meta["val"].shape)
                      if isinstance(size, torch.SymInt) and size.node.expr == value.node.expr),
                     None)
        if found is None:
            continue
        with graph.inserting_after(placeholders[-1]):
            size = graph.call_function(torch.ops.aten.sym_size.int, found)
        size.meta["val"] = value
        node.replace_all_uses_with(size)
        changed = True
    if not changed:
        return module
    return fx.GraphModule(module, graph, type(module).__name__)


def graph_runners(block: fx.GraphModule, policy: Policy,
                  restoring: Restoring, splits: bool,
                  where: str) -> tuple[fx.GraphModule, RecomputeRunner | None]:
    """One block of a stage (partitioner.blocks: it reads its attributes through the stage)
    as a driver graph running it as one region, graph-level recomputed, and its runner
    (None for a block of size arithmetic only, which keeps nothing)."""
    owner = block.__dict__.get("_stage", block)
    module = _sizes_read(block)
    regions = regions_of(module, whole=True)
    runners = [RecomputeRunner(r, module, policy, restoring, CompileStats(), where, splits)
               for r in regions]
    driver = outline(module, regions, runners)
    for slot in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"):
        driver.__dict__[slot] = owner.__dict__[slot]
    return driver, runners[0] if runners else None


class GraphRecomputed(Recomputed):
    """A stage's training forward with its blocks run by `RecomputeRunner`s."""

    def __init__(self, forward: Callable[..., Any], runners: Sequence[RecomputeRunner]) -> None:
        super().__init__(forward)
        self.runners = list(runners)

    @property
    def checkpoints(self) -> bool:
        return any(r.checkpoints for r in self.runners)


def graph_recomputed(
    stage: fx.GraphModule,
    policy: Policy,
    wrap: Callable[[nn.Module], Callable[..., Any]],
    restoring: Restoring,
    splits: bool,
    where: str = "stage",
) -> GraphRecomputed:
    """`stage`'s training forward recomputed at graph level under `policy` ("full" or a
    `Selective`), block by block (partitioner.blocks, which also keeps a block from writing
    in place a value an earlier one keeps); `wrap(module)` is how a block is called (e.g.
    under autocast: it is traced under it). `splits`: the schedule splits the backward into
    B and W."""
    chain = BlockChain(stage)
    runs: dict[int, Callable[..., Any]] = {}
    runners = []
    for block in chain.blocks:
        driver, runner = graph_runners(block.module, policy, restoring, splits, where)
        runs[id(block.module)] = wrap(driver)
        runners += [runner] if runner is not None else []

    def forward(*args: Any) -> Any:
        return chain(*args, run=lambda block, *values: runs[id(block)](*values))

    return GraphRecomputed(forward, runners)


def _held_to_w(runner: RecomputeRunner | None) -> float:
    """Bytes the last graph-level call's input-grad graph keeps for the weight-grad graph (held
    from B to W under a split backward)."""
    split = None if runner is None or runner.last is None else runner.last.joint.split
    if split is None:
        return 0.0
    output = next(n for n in split.input_grad.graph.nodes if n.op == "output")
    return _nbytes([n for n in output.args[0][len(split.inputs):]
                    if isinstance(n.meta.get("val"), Tensor)])


def block_runs(module: fx.GraphModule, save: Sequence[Any], budget: float | None
               ) -> tuple[dict[str, Callable[..., Any]], Callable[[], BlockFigures]]:
    """A block's forward as each recompute policy runs it (for partitioner.activation_cost:
    the code the runtime runs), and, from the last calls, the recompute FLOPs of "full" and
    "selective" (of the candidate ops, per the last "selective" plan) and the bytes each
    holds from B to W under a split backward."""
    def untracked() -> UpdatedBuffers:  # priced in a sandbox, which puts the buffers back
        return UpdatedBuffers(None)

    full, full_runner = graph_runners(module, FULL, untracked, False, "priced block")
    selective, runner = graph_runners(module, Selective(tuple(save), budget), untracked,
                                      False, "priced block")

    def figures() -> BlockFigures:
        plan = None if runner is None else runner.plan or runner.fallback.plan
        return BlockFigures(
            recompute_flops={FULL: 0.0 if plan is None else plan.full_recompute_flops,
                             SELECTIVE: 0.0 if plan is None else plan.recompute_flops},
            held_to_w={FULL: _held_to_w(full_runner), SELECTIVE: _held_to_w(runner)})

    return {"full": full, "selective": selective}, figures
