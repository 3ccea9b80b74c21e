"""The tensor-parallel plan of a captured model: which dim of each parameter is split over the
tensor-parallel ranks, derived from the flat aten graph (pure graph analysis, no process
group), or taken from the user's module-path rules.

Rules of the derivation (Megatron-LM's layout, found on the graph instead of written per
model):

- A matmul with a parameter weight (``linear``, ``addmm``, ``mm``, ``matmul``) whose output
  reaches other such matmuls only through "transparent" ops (pointwise ops, views, transposes,
  attention, softmax, activation x activation products) starts a pair: it is column-parallel
  (weight split along its output features, its bias too) and the matmuls it reaches are
  row-parallel (weight split along its input features, bias replicated). Matmuls reached from
  the same row-parallel one form one group (q, k, v -> o; gate, up -> down).
- Attention by whole heads: a view that splits a projection's features into (heads, head
  dim) needs heads % tp == 0. Grouped-query k / v projections whose kv heads tp does not
  divide stay replicated (the query groups stay whole on each rank), the query and output
  projections are still split; a query head count tp does not divide replicates the group.
  A fused projection whose features are split into equal chunks (q, k, v) is split per
  chunk: each rank holds its heads of every chunk (a strided layout); uneven chunks
  replicate the group.
- A token embedding (its indices come from an input) is vocab-parallel when tp divides the
  vocabulary; a projection that reaches the model's output with no row-parallel partner (an
  LM head) is column-parallel, its logits split by class for a loss-parallel loss (else
  gathered; pipeline.execution.loss_parallel).
- Everything else (norms, position tables, biases after a row-parallel matmul, anything the
  rules do not cover) is replicated: correct (DTensor computes any op on replicated tensors
  as the unsplit model), and reported with the bytes each process holds for it.

A parameter read by several ops (a tied embedding and LM head) gets one placement: the ops
must agree on its dim, else it is replicated.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import fx

Style = Literal["colwise", "rowwise", "vocab", "replicate"]
STYLES = ("colwise", "rowwise", "replicate")
aten = torch.ops.aten

_MATMULS = {aten.linear.default, aten.addmm.default, aten.mm.default, aten.matmul.default}
_TRANSPOSES = {aten.t.default, aten.transpose.int, aten.permute.default, aten.numpy_T.default,
               aten.mT.default, aten.adjoint.default}
_SHAPE_OPS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
    aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
    aten.expand.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
    aten.detach.default, aten.slice.Tensor, aten.to.dtype, aten.to.dtype_layout,
    aten._to_copy.default, aten.dropout.default, aten.cat.default, aten.t.default,
    aten.select.int, aten.flatten.using_ints, aten.unflatten.int, aten.stack.default,
    aten.numpy_T.default, aten.mT.default,
    aten._assert_tensor_metadata.default,  # export's dtype check: reads, returns nothing
}
_ATTENTION = {
    aten.scaled_dot_product_attention.default, aten._softmax.default, aten.softmax.int,
    aten.bmm.default, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    # Products of two activations (attention scores written out: q @ k^T, probs @ v).
    aten.matmul.default, aten.baddbmm.default, aten.einsum.default,
}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
           aten.unbind.int}
# Reductions over the last dim: within one head once the heads have their own dim (a norm of
# each head's q / k), else over the split features (not transparent).
_REDUCTIONS = {
    aten.mean.dim, aten.sum.dim_IntList, aten.var.correction, aten.var_mean.correction,
    aten.amax.default, aten.amin.default, aten.linalg_vector_norm.default,
    aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default,
}


@dataclass(frozen=True)
class Placement:
    """One parameter's place in the plan: `dim` split over the tp ranks (None: replicated),
    the `style` that chose it, `why` in words, and `bytes` it holds whole. `chunks` > 1: the
    dim holds that many equal chunks (a fused q/k/v), each split over the ranks, so a rank
    holds its heads of every chunk (DTensor's ``_StridedShard(dim, split_factor=chunks)``)."""

    name: str
    dim: int | None
    style: Style
    why: str
    bytes: int
    chunks: int = 1  # >1: a fused projection, each of its equal chunks split (strided)


@dataclass
class LossChoice:
    """How the last stage's loss meets a column-parallel LM head's logits: `used` is
    "undecided" until its first microbatch, then "parallel" (the loss_fn ran under torch's
    loss_parallel on the logits split by class, no all-gather) or "gathered" (the logits
    made whole first); `why` says what decided it."""

    used: str = "undecided"
    why: str = "no training microbatch has reached the last stage on this process yet"


@dataclass(frozen=True)
class TPPlan:
    """The tensor-parallel plan: `degree` ranks, each parameter's `Placement` by the name the
    captured graph reads it under; `source` "derived" or "given"; `loss`, how the loss
    was computed (filled in by the last stage's processes)."""

    degree: int
    params: Mapping[str, Placement]
    source: str = "derived"
    notes: tuple[str, ...] = field(default=())
    loss: LossChoice = field(default_factory=LossChoice, compare=False)

    def style(self, name: str) -> str:
        """The style that placed parameter `name` ("replicate" when unknown)."""
        found = self.params.get(name)
        return "replicate" if found is None else found.style

    def chunks(self, name: str) -> int:
        """The fused chunks of parameter `name`'s split dim (1: not fused)."""
        found = self.params.get(name)
        return 1 if found is None else found.chunks

    def dim(self, name: str) -> int | None:
        """The dim of parameter `name` split over the ranks (None: replicated or unknown)."""
        found = self.params.get(name)
        return None if found is None else found.dim

    @property
    def replicated(self) -> list[Placement]:
        return [p for p in self.params.values() if p.dim is None]

    @property
    def sharded(self) -> list[Placement]:
        return [p for p in self.params.values() if p.dim is not None]

    def bytes_per_rank(self, names: Iterable[str] | None = None) -> int:
        """Parameter bytes one rank holds (of `names`, default all)."""
        chosen = self.params.values() if names is None else [
            self.params[n] for n in names if n in self.params]
        return sum(p.bytes if p.dim is None else p.bytes // self.degree for p in chosen)

    def describe(self, names: Iterable[str] | None = None) -> str:
        """A readable table (of `names`, default all): each parameter's style and dim, then
        what stays replicated, why, and the bytes it costs every rank."""
        chosen = list(self.params.values()) if names is None else [
            self.params[n] for n in names if n in self.params]
        lines = [f"tensor parallel {self.degree} ({self.source}):"]
        for p in chosen:
            where = f"dim {p.dim}" if p.dim is not None else "whole"
            if p.chunks > 1:
                where += f", each of {p.chunks} fused chunks"
            lines.append(f"  {p.name}: {p.style} ({where}) - {p.why}")
        kept = [p for p in chosen if p.dim is None]
        total = sum(p.bytes for p in chosen)
        lines.append(f"  replicated: {len(kept)} of {len(chosen)} parameters, "
                     f"{sum(p.bytes for p in kept)} of {total} bytes held whole on every rank")
        lines.extend(f"  note: {n}" for n in self.notes)
        lines.append(f"  loss: {self.loss.used} ({self.loss.why})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


# -- the graph's parameters and matmuls -----------------------------------------------------


def _params(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """The parameters the graph reads (get_attr targets that are nn.Parameters)."""
    found: dict[str, torch.Tensor] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = _attr(gm, str(node.target))
            if isinstance(value, torch.nn.Parameter):
                found[str(node.target)] = value
    return found


def _attr(gm: fx.GraphModule, target: str) -> Any:
    owner: Any = gm
    for part in target.split("."):
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return owner


@dataclass(frozen=True)
class Matmul:
    node: fx.Node
    weight: str  # the parameter's name
    out_dim: int  # the weight's output-feature dim
    in_dim: int
    bias: str | None
    activation: fx.Node


def _param_of(node: Any, params: Mapping[str, torch.Tensor]) -> tuple[str, bool] | None:
    """(name, transposed) when `node` reads a 2-D parameter, directly or through a transpose."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "get_attr" and str(node.target) in params:
        return (str(node.target), False) if params[str(node.target)].dim() == 2 else None
    if node.op == "call_function" and node.target in _TRANSPOSES and node.args:
        inner = _param_of(node.args[0], params)
        return None if inner is None else (inner[0], not inner[1])
    return None


def _bias_of(node: Any, params: Mapping[str, torch.Tensor]) -> str | None:
    if isinstance(node, fx.Node) and node.op == "get_attr" and str(node.target) in params:
        return str(node.target) if params[str(node.target)].dim() == 1 else None
    return None


def matmul_of(node: fx.Node, params: Mapping[str, torch.Tensor]) -> Matmul | None:
    """`node` as a matmul of an activation by a parameter weight, else None."""
    if node.op != "call_function" or node.target not in _MATMULS:
        return None
    if node.target is aten.linear.default:
        found = _param_of(node.args[1], params)
        bias = _bias_of(node.args[2], params) if len(node.args) > 2 else None
        x = node.args[0]
        if found is None or found[1]:
            return None
        return Matmul(node, found[0], 0, 1, bias, x) if isinstance(x, fx.Node) else None
    offset = 1 if node.target is aten.addmm.default else 0
    x, w = node.args[offset], node.args[offset + 1]
    found = _param_of(w, params)
    if found is None or not isinstance(x, fx.Node):
        return None
    bias = _bias_of(node.args[0], params) if offset else None
    out_dim, in_dim = (0, 1) if found[1] else (1, 0)
    return Matmul(node, found[0], out_dim, in_dim, bias, x)


def _shape(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    shape = getattr(val, "shape", None)
    if shape is None:
        return None
    try:
        return tuple(int(s) for s in shape)
    except TypeError:  # a symbolic size (the batch): only the trailing dims are read
        return tuple(int(s) if isinstance(s, int) else -1 for s in shape)


# -- following a column-parallel candidate ----------------------------------------------------


@dataclass
class _Reach:
    rows: list[Matmul] = field(default_factory=list)
    heads: list[int] = field(default_factory=list)  # head counts of the views met
    stop: str | None = None  # why the path is not transparent
    output: bool = False  # reaches the graph's output
    chunks: int | None = None  # a split of the features into equal chunks (fused qkv)
    fused: str | None = None  # why a fused split cannot be split per head
    rank: int = 0  # the projection output's dims (a heads view adds one)


def _follow(start: Matmul, matmuls: Mapping[fx.Node, Matmul]) -> _Reach:
    """Where `start`'s output goes: the row-parallel matmuls it reaches through transparent
    ops, the head counts of the views that split its features, or why it cannot be split."""
    reach = _Reach()
    features = _shape(start.node)
    width = features[-1] if features else None
    reach.rank = len(features) if features else 0
    seen: set[fx.Node] = set()
    todo = [start.node]
    while todo and reach.stop is None:
        node = todo.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            row = matmuls.get(user)
            if row is not None and row.activation is node:
                reach.rows.append(row)
                continue
            if user.op == "output":
                reach.output = True
                continue
            if user.op != "call_function":
                reach.stop = f"its output is read by {user.op} {user.name}"
                break
            target = user.target
            if target in _SPLITS:
                if not _per_head(node, user, width, reach):
                    _chunks(node, user, width, reach)
            elif target is aten.view.default or target is aten.reshape.default or \
                    target is aten._unsafe_view.default:
                _heads(node, user, width, reach)
            elif target is aten.slice.Tensor or target is aten.narrow.default:
                _sliced(node, user, width, reach)
            elif target in _REDUCTIONS:
                if not _per_head(node, user, width, reach):
                    reach.stop = f"its features are reduced by {user.name}"
                    break
            elif not (target in _SHAPE_OPS or target in _ATTENTION or target is operator.getitem
                      or torch.Tag.pointwise in getattr(target, "tags", ())):
                reach.stop = f"its output meets {getattr(target, '__name__', target)}"
                break
            todo.append(user)
    return reach


def _last_dim(op: fx.Node, rank: int) -> bool:
    """Whether `op` (a split, chunk or reduction) works on the last of `rank` dims only."""
    target = op.target
    if target in (aten.layer_norm.default, aten.native_layer_norm.default,
                  aten.rms_norm.default):
        shape = op.args[1] if len(op.args) > 1 else None
        return isinstance(shape, (list, tuple)) and len(shape) == 1
    if target is aten.unbind.int:
        dims: Any = op.args[1] if len(op.args) > 1 else op.kwargs.get("dim", 0)
    elif target in _SPLITS:
        dims = op.args[2] if len(op.args) > 2 else op.kwargs.get("dim", 0)
    elif target is aten.linalg_vector_norm.default:
        dims = op.args[2] if len(op.args) > 2 else op.kwargs.get("dim")
    else:
        dims = op.args[1] if len(op.args) > 1 else op.kwargs.get("dim")
    dims = [dims] if isinstance(dims, int) else dims
    return (isinstance(dims, (list, tuple)) and len(dims) == 1 and isinstance(dims[0], int)
            and rank > 0 and dims[0] % rank == rank - 1)


def _per_head(source: fx.Node, op: fx.Node, width: int | None, reach: _Reach) -> bool:
    """Whether `op` splits or reduces within each head: the heads have a dim of their own
    (a heads view was met) and `op` works on the last dim, each head's features (a norm of
    each head's q or k, GPT-NeoX's per-head q/k/v split)."""
    shape = _shape(source)
    if not reach.heads or not shape or width is None or len(shape) <= reach.rank:
        return False
    per_head = {width // h for h in reach.heads if h > 0}
    if reach.chunks:
        per_head |= {width // reach.chunks // h for h in reach.heads if h > 0}
    return shape[-1] in per_head and _last_dim(op, len(shape))


def _sliced(source: fx.Node, op: fx.Node, width: int | None, reach: _Reach) -> None:
    """A slice of the projection's features (q, k and v cut out of a fused projection by
    position, uneven when the kv heads are fewer): the fused group cannot be split per head.
    A slice inside each head once the heads have a dim of their own (rotary halves) is not."""
    shape = _shape(source)
    dim = op.args[1] if len(op.args) > 1 else op.kwargs.get("dim", 0)
    if shape and width and isinstance(dim, int) and len(shape) <= reach.rank \
            and dim % len(shape) == len(shape) - 1 \
            and shape[-1] in (width, width // (reach.chunks or 1)):
        reach.fused = f"its features are sliced by {op.name}"


def _chunks(source: fx.Node, split: fx.Node, width: int | None, reach: _Reach) -> None:
    """A split of the projection's features into equal chunks (a fused q/k/v): note how
    many, or why it cannot be split per head (uneven chunks, another dim)."""
    shape = _shape(source)
    size = split.args[1] if len(split.args) > 1 else None
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if split.target is aten.chunk.default and isinstance(size, int) and size > 0 and width \
            and width % size == 0:
        size = width // size  # chunk(n): n chunks of width / n
    if (split.target in (aten.split.Tensor, aten.chunk.default) and shape and width
            and isinstance(size, int) and isinstance(dim, int)
            and dim % len(shape) == len(shape) - 1 and shape[-1] == width and width % size == 0):
        reach.chunks = width // size
    else:
        reach.fused = f"its features are split by {split.name} other than into equal chunks"


def _heads(source: fx.Node, view: fx.Node, width: int | None, reach: _Reach) -> None:
    """A view that splits the projection's `width` features (or one of its fused chunks)
    into (heads, head dim): note the head count."""
    before, after = _shape(source), _shape(view)
    if not before or not after or width is None or len(after) < 2:
        return
    chunk = width // reach.chunks if reach.chunks else width
    if before[-1] not in (width, chunk):
        return
    heads, head_dim = after[-2], after[-1]
    if heads > 0 and heads * head_dim == before[-1]:
        reach.heads.append(heads)


# -- the derivation ---------------------------------------------------------------------------


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Builder:
    """Placements chosen so far; a parameter chosen twice with different dims is replicated."""

    def __init__(self, params: Mapping[str, torch.Tensor], degree: int) -> None:
        self.params = params
        self.degree = degree
        first: dict[int, str] = {}
        # A tensor read under several names (tied) is placed once, under its first name.
        self.canonical = {name: first.setdefault(id(t), name) for name, t in params.items()}
        self.chosen: dict[str, Placement] = {}
        self.conflicts: set[str] = set()
        self.notes: list[str] = []

    def set(self, name: str, dim: int | None, style: Style, why: str, chunks: int = 1) -> None:
        name = self.canonical[name]
        tensor = self.params[name]
        if dim is not None and tensor.shape[dim] % (self.degree * chunks):
            why = f"{why}, but dim size {tensor.shape[dim]} is not divisible by {self.degree}"
            dim, style = None, "replicate"
        old = self.chosen.get(name)
        if old is not None and old.dim != dim:
            self.conflicts.add(name)
            return
        if old is None:
            self.chosen[name] = Placement(name, dim, style, why, _nbytes(tensor),
                                          chunks if dim is not None else 1)

    def finish(self, source: str) -> TPPlan:
        for name in self.conflicts:
            self.chosen[name] = Placement(
                name, None, "replicate", "read by ops that split it differently",
                _nbytes(self.params[name]))
        for name, tensor in self.params.items():
            main = self.canonical[name]
            if main != name and main in self.chosen:
                self.chosen[name] = dataclasses.replace(
                    self.chosen[main], name=name, why=f"{self.chosen[main].why} (tied to {main})")
            elif name not in self.chosen:
                self.chosen[name] = Placement(
                    name, None, "replicate", "no tensor-parallel rule covers it",
                    _nbytes(tensor))
        return TPPlan(self.degree, dict(self.chosen), source, tuple(self.notes))


def derive_tp_plan(gm: fx.GraphModule, degree: int) -> TPPlan:
    """The plan of the captured flat graph `gm` for `degree` tensor-parallel ranks (see the
    module docstring for the rules)."""
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ValueError(f"tensor_parallel must be an int >= 1, got {degree!r}")
    params = _params(gm)
    build = _Builder(params, degree)
    matmuls = {n: mm for n in gm.graph.nodes if (mm := matmul_of(n, params)) is not None}
    reaches = {node: _follow(mm, matmuls) for node, mm in matmuls.items()}
    # Groups: columns sharing a row-parallel matmul (q, k, v -> o; gate, up -> down).
    columns_of: dict[fx.Node, list[fx.Node]] = {}
    for node, reach in reaches.items():
        if reach.stop is None and reach.rows and not reach.output:
            for row in reach.rows:
                columns_of.setdefault(row.node, []).append(node)
    done: set[fx.Node] = set()
    for row_node, columns in columns_of.items():
        if row_node in done:
            continue
        _group(build, matmuls, reaches, row_node, columns, columns_of, done)
    _heads_and_embeddings(build, gm, matmuls, reaches, params, done)
    return build.finish("derived")


def _group(build: _Builder, matmuls: Mapping[fx.Node, Matmul],
           reaches: Mapping[fx.Node, _Reach], row_node: fx.Node, columns: list[fx.Node],
           columns_of: Mapping[fx.Node, list[fx.Node]], done: set[fx.Node]) -> None:
    """Place one Megatron group: its column-parallel projections and row-parallel ones."""
    rows = {row_node}
    cols = list(dict.fromkeys(columns))
    for col in cols:
        rows.update(r.node for r in reaches[col].rows)
    for r in rows:
        cols.extend(c for c in columns_of.get(r, []) if c not in cols)
    done.update(rows)
    degree = build.degree
    names = ", ".join(sorted({matmuls[c].weight for c in cols}))
    fused = [reaches[c].fused for c in cols if reaches[c].fused]
    if fused:
        for node in (*cols, *rows):
            build.set(matmuls[node].weight, None, "replicate", f"fused projection: {fused[0]}")
        build.notes.append(f"replicated a fused projection group ({names})")
        return
    heads = {c: reaches[c].heads for c in cols}
    # The widest head count is the queries'; fewer heads are grouped-query k / v.
    counts = [h for c in cols for h in heads[c]]
    q_heads = max(counts) if counts else None
    if q_heads is not None and q_heads % degree:
        for node in (*cols, *rows):
            build.set(matmuls[node].weight, None, "replicate",
                      f"{q_heads} attention heads not divisible by tensor_parallel={degree}")
        build.notes.append(f"replicated attention ({names}): {q_heads} heads, tp={degree}")
        return
    for c in cols:
        mm = matmuls[c]
        few = [h for h in heads[c] if h % degree]
        if few:
            why = (f"{few[0]} kv heads not divisible by tensor_parallel={degree}: replicated, "
                   "query groups kept whole per rank")
            build.set(mm.weight, None, "replicate", why)
            if mm.bias is not None:
                build.set(mm.bias, None, "replicate", why)
            continue
        what = "attention heads" if heads[c] else "pair's first matmul"
        chunks = reaches[c].chunks or 1
        if chunks > 1:
            what = f"fused projection of {chunks} chunks, each split by heads"
        build.set(mm.weight, mm.out_dim, "colwise", f"column-parallel ({what})", chunks)
        if mm.bias is not None:
            build.set(mm.bias, 0, "colwise", "bias of a column-parallel matmul", chunks)
    for r in rows:
        mm = matmuls[r]
        build.set(mm.weight, mm.in_dim, "rowwise", "row-parallel (pair's second matmul)")
        if mm.bias is not None:
            build.set(mm.bias, None, "replicate", "bias after a row-parallel matmul (added once)")


def _heads_and_embeddings(build: _Builder, gm: fx.GraphModule,
                          matmuls: Mapping[fx.Node, Matmul], reaches: Mapping[fx.Node, _Reach],
                          params: Mapping[str, torch.Tensor], done: set[fx.Node]) -> None:
    """LM heads (a projection reaching the output alone) column-parallel; token embeddings
    vocab-parallel."""
    for node, reach in reaches.items():
        mm = matmuls[node]
        if reach.output and not reach.rows and reach.stop is None and mm.weight not in \
                build.chosen:
            build.set(mm.weight, mm.out_dim, "colwise", "LM head: column-parallel, logits "
                      "split by class (loss parallel) or gathered")
            if mm.bias is not None:
                build.set(mm.bias, 0, "colwise", "bias of a column-parallel LM head")
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.embedding.default:
            continue
        weight = node.args[0]
        if not (isinstance(weight, fx.Node) and weight.op == "get_attr"
                and str(weight.target) in params):
            continue
        name = str(weight.target)
        if _from_input(node.args[1]):
            build.set(name, 0, "vocab", "token embedding: vocab-parallel")
        else:
            build.set(name, None, "replicate", "position-style table (indices not an input)")


def _from_input(node: Any) -> bool:
    """Whether `node` is a graph input, directly or through views."""
    while isinstance(node, fx.Node):
        if node.op == "placeholder":
            return True
        if node.op != "call_function" or node.target not in _SHAPE_OPS:
            return False
        node = node.args[0]
    return False


# -- given plans ------------------------------------------------------------------------------


def given_tp_plan(gm: fx.GraphModule, degree: int, rules: Mapping[str, Any]) -> TPPlan:
    """The plan of `rules`: module path glob -> "colwise" | "rowwise" | "replicate" (or a
    torch ColwiseParallel / RowwiseParallel; a Hugging Face ``base_model_tp_plan``'s
    "colwise_rep" / "rowwise_rep" / ... read by their first word). A module matched by a
    colwise rule has its matmul's weight split along its output features (an embedding along
    its vocabulary), a rowwise one along its input features; the rest is replicated. The
    first matching rule wins."""
    if not isinstance(rules, Mapping):
        raise TypeError(f"tp_plan must be a dict of module path glob -> style, got {rules!r}")
    styles = {glob: _style(glob, value) for glob, value in rules.items()}
    params = _params(gm)
    build = _Builder(params, degree)
    used: set[str] = set()
    for node in gm.graph.nodes:
        mm = matmul_of(node, params)
        if mm is not None:
            _apply_rule(build, styles, used, mm.weight, mm.bias, mm.out_dim, mm.in_dim)
        elif node.op == "call_function" and node.target is aten.embedding.default:
            weight = node.args[0]
            if isinstance(weight, fx.Node) and str(weight.target) in params:
                _apply_rule(build, styles, used, str(weight.target), None, 0, 1)
    unused = [g for g in styles if g not in used]
    if unused:
        build.notes.append(f"tp_plan rules matching no matmul or embedding: {unused}")
    return build.finish("given")


def _apply_rule(build: _Builder, styles: Mapping[str, Style], used: set[str], weight: str,
                bias: str | None, out_dim: int, in_dim: int) -> None:
    module = weight.rpartition(".")[0]
    for glob, style in styles.items():
        if fnmatch.fnmatchcase(module, glob):
            used.add(glob)
            if style == "colwise":
                build.set(weight, out_dim, "colwise", f"tp_plan {glob!r}: colwise")
                if bias is not None:
                    build.set(bias, 0, "colwise", f"tp_plan {glob!r}: colwise bias")
            elif style == "rowwise":
                build.set(weight, in_dim, "rowwise", f"tp_plan {glob!r}: rowwise")
                if bias is not None:
                    build.set(bias, None, "replicate", f"tp_plan {glob!r}: rowwise bias")
            else:
                build.set(weight, None, "replicate", f"tp_plan {glob!r}: replicate")
            return


def _style(glob: str, value: Any) -> Style:
    """A rule's style: a string (its first word before "_") or a torch ParallelStyle."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(value, ColwiseParallel):
        return "colwise"
    if isinstance(value, RowwiseParallel):
        return "rowwise"
    if isinstance(value, str):
        word = value.split("_")[0] if value.startswith(("colwise", "rowwise")) else value
        if word in STYLES:
            return word  # type: ignore[return-value]
    raise ValueError(
        f"tp_plan[{glob!r}] is {value!r}; use 'colwise', 'rowwise', 'replicate', or a "
        "torch.distributed.tensor.parallel ColwiseParallel / RowwiseParallel"
    )


def hf_tp_plan(model: torch.nn.Module) -> dict[str, str] | None:
    """A Hugging Face model's own ``base_model_tp_plan`` (its globs relative to the base
    model, made to match anywhere), or None when it has none."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        return None
    return {f"*{glob}": str(style) for glob, style in plan.items()}
