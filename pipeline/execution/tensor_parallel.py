"""The tensor-parallel pass: a stage module's parameters become DTensors on the "tp" mesh dim
with the placements of the plan (partitioner.tp_plan), and the stage graph runs unchanged on
them: DTensor's sharding propagation turns its views with global shapes into per-rank views,
and a row-parallel matmul's partial sums into one all-reduce where they meet the replicated
residual (the Megatron-LM pattern). Two graph edits keep it fast and exact: export's
``_assert_tensor_metadata`` checks are dropped (no sharding rule; the dtypes are as
captured), and attention runs on each rank's own heads (`sharded_attention`), as DTensor's
CPU attention rule decomposes the whole op on every call.

A stage takes plain tensors and returns plain tensors: its floating-point inputs enter as
Replicate DTensors (their gradient is all-reduced back to a whole one), integer inputs stay
plain (token ids, masks: DTensor replicates them where they meet a sharded tensor), and its
outputs are made whole (Replicate) before they leave, so the pipeline's transport and loss see
what the unsplit model computes; the last stage's logits split by class (a column-parallel LM
head's) stay split for a training loss under loss parallelism (pipeline.execution.loss_parallel).
Every tp rank of a stage sends its 1/tp slice of each boundary tensor to the same tp rank of
the next stage, whose tp ranks all-gather the slices (pipeline.execution.distributed.p2p)."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.placement_types import _StridedShard
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_map

from partitioner.tp_plan import LossChoice, TPPlan, derive_tp_plan, given_tp_plan, matmul_of
from pipeline.execution.loss_parallel import by_classes
from pipeline.planning.decision import Decision

aten = torch.ops.aten
_DROPPED = {aten._assert_tensor_metadata.default}


def _as_dtensor(t: Any, mesh: DeviceMesh) -> DTensor:
    if isinstance(t, DTensor):
        return t
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False)


def _heads_local(t: Any, mesh: DeviceMesh, heads: int) -> Tensor:
    """This rank's heads of an attention operand (dim 1 of a 4-d tensor): a broadcast head
    dim (size 1) or a 3-d operand stays whole; grouped-query kv heads are repeated to the
    query's first (as the unsplit attention's ``enable_gqa`` does)."""
    d: Any = _as_dtensor(t, mesh)
    if d.dim() != 4 or d.shape[1] == 1:
        return d.redistribute(mesh, [Replicate()]).to_local()
    if d.shape[1] != heads:
        d = d.redistribute(mesh, [Replicate()]).repeat_interleave(heads // d.shape[1], dim=1)
    return d.redistribute(mesh, [Shard(1)]).to_local()


def sharded_attention(
    query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
    is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
) -> Any:
    """``aten.scaled_dot_product_attention`` on each rank's own heads when any operand is a
    DTensor (attention is independent per head): the operands' heads are split over the tp
    mesh dim (taken from where they are, a local slice where they are whole), attention runs on
    the local heads, and the result is a DTensor sharded by heads. When no operand is split
    by heads (the plan replicated the projections) or the tp degree does not divide the
    heads, it runs whole on every rank."""
    operands = (query, key, value, attn_mask)
    tensors = [t for t in operands if isinstance(t, DTensor)]
    if not tensors:
        return aten.scaled_dot_product_attention.default(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
            enable_gqa=enable_gqa)
    mesh = tensors[0].device_mesh
    heads = query.shape[1] if query.dim() == 4 else 0
    by_heads = any(p == Shard(1) for t in tensors for p in t.placements)
    if query.dim() != 4 or heads % mesh.size() or not by_heads:
        whole = [None if t is None else _as_dtensor(t, mesh).redistribute(
            mesh, [Replicate()]).to_local() for t in operands]
        out = aten.scaled_dot_product_attention.default(
            *whole[:3], whole[3], dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        return DTensor.from_local(out, mesh, [Replicate()], run_check=False)
    q, k, v = (_heads_local(t, mesh, heads) for t in (query, key, value))
    mask = None if attn_mask is None else _heads_local(attn_mask, mesh, heads)
    out = aten.scaled_dot_product_attention.default(
        q, k, v, mask, dropout_p, is_causal, scale=scale)
    return DTensor.from_local(out, mesh, [Shard(1)], run_check=False)


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) over a process group; the gradient of each rank's part is the whole
    gradient (it arrives whole: the caller makes it a Replicate DTensor)."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, group: Any) -> Tensor:
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def whole_embedding(weight: Any, indices: Any, *args: Any) -> Any:
    """``aten.embedding``; with a vocab-parallel weight (Shard(0)) each rank looks up the rows
    it holds (zero elsewhere) and one all-reduce sums them (Megatron-LM's
    VocabParallelEmbedding; DTensor's masked partial can be reduced only once, and this output
    may have several readers)."""
    if not isinstance(weight, DTensor) or weight.placements[0] != Shard(0):
        return aten.embedding.default(weight, indices, *args)
    mesh = weight.device_mesh
    ids = indices.full_tensor() if isinstance(indices, DTensor) else indices
    rows = weight.to_local()
    start = mesh.get_local_rank() * rows.shape[0]
    outside = (ids < start) | (ids >= start + rows.shape[0])
    padding = args[0] if args else -1  # a padding row takes no gradient, on its own rank
    padding = padding - start if start <= padding < start + rows.shape[0] else -1
    local = aten.embedding.default(rows, (ids - start).masked_fill(outside, 0), padding,
                                   *args[1:])
    local = local.masked_fill(outside.unsqueeze(-1), 0.0)
    total = _SumOverRanks.apply(local, mesh.get_group())
    return DTensor.from_local(total, mesh, [Replicate()], run_check=False)


def whole_grad(t: Any) -> Any:
    """`t` unchanged in the forward; its gradient made whole (Replicate: one all-reduce of a
    partial one) in the backward. Before a column-parallel matmul, as Megatron-LM's "f"
    operator: the matmul's input gradient is a partial sum, reduced here once instead of in
    every weight gradient upstream."""
    if not isinstance(t, DTensor) or t.placements != (Replicate(),):
        return t
    local = t.to_local(grad_placements=[Replicate()])
    return DTensor.from_local(local, t.device_mesh, [Replicate()], run_check=False)


def summed(t: Any) -> Any:
    """A row-parallel matmul's output (a Partial DTensor) summed over the tp ranks: a Replicate
    DTensor whose gradient is taken whole (no reduction in the backward)."""
    if not isinstance(t, DTensor) or not any(p.is_partial() for p in t.placements):
        return t
    mesh = t.device_mesh
    local = t.to_local(grad_placements=[Replicate()])
    total = _SumOverRanks.apply(local, mesh.get_group())
    return DTensor.from_local(total, mesh, [Replicate()], run_check=False)


def _token_dim(t: DTensor) -> int | None:
    """The dim a token-sharded activation is split along: the sequence (dim 1 of a 3-d
    activation) or the flattened tokens / batch (dim 0) when tp divides it; None when
    neither does."""
    size = t.device_mesh.size()
    dims = [1, 0] if t.dim() >= 3 else [0] if t.dim() == 2 else []
    return next((d for d in dims if t.shape[d] % size == 0), None)


def gathered(t: Any) -> Any:
    """Sequence parallelism's "f": a token-sharded activation all-gathered whole before a
    column-parallel matmul (its gradient reduce-scattered back); a whole one as
    `whole_grad`."""
    if not isinstance(t, DTensor) or t.placements == (Replicate(),):
        return whole_grad(t)
    return t.redistribute(t.device_mesh, [Replicate()])


def scattered(t: Any) -> Any:
    """Sequence parallelism's "g": a row-parallel matmul's partial sums reduce-scattered over
    the tokens (each rank then runs the norms, dropout and residual adds on 1/tp of them; the
    gradient is all-gathered back); `summed` where tp divides no token dim."""
    if not isinstance(t, DTensor) or not any(p.is_partial() for p in t.placements):
        return t
    dim = _token_dim(t)
    if dim is None:
        return summed(t)
    return t.redistribute(t.device_mesh, [Shard(dim)])


def replicated_like(t: Any, like: DTensor) -> Any:
    """A plain tensor met by a DTensor op, as a Replicate DTensor on `like`'s mesh (a local
    view, no communication; its gradient comes back whole)."""
    if isinstance(t, Tensor) and not isinstance(t, DTensor):
        return DTensor.from_local(t, like.device_mesh, [Replicate()] * like.device_mesh.ndim,
                                  run_check=False)
    return t


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), Tensor)


def float_inputs(module: fx.GraphModule) -> list[bool]:
    """Per placeholder, whether it is a floating-point tensor (it enters as a DTensor)."""
    return [
        _is_tensor(n) and n.meta["val"].is_floating_point()
        for n in module.graph.nodes if n.op == "placeholder"
    ]


def _strided_parts(t: Any, chunks: int, dim: int) -> tuple[DTensor, ...] | None:
    """`t`'s `chunks` equal chunks along `dim` when it is held strided that way (each rank its
    part of every chunk, ``_StridedShard``): each rank cuts its own part, so every chunk comes
    out split over the ranks (by heads) with no communication; None otherwise."""
    placement = t.placements[0] if isinstance(t, DTensor) and t.device_mesh.ndim == 1 \
        else None
    if not isinstance(placement, _StridedShard):
        return None
    d = dim % t.dim()
    if placement.dim != d or placement.split_factor != chunks:
        return None
    mesh, local = t.device_mesh, t.to_local()
    return tuple(DTensor.from_local(part, mesh, [Shard(d)], run_check=False)
                 for part in local.split(local.shape[d] // chunks, dim=d))


def chunked_split(t: Any, size: int, dim: int = 0) -> Any:
    """``aten.split`` of a fused projection's output, by `_strided_parts` where it is held
    strided into chunks of `size`; else as aten's."""
    if isinstance(t, DTensor) and size > 0 and t.shape[dim % t.dim()] % size == 0:
        parts = _strided_parts(t, t.shape[dim % t.dim()] // size, dim)
        if parts is not None:
            return parts
    return aten.split.Tensor(t, size, dim)


def chunked_chunk(t: Any, chunks: int, dim: int = 0) -> Any:
    """``aten.chunk`` of a fused projection's output (gate and up in one matmul), by
    `_strided_parts` where it is held strided into `chunks`; else as aten's."""
    parts = _strided_parts(t, chunks, dim) if isinstance(t, DTensor) else None
    return parts if parts is not None else aten.chunk.default(t, chunks, dim)


def _holds_tensor(node: fx.Node) -> bool:
    """Whether `node`'s value is a tensor or holds some (a split's tuple); unknown counts."""
    val = node.meta.get("val")
    if val is None or isinstance(val, Tensor):
        return True
    return isinstance(val, (list, tuple)) and any(isinstance(v, Tensor) for v in val)


def _replicate_plain_operands(module: fx.GraphModule) -> None:
    """Make every plain tensor an op mixes with DTensors a Replicate DTensor in the graph
    (buffers, constants, tensors made inside: rotary tables, masks), so the forward and the
    backward (which runs outside any context) see DTensors only."""
    graph = module.graph
    dtensors: set[fx.Node] = set()
    for node in list(graph.nodes):
        if node.op == "placeholder":
            if _is_tensor(node) and node.meta["val"].is_floating_point():
                dtensors.add(node)
        elif node.op == "get_attr":
            if isinstance(_attribute(module, str(node.target)), DTensor):
                dtensors.add(node)
        elif node.op == "call_function" and node.target is not replicated_like:
            inputs = node.all_input_nodes
            sharded = [i for i in inputs if i in dtensors]
            if not sharded:
                continue
            if _holds_tensor(node):  # a size read off a DTensor (sym_size) is an int
                dtensors.add(node)
            like = next((i for i in sharded if _is_tensor(i)), sharded[0])
            for plain in inputs:
                if plain not in dtensors and _is_tensor(plain):
                    with graph.inserting_before(node):
                        made = graph.call_function(replicated_like, (plain, like))
                    made.meta = dict(plain.meta)
                    node.replace_input_with(plain, made)


def _attribute(module: nn.Module, target: str) -> Any:
    owner: Any = module
    for part in target.split("."):
        owner = getattr(owner, part, None)
    return owner


def _column_inputs(module: fx.GraphModule, plan: TPPlan, sequence_parallel: bool) -> None:
    """Wrap the activation input of every column-parallel matmul in `whole_grad` and the
    output of every row-parallel one in `summed`: Megatron-LM's f and g, so the gradients
    between blocks are whole and each weight's gradient has its weight's placement."""
    graph = module.graph
    params = {n: p for n, p in module.named_parameters(remove_duplicate=False)}
    wrapped: dict[fx.Node, fx.Node] = {}  # one f per activation (q, k, v share theirs)
    for node in list(graph.nodes):
        found = matmul_of(node, params)
        if found is None:
            continue
        if plan.style(found.weight) == "rowwise":
            with graph.inserting_after(node):
                out = graph.call_function(scattered if sequence_parallel else summed, (node,))
            out.meta = dict(node.meta)
            for user in [u for u in node.users if u is not out]:
                user.replace_input_with(node, out)
            continue
        if plan.style(found.weight) != "colwise":
            continue
        made = wrapped.get(found.activation)
        if made is None:
            with graph.inserting_after(found.activation):
                made = graph.call_function(gathered if sequence_parallel else whole_grad,
                                           (found.activation,))
            made.meta = dict(found.activation.meta)
            wrapped[found.activation] = made
        node.replace_input_with(found.activation, made)


def _edit_graph(module: fx.GraphModule, plan: TPPlan, sequence_parallel: bool) -> None:
    """Drop export's dtype checks, sum a vocab-parallel embedding's rows at once, run
    attention per rank's heads and reduce column-parallel input gradients once."""
    graph = module.graph
    _column_inputs(module, plan, sequence_parallel)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _DROPPED and not node.users:
            graph.erase_node(node)
        elif node.target is aten.scaled_dot_product_attention.default:
            node.target = sharded_attention
        elif node.target is aten.embedding.default:
            node.target = whole_embedding
        elif node.target is aten.split.Tensor:
            node.target = chunked_split
        elif node.target is aten.chunk.default:
            node.target = chunked_chunk
    _replicate_plain_operands(module)
    graph.lint()
    module.recompile()


def shard_parameters(
    holders: list[nn.Module], plan: TPPlan, mesh: DeviceMesh, names: Mapping[int, str],
    only: set[int] | None = None,
) -> dict[int, nn.Parameter]:
    """Replace each parameter the `holders` hold by a DTensor Parameter with the plan's
    placement (every process holds the whole tensor, so its shard is cut locally; a meta one
    becomes a meta DTensor, given its values by materialisation or loading), in every
    holder and slot that holds it (tied ones stay one object). `names`: id -> the name the
    plan knows it by; `only`: the ids to shard (default all). Returns id(old) -> new."""
    made: dict[int, nn.Parameter] = {}
    for holder in holders:
        for owner in holder.modules():
            for field, p in list(owner._parameters.items()):
                if p is None or isinstance(p, DTensor) or (only is not None and id(p) not in only):
                    continue
                new = made.get(id(p))
                if new is None:
                    name = names.get(id(p), "")
                    dim, chunks = plan.dim(name), plan.chunks(name)
                    placement: list[Placement] = (
                        [Replicate()] if dim is None
                        else [_StridedShard(dim, split_factor=chunks)] if chunks > 1
                        else [Shard(dim)])
                    value = distribute_tensor(p.detach(), mesh, placement, src_data_rank=None)
                    new = made[id(p)] = nn.Parameter(value, requires_grad=p.requires_grad)
                owner._parameters[field] = new
    return made


class TensorParallelStage:
    """Runs `inner`, a forward of a stage module (a graph of aten ops over DTensor
    parameters, or its blocks under a recompute policy), on plain tensors: see the module
    docstring. `floats`: per input, whether it enters as a Replicate DTensor."""

    def __init__(self, inner: Callable[..., Any], mesh: DeviceMesh, floats: list[bool],
                 loss: LossChoice | None = None) -> None:
        self.mesh = mesh
        self.inner = inner
        self.floats = floats
        self.loss = loss

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mesh = self.mesh
        inputs = [_as_dtensor(a, mesh) if f and isinstance(a, Tensor) else a
                  for a, f in zip(args, self.floats, strict=False)]
        with implicit_replication():
            out = self.inner(*inputs, **kwargs)
        # The last stage's logits split by class stay so for a training loss (loss
        # parallelism, pipeline.execution.loss_parallel) unless it chose to gather them.
        keep = (self.loss is not None and self.loss.used != "gathered"
                and torch.is_grad_enabled())
        return tree_map(partial(self._whole, keep=keep), out)

    def _whole(self, t: Any, keep: bool = False) -> Any:
        if isinstance(t, DTensor) and not (keep and by_classes(t)):
            return t.redistribute(self.mesh, [Replicate()]).to_local()
        return t


def tensor_parallel(module: fx.GraphModule, plan: TPPlan, mesh: DeviceMesh,
                    sequence_parallel: bool = False) -> None:
    """The tensor-parallel pass on one held stage, in place: its graph edited, its forward
    run on the tp `mesh` (a 1-d DeviceMesh). The parameters are sharded by
    `shard_parameters` (once for the model, as stages share tied weights)."""
    _edit_graph(module, plan, sequence_parallel)
    module.forward = TensorParallelStage(partial(_current_code, module), mesh,
                                         float_inputs(module))


def _current_code(module: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    """The graph's code as it is now: a recompile (a meta model's graph moved to its device
    once materialised) replaces the class's forward, which a bound method would miss."""
    return type(module).forward(module, *args, **kwargs)


def boundary(module: fx.GraphModule, mesh: DeviceMesh, loss: LossChoice | None = None,
             ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """How any forward of the edited stage `module` (its blocks recomputed, its compiled
    regions, under autocast) is run on plain tensors: wrapped as `TensorParallelStage`
    (`loss`: the last stage's loss choice, whose logits may stay split by class)."""
    floats = float_inputs(module)
    return partial(TensorParallelStage, mesh=mesh, floats=floats, loss=loss)


def _warn_undivided(plan: TPPlan) -> None:
    """A UserWarning naming what stays replicated because tp does not divide it (heads, kv
    heads, a vocabulary, a width): correct, but it costs every rank the whole tensor."""
    undivided = [p for p in plan.params.values() if "not divisible" in p.why]
    if undivided:
        shown = "; ".join(f"{p.name}: {p.why}" for p in undivided[:4])
        more = f" ... and {len(undivided) - 4} more" if len(undivided) > 4 else ""
        warnings.warn(
            f"tensor_parallel={plan.degree} replicates {len(undivided)} parameter(s) it does "
            f"not divide ({shown}{more}); correct, but each rank holds them whole: choose a "
            "tensor_parallel that divides the heads and vocabulary to split them",
            stacklevel=3,
        )


# The Parameters the pass replaced (id -> weak reference), for `_check_optimizer`.
_REPLACED: dict[int, weakref.ref[nn.Parameter]] = {}
_HOOK: list[Any] = []


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """An optimizer step pre-hook (every optimizer's): a ValueError when the optimizer holds a
    Parameter the tensor-parallel pass replaced by its shard (built before the plan was
    made): its steps would change nothing the pipeline runs."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref = _REPLACED.get(id(p))
            if ref is not None and ref() is p:
                raise ValueError(
                    f"this {type(optimizer).__name__} holds parameters that tensor_parallel "
                    "replaced by their shards (DTensors), so its steps would not change the "
                    "model the pipeline runs; build it once the plan is made: pass "
                    "example_input=... to Pipeline, or build it after the first step"
                )


def _forget(key: int, _: object) -> None:
    _REPLACED.pop(key, None)


def _remember_replaced(made: Mapping[int, nn.Parameter], old: list[nn.Parameter]) -> None:
    for p in old:
        if id(p) in made:
            _REPLACED[id(p)] = weakref.ref(p, partial(_forget, id(p)))
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_check_optimizer))


def parallelize(
    planned: Decision, held: Mapping[int, fx.GraphModule], mesh: DeviceMesh, degree: int,
    rules: Mapping[str, Any] | None = None,
) -> TPPlan:
    """The tensor-parallel plan for the stages this process holds (`held`): the plan of the
    captured graph (derived, or from `rules`: a ``tp_plan``), and the held parameters sharded
    in every module that holds them (the model, the capture's modules, every stage module;
    once per load, before the ties are found). Returns the plan; each held stage is then run
    on the tp `mesh` by the tensor-parallel pass (pipeline.execution.passes.tensor_parallel,
    `tensor_parallel`)."""
    gm = planned.captured.graph_module
    plan = derive_tp_plan(gm, degree) if rules is None else given_tp_plan(gm, degree, rules)
    _warn_undivided(plan)
    names = {id(p): n for n, p in gm.named_parameters(remove_duplicate=False)
             if n in plan.params}
    mine = {id(p) for m in held.values() for p in m.parameters()}
    holders = [planned.model, gm, planned.captured.unit_module, *planned.modules]
    old = [p for m in held.values() for p in m.parameters()]
    _remember_replaced(shard_parameters(holders, plan, mesh, names, only=mine), old)
    return plan
