"""Autocast regions inside a model's forward, as capture meets them: torch.export records each
``with torch.autocast(...)`` block as a ``wrap_with_autocast`` higher-order op. A block within
one unit stays whole in the flat graph (it runs as written); a block over several module calls
(an autocast around the whole forward) would make its modules one unit, so `inline_regions`
puts its ops into the flat graph, each run under the block's autocast (`Autocasted`), and the
units, and so the stages, cut it where they cut the modules. torch.fx traces straight through
such a block and would drop it, so `AutocastSpy` notices the blocks an fx trace enters and
`dropped` turns them into a clear error instead of a silently different model."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import PreDispatchTorchFunctionMode
from torch.overrides import TorchFunctionMode

WRAP_WITH_AUTOCAST = torch.ops.higher_order.wrap_with_autocast


class AutocastSpy(PreDispatchTorchFunctionMode):
    """A torch-function mode, active around an fx trace, that records the autocast blocks the
    traced code enters: ``torch.autocast.__enter__`` reports itself (``torch.amp.
    _enter_autocast``) only to a pre-dispatch mode, which is why this is one. Every other
    function passes through unchanged. `regions`: (device type, dtype, enabled) each."""

    def __init__(self) -> None:
        TorchFunctionMode.__init__(self)  # no tracer: this mode records, it builds nothing
        self.regions: list[tuple[str, torch.dtype | None, bool]] = []
        self.active_at_start = {
            t for t in ("cpu", "cuda") if torch.is_autocast_enabled(t)
        }

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func is torch.amp._enter_autocast:
            device, dtype, enabled = args[0], args[1], bool(args[2])
            self.regions.append((str(device), dtype, enabled))
            return None
        if func is torch.amp._exit_autocast:
            return None
        return func(*args, **(kwargs or {}))

    def dropped(self, model_name: str) -> str | None:
        """Why the fx graph is wrong, when it lost a block: one that turns autocast on, or off
        while the capture runs under autocast (mixed_precision=); else None."""
        dropped = [
            r for r in self.regions if r[2] or r[0] in self.active_at_start
        ]
        if not dropped:
            return None
        shown = ", ".join(
            f'torch.autocast("{d}", dtype={t}, enabled={e})' for d, t, e in dropped
        )
        return (
            f"{model_name}'s forward enters {shown}; torch.fx cannot record an autocast block "
            "(the traced graph would run it in the surrounding precision, silently). Capture "
            "with torch.export instead (capture_method='export', which keeps the block), keep "
            "the module that enters it whole with leaf_modules=(ThatModule,), or remove the "
            "block and build the Pipeline with mixed_precision=torch.bfloat16 (or float16)"
        )


class Region(NamedTuple):
    """One ``torch.autocast(device_type, dtype, enabled, cache_enabled)`` block, as the first
    four arguments of ``wrap_with_autocast`` record it."""

    device_type: str
    dtype: torch.dtype | None
    enabled: bool
    cache_enabled: bool | None

    def __str__(self) -> str:
        return (f'torch.autocast("{self.device_type}", dtype={self.dtype}, '
                f"enabled={self.enabled})")


class Autocasted:
    """A graph op (a call_function target) run under the autocast blocks that held it in the
    model's forward, outermost first, so that whichever stage, activation block or compiled
    region holds the op runs it as the unsplit model does. Each call enters and leaves the
    blocks: the autocast cache of cast weights lasts one op, so a weight that several ops of
    a block read is cast for each (the same values; its gradient sums in fp32)."""

    def __init__(self, op: Callable[..., Any], regions: tuple[Region, ...]) -> None:
        self.op = op
        self.regions = regions
        self.__name__ = f"autocast_{getattr(op, '__name__', 'op')}"  # fx names its global so

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _run(self.regions, self.op, args, kwargs)

    def __repr__(self) -> str:
        return f"{self.op} under {' in '.join(str(r) for r in reversed(self.regions))}"


def _run(
    regions: tuple[Region, ...], op: Callable[..., Any], args: Any, kwargs: Any
) -> Any:
    if not regions:
        return op(*args, **kwargs)
    with torch.autocast(*regions[0]):  # a plain with block: torch.compile traces it
        return _run(regions[1:], op, args, kwargs)


def op_of(target: Any) -> Any:
    """The op itself of a call_function target (`Autocasted` or not)."""
    return target.op if isinstance(target, Autocasted) else target


def retarget_autocast(node: fx.Node, device: torch.device) -> bool:
    """Point an autocast block captured on another device type (Hugging Face models name the
    device type of their inputs), whole or per op, at `device`'s type where autocast exists
    there; returns whether it changed."""
    kind = device.type
    if not torch.amp.is_autocast_available(kind):
        return False
    changed = False
    target = node.target
    if isinstance(target, Autocasted) and any(r.device_type != kind for r in target.regions):
        node.target = Autocasted(
            target.op, tuple(r._replace(device_type=kind) for r in target.regions)
        )
        changed = True
    if op_of(node.target) is WRAP_WITH_AUTOCAST and node.args and node.args[0] != kind:
        node.update_arg(0, kind)
        changed = True
    return changed


# ---------------------------------------------------------------------------------------------
# Blocks over several units: their ops into the flat graph
# ---------------------------------------------------------------------------------------------

UnitKey = Callable[[fx.Node], str]


def _symbolic(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.SymInt | torch.SymBool | torch.SymFloat)


def _body(owner: fx.GraphModule, hop: fx.Node) -> fx.GraphModule:
    getter = hop.args[4]
    assert isinstance(getter, fx.Node) and getter.op == "get_attr"
    body = owner.get_submodule(str(getter.target))
    assert isinstance(body, fx.GraphModule)
    return body


def _keys(owner: fx.GraphModule, hop: fx.Node, unit_key: UnitKey) -> list[str]:
    """The units (module calls) the block's ops belong to, in order, the block's own first."""
    keys = [unit_key(hop)]
    for n in _body(owner, hop).graph.nodes:
        if n.op == "call_function" and not _symbolic(n) and unit_key(n) not in keys:
            keys.append(unit_key(n))
    return keys


def inline_regions(gm: fx.GraphModule, unit_key: UnitKey, model_name: str) -> bool:
    """Put the ops of every autocast block of `gm`'s graph whose ops belong to several units
    (by `unit_key`) into the graph itself, each an `Autocasted` op under the block (and under
    the blocks around it, for a nested one that is inlined too); a block within one unit stays
    whole. Returns whether the graph changed. ValueError, naming the block and pointing to
    the Pipeline's ``mixed_precision=``, for a block whose ops cannot be put in the graph."""
    hops = [n for n in gm.graph.nodes
            if n.target is WRAP_WITH_AUTOCAST and len(_keys(gm, n, unit_key)) > 1]
    for hop in hops:
        inliner = _Inliner(gm, unit_key, model_name, hop)
        with gm.graph.inserting_before(hop):
            outputs = inliner.copy(gm, hop, ())
        for user in list(hop.users):
            if user.target is not operator.getitem:
                raise inliner.refuse(f"its result is read by {user.format_node()}, not by item")
            user.replace_all_uses_with(outputs[user.args[1]])
            gm.graph.erase_node(user)
        getter = hop.args[4]
        gm.graph.erase_node(hop)
        assert isinstance(getter, fx.Node)
        if not getter.users:
            gm.graph.erase_node(getter)
            gm.delete_submodule(str(getter.target))
    if hops:
        gm.graph.lint()
        gm.recompile()
    return bool(hops)


class _Inliner:
    """Copies an autocast block's body (recursively, for nested blocks over several units)
    into the flat graph at the current insertion point."""

    def __init__(self, gm: fx.GraphModule, unit_key: UnitKey, model_name: str, hop: fx.Node):
        self.gm = gm
        self.unit_key = unit_key
        self.model_name = model_name
        self.region = Region(*hop.args[:4])  # type: ignore[arg-type]
        self.modules = [k for k in _keys(gm, hop, unit_key) if k]

    def refuse(self, why: str) -> ValueError:
        shown = ", ".join(self.modules[:4]) + (", ..." if len(self.modules) > 4 else "")
        return ValueError(
            f"{self.model_name}'s forward runs {shown} inside one {self.region} block, which "
            f"a pipeline must cut between stages, and this block cannot be cut: {why}. Remove "
            f"the `with torch.autocast(...)` around them and build the Pipeline with "
            f"mixed_precision={self.region.dtype} (or torch.float16), which runs every stage "
            "under the same autocast"
        )

    def copy(
        self, owner: fx.GraphModule, hop: fx.Node, outer: tuple[Region, ...], env_of: Any = None
    ) -> list[Any]:
        """The flat graph's values of the block's results; `hop` is a node of `owner`'s
        graph whose operands `env_of` maps (identity for the flat graph's own)."""
        regions = (*outer, Region(*hop.args[:4]))  # type: ignore[arg-type]
        operands = [env_of(a) if env_of else a for a in hop.args[5:]]
        graph = self.gm.graph
        body = _body(owner, hop)
        env: dict[fx.Node, Any] = {}

        def read(arg: fx.Node) -> Any:
            value = env[arg]
            if isinstance(value, list):
                raise self.refuse(f"a nested block's result is read whole by {arg.name}")
            return value

        placeholders = iter(operands)
        for n in body.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(placeholders)
            elif n.op == "output":
                return list(fx.node.map_arg(n.args[0], read))
            elif n.op == "get_attr":  # a nested block's body
                if all(u.target is WRAP_WITH_AUTOCAST and len(_keys(body, u, self.unit_key)) > 1
                       for u in n.users):
                    continue  # its block is inlined below
                name = f"autocast_body_{len(list(self.gm.named_children()))}"
                self.gm.add_submodule(name, body.get_submodule(str(n.target)))
                env[n] = graph.get_attr(name)
                env[n].meta = dict(n.meta)
            elif n.target is WRAP_WITH_AUTOCAST and len(_keys(body, n, self.unit_key)) > 1:
                env[n] = self.copy(body, n, regions, read)
            elif n.target is operator.getitem and isinstance(env.get(n.args[0]), list):
                env[n] = env[n.args[0]][n.args[1]]
            elif n.op == "call_function":
                env[n] = graph.node_copy(n, read)
                if isinstance(n.target, torch._ops.OperatorBase) and not _symbolic(n):
                    env[n].target = Autocasted(n.target, regions)
            else:
                raise self.refuse(f"it holds {n.format_node()}")
        raise self.refuse("its body has no output")
