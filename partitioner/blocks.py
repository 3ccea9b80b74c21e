"""A stage's forward as a chain of blocks, so that a recompute policy can checkpoint one block
at a time (the way torchtitan and Megatron checkpoint per transformer layer): during the
backward only one block's activations are live again, not the whole stage's.

A block is a maximal run of the stage graph's nodes that belong to one module under an indexed
container (``blocks.3``, ``transformer.h.0``, ``model.layers.7``, a Sequential's ``2``: the
module path up to its first numeric part); nodes outside such containers (embeddings, the
final norm and head, top-level ops) form blocks of their own runs. Nodes with no module (a
shape lookup) join the block of the next node that has one.

Each block is an fx.GraphModule over the stage's graph nodes, taking the values it reads from
earlier blocks (or the stage's inputs) and returning those later blocks read; the last block
ends with the stage's own output. Blocks read parameters and submodules through the stage
module itself, so the step-private leaves the runtime swaps into it are what they use; a
parameter is read in each block that uses it, never passed between blocks."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from partitioner.autocast import op_of


def _item(path: str) -> str | None:
    """The path up to its first numeric part (``blocks.3.attn`` -> ``blocks.3``), else None."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None


def block_key(node: fx.Node) -> str | None:
    """The block `node` belongs to: the outermost module on its stack that is an item of an
    indexed container (with torch.export's call count when that module is called more than
    once, so each call of a shared layer is a block of its own), "" outside such containers,
    or None when the node has no module (a parameter read, a shape lookup)."""
    if node.op == "call_module":  # torch.fx: the module called whole
        return _item(str(node.target)) or ""
    stack = node.meta.get("nn_module_stack")
    if not stack or node.op in ("get_attr", "placeholder", "output"):
        return None
    if str(list(stack.values())[-1][0]).startswith("_empty"):
        return None
    for key, (path, _) in stack.items():
        item = _item(str(path))
        if item is not None:
            count = str(key).rpartition("@")[2] if "@" in str(key) else ""
            return f"{item}@{count}" if count.isdigit() and item == path else item
    return ""


def runs(nodes: list[fx.Node]) -> list[list[fx.Node]]:
    """`nodes` (in order) cut into blocks: maximal runs of one key, key-less nodes joining
    the next keyed node's run (the last run when none follows)."""
    keys = [block_key(n) for n in nodes]
    following: str | None = None
    for i in range(len(keys) - 1, -1, -1):
        if keys[i] is None:
            keys[i] = following
        following = keys[i]
    out: list[list[fx.Node]] = []
    last: object = object()
    for node, key in zip(nodes, keys, strict=True):
        if not out or (key is not None and key != last):
            out.append([])
        out[-1].append(node)
        if key is not None:
            last = key
    return out


_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.iand, operator.ior, operator.ixor}


def _written(node: fx.Node, stage: nn.Module) -> set[str]:
    """Names of the values `node` writes in place (a block must not write one it takes: its
    checkpoint saved it for the recomputation)."""
    target = op_of(node.target)
    args = node.args
    if isinstance(target, torch._ops.OpOverload):
        return {
            a.name
            for arg, a in zip(target._schema.arguments, args, strict=False)
            if isinstance(a, fx.Node) and arg.alias_info is not None and arg.alias_info.is_write
        }
    if not args or not isinstance(args[0], fx.Node):
        return set()
    first = args[0].name
    if node.op == "call_module":
        writes = bool(getattr(stage.get_submodule(str(target)), "inplace", False))
    elif node.op == "call_method":
        writes = str(target).endswith("_") and not str(target).startswith("_")
    elif node.op == "call_function":
        name = getattr(target, "__name__", "")
        writes = (target in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True
                  or (name.endswith("_") and not name.startswith("_")))
    else:
        writes = False
    return {first} if writes else set()


class _BlockModule(fx.GraphModule):
    """One block's graph; every attribute it reads resolves through the stage module."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "_stage" not in self.__dict__:  # still being built by fx
                raise
            return getattr(self.__dict__["_stage"], name)


@dataclass(frozen=True)
class Block:
    """One block: its module, the names of the values it takes and returns, and the values no
    later block reads (dropped once it has run)."""

    module: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    done: tuple[str, ...]


def _block(
    stage: fx.GraphModule, members: list[fx.Node], later: set[str], written: set[str],
    output: fx.Node | None, index: int,
) -> Block:
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    inputs: list[str] = []

    def read(arg: fx.Node) -> fx.Node:
        if arg.name not in env and arg.op == "get_attr":  # re-read where used, never passed
            env[arg.name] = graph.get_attr(str(arg.target))
            env[arg.name].meta = dict(arg.meta)
        elif arg.name not in env:
            inputs.append(arg.name)
            env[arg.name] = graph.placeholder(arg.name)
            env[arg.name].meta = dict(arg.meta)
            if arg.name in written:  # the checkpoint keeps the value it was given
                env[arg.name] = graph.call_function(torch.clone, (env[arg.name],))
        return env[arg.name]

    for node in members:
        env[node.name] = graph.node_copy(node, read)
    outputs = tuple(n.name for n in members if n.name in later)
    if output is not None:
        graph.output(fx.node.map_arg(output.args[0], read))
        graph.set_codegen(stage.graph._codegen)  # the stage's own output structure
    else:
        graph.output(tuple(env[name] for name in outputs))
    graph.lint()
    module = _BlockModule(stage, graph, f"{type(stage).__name__}Block{index}")
    # Drop what fx copied: reads go through the stage (see _BlockModule).
    module._modules.clear()
    module._parameters.clear()
    module._buffers.clear()
    module.__dict__["_stage"] = stage  # not a submodule: no second owner of its parameters
    return Block(module, tuple(inputs), outputs, ())


def _reads_after(cut: list[list[fx.Node]], output: fx.Node) -> list[set[str]]:
    """Per block, the names read by the blocks after it or by the stage's output."""
    needed = {a.name for a in output.all_input_nodes}
    after: list[set[str]] = []
    for members in reversed(cut):
        after.append(set(needed))
        for node in members:
            needed |= {a.name for a in node.all_input_nodes}
    return after[::-1]


def _writes_of_taken(members: list[fx.Node], stage: nn.Module) -> set[str]:
    """Names a block writes in place among the values it takes from before it."""
    own = {n.name for n in members}
    return {name for n in members for name in _written(n, stage)} - own


class BlockChain:
    """`stage`'s forward as its blocks in order: ``chain(*args, run=...)`` equals
    ``stage(*args)`` when ``run(block_module, *values)`` calls the block.

    A block that writes in place a value it takes writes a clone of it (its checkpoint keeps
    the value for the recomputation); when a later block reads that value (and must see the
    write), the block is merged into the one before it instead."""

    def __init__(self, stage: fx.GraphModule) -> None:
        nodes = list(stage.graph.nodes)
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        output = next(n for n in nodes if n.op == "output")
        cut = runs([n for n in nodes if n.op not in ("placeholder", "output", "get_attr")])
        while True:
            reads = _reads_after(cut, output)
            writes = [_writes_of_taken(members, stage) for members in cut]
            merge = next((i for i in range(1, len(cut)) if writes[i] & reads[i]), None)
            if merge is None:
                break
            cut[merge - 1 : merge + 1] = [cut[merge - 1] + cut[merge]]
        blocks = [
            _block(stage, members, reads[i], writes[i],
                   output if i == len(cut) - 1 else None, i)
            for i, members in enumerate(cut)
        ]
        # What each block's run leaves unread by every later block: dropped after it.
        self.blocks = []
        for i, b in enumerate(blocks):
            later_reads = {name for later in blocks[i + 1:] for name in later.inputs}
            done = tuple(name for name in b.inputs if name not in later_reads)
            self.blocks.append(Block(b.module, b.inputs, b.outputs, done))

    def __len__(self) -> int:
        return len(self.blocks)

    def __call__(self, *args: Any, run: Callable[..., Any]) -> Any:
        values: dict[str, Any] = {}
        for i, node in enumerate(self.placeholders):
            if i < len(args):
                values[node.name] = args[i]
            elif node.args:  # a default the caller left out
                values[node.name] = node.args[0]
            else:
                raise TypeError(f"stage input {node.name!r} missing ({len(args)} given)")
        result: Any = None
        for i, block in enumerate(self.blocks):
            result = run(block.module, *(values[name] for name in block.inputs))
            for name in block.done:
                del values[name]
            if i < len(self.blocks) - 1:
                values.update(zip(block.outputs, result, strict=True))
        return result
