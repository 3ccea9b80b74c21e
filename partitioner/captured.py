"""The captured model: the record every capture front end returns and everything after
capture (profiling, partitioning, splitting, the planner and the executor) reads."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import networkx as nx
from torch import fx, nn
from torch.utils._pytree import TreeSpec

from partitioner.unit_costs import UnitCosts

Method = Literal["export", "fx", "sequential"]


@dataclass(frozen=True)
class Value:
    """What one value of the flat graph held on the example input: its shape and dtype (the
    last tensor's for a tuple; shape None and the Python type's name for a non-tensor), the
    bytes of every tensor in it, and whether it is one tensor (cuts may only carry those)."""

    shape: tuple[int, ...] | None
    dtype: str
    bytes: int
    tensor: bool


@dataclass(frozen=True)
class Captured:
    """A model captured as units (runs of nodes of one flat fx graph), in execution order.

    This is the contract a capture front end implements (see `partitioner.capture.FRONT_ENDS`):

    - `graph`: a networkx DiGraph with one node per unit, named as in `order`. A node's
      attributes describe that unit only: name, op (call_module for a module's unit, else as
      fx's for its node), target (the module's path, as fx's call_module, or the op), module
      (its path, or None), members (its flat node names), shape and dtype (of the last value
      it hands on), bytes and tensor (of all values it hands on), param_bytes (of every
      parameter it reads, so a shared layer's at each call) and index (its position in
      `order`). An edge u -> v carries `bytes`, what v reads of u's values. Costs are not
      node attributes: they are `costs`.
    - `costs`: unit name -> its `UnitCosts` (partitioner.unit_costs), empty until the units
      are costed. Profiling (`partitioner.profile`), the meta estimate
      (`partitioner.estimate`) and the policy prices (`partitioner.activation_cost`) return
      costs; `with_costs` makes the record that carries them, leaving this one as it was.
    - `model`: the module captured. `method`: the front end that captured it: "export"
      (torch.export, non-strict, its aten ops grouped by module call), "fx" (torch.fx, one unit
      per fx node) or "sequential" (an nn.Sequential's children in order).
    - `graph_module`: the flat fx graph over the model's own parameters and buffers (tied
      ones under each name) that `split_model` cuts; placeholders `inputs` (the flat leaves of
      (args, kwargs), structured as `in_spec`) and output node `output`, neither a unit.
      `out_spec`: the pytree structure of the model's output the graph's flat outputs are
      rebuilt into (torch.export), or None when the graph returns the output as the model does.
    - `unit_module`: a graph module calling one submodule per unit (the profiler runs it).
    - `unit_of`: flat node name -> its unit's position; `values`: flat node name -> `Value`
      on the example input; `recompute`: symbolic sizes every stage re-derives (never sent).
    - `input_dims`: per flat input, its dims as ints (static) or sympy expressions (dynamic),
      None for an input traced without shapes (fx); `ranges`: a dynamic size's symbol -> its
      (low, high) bounds.
    - `non_persistent`: buffers kept out of a state_dict; `aliases`: a parameter or buffer
      known under several names (tied) -> all of its names.
    - `training`: every module's .training as the export baked it in (dropout, batch norm),
      or None when the graph does not depend on it.

    Frozen: re-capture makes a new record, and so does costing it (`with_costs`); nothing
    after capture writes into the graph's node attributes.
    """

    graph: nx.DiGraph
    model: nn.Module
    method: Method
    graph_module: fx.GraphModule
    unit_module: fx.GraphModule
    order: tuple[str, ...]
    inputs: tuple[str, ...]
    output: str
    in_spec: TreeSpec
    out_spec: TreeSpec | None
    input_dims: tuple[tuple[Any, ...] | None, ...]
    ranges: Mapping[Any, tuple[int, float]]
    values: Mapping[str, Value]
    unit_of: Mapping[str, int]
    recompute: frozenset[str]
    non_persistent: frozenset[str]
    aliases: Mapping[str, list[str]]
    training: tuple[bool, ...] | None
    costs: Mapping[str, UnitCosts] = field(default_factory=dict)

    @property
    def nodes(self) -> Any:
        """The units' attributes by name (the graph's node view)."""
        return self.graph.nodes

    def __repr__(self) -> str:
        return (
            f"Captured({type(self.model).__name__}, method={self.method!r}, "
            f"{len(self.order)} units, inputs={list(self.inputs)})"
        )

    def __len__(self) -> int:
        """The number of units."""
        return len(self.order)

    def with_costs(self, costs: Mapping[str, UnitCosts]) -> Captured:
        """The same capture carrying `costs` (unit name -> `UnitCosts`, every unit of
        `order`; e.g. what `partitioner.profile` returns); the graph and modules are shared."""
        unknown = sorted(set(costs) - set(self.order))
        missing = [v for v in self.order if v not in costs]
        if unknown or missing:
            raise ValueError(
                f"costs must name every unit of the capture and no other; missing "
                f"{missing[:3]}, unknown {unknown[:3]}: pass what profile/estimate returned "
                "for this capture"
            )
        bad = [v for v, c in costs.items() if not isinstance(c, UnitCosts)]
        if bad:
            raise TypeError(
                f"costs of {bad[:3]} are not partitioner.UnitCosts (got "
                f"{type(costs[bad[0]]).__name__}); build them with UnitCosts(...)"
            )
        return dataclasses.replace(self, costs=dict(costs))

    @property
    def profiled(self) -> bool:
        """Whether every unit has its costs."""
        return bool(self.costs) and all(v in self.costs for v in self.order)

    @property
    def dynamic_dim_names(self) -> list[str] | None:
        """The inputs' dynamic dims as "name[dim]" (None when the capture kept no shapes:
        torch.fx)."""
        if all(d is None for d in self.input_dims):
            return None
        return [
            f"{name}[{k}]"
            for name, want in zip(self.inputs, self.input_dims, strict=True)
            for k, size in enumerate(want or ())
            if not isinstance(size, int)
        ]
