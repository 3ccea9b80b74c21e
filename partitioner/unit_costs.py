"""What one captured unit costs, as a frozen record: `UnitCosts` (its forward, input-grad and
weight-grad seconds for one microbatch, the bytes autograd keeps for its backward, where the
figures came from) and `PolicyCosts` (what each activation policy keeps and adds on it).
Profiling (`partitioner.profile`), the meta estimate (`partitioner.estimate`) and the policy
pricing (`partitioner.activation_cost`) return them per unit; a `Captured` carries them
(`Captured.costs`, attached by `Captured.with_costs`), and every reader reads them by field."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Source = Literal["profile", "estimate", "measured"]


@dataclass(frozen=True)
class PolicyCosts:
    """What the activation policies cost on one unit, per microbatch (the unit that opens a
    block carries the block's figures, the others zeros; partitioner.activation_cost):

    - `kept`: policy ("none", "full", "selective") -> bytes kept for the backward in the first
      stage; `kept_later`: the same in a later stage, where the unit's inputs a gradient
      reaches need grad;
    - `added`: policy ("full", "selective") -> the time a forward and backward under it takes
      beyond a plain one, as a share of the plain one;
    - `recompute_flops`: policy ("full", "selective") -> FLOPs of the matmuls, convolutions
      and attention its recomputation runs;
    - `held_to_w`: policy ("full", "selective") -> bytes a split backward's B keeps for W;
    - `offload_time`: seconds to move the "none" bytes to host memory one way; None on a CPU
      device, where "offload" moves nothing;
    - `shared_reads`: values the block reads that an earlier block read too -> their bytes
      (a later stage receives, and keeps, such a value once)."""

    kept: Mapping[str, float]
    kept_later: Mapping[str, float]
    added: Mapping[str, float]
    recompute_flops: Mapping[str, float]
    held_to_w: Mapping[str, float]
    offload_time: float | None
    shared_reads: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class UnitCosts:
    """One unit's costs for one microbatch: `forward`, `input_grad` (B: the gradient w.r.t.
    its inputs alone) and `weight_grad` (W: the rest of its backward) in seconds,
    `activation_bytes` autograd keeps for its backward, `source` ("profile": measured unit by
    unit; "estimate": FLOPs and bytes on meta; "measured": scaled to measured steps),
    `measured_as` (the identical unit whose measurement it reuses, or None), the FLOPs an
    estimate counted, and `policies` once the activation policies are priced."""

    forward: float = 0.0
    input_grad: float = 0.0
    weight_grad: float = 0.0
    activation_bytes: float = 0.0
    source: Source = "profile"
    measured_as: str | None = None
    forward_flops: float | None = None
    backward_flops: float | None = None
    policies: PolicyCosts | None = None

    @property
    def backward(self) -> float:
        """The whole backward (input grads + weight grads)."""
        return self.input_grad + self.weight_grad

    def scaled(self, forward: float, backward: float) -> UnitCosts:
        """These costs with the forward times `forward` and the backward ones `backward`,
        marked measured (no longer an estimate)."""
        return dataclasses.replace(
            self, forward=self.forward * forward, input_grad=self.input_grad * backward,
            weight_grad=self.weight_grad * backward, source="measured")


def with_policies(costs: Mapping[str, UnitCosts], policies: Mapping[str, PolicyCosts]
                  ) -> dict[str, UnitCosts]:
    """`costs` with each unit's `policies` from `policies` (every unit in both)."""
    missing = sorted(set(policies) - set(costs))
    if missing:
        raise ValueError(
            f"units {missing[:3]} have policy prices but no costs; profile (or estimate) "
            "the units before pricing the policies"
        )
    return {v: dataclasses.replace(c, policies=policies.get(v, c.policies))
            for v, c in costs.items()}


def costs_as_data(costs: Mapping[str, UnitCosts]) -> dict[str, dict[str, Any]]:
    """`costs` as plain data (Python floats, strings, None, dicts), e.g. for a checkpoint,
    which loads with ``torch.load(weights_only=True)``; `costs_from_data` reads it back
    equal."""
    return {v: _plain(dataclasses.asdict(c)) for v, c in costs.items()}


def _plain(value: Any) -> Any:
    """`value` with every mapping a dict and every number a Python float (a NumPy or torch
    scalar would not load back with weights_only)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, bool)):
        return value
    return float(value)


def costs_from_data(data: Mapping[str, Mapping[str, Any]]) -> dict[str, UnitCosts]:
    """The `UnitCosts` per unit that `costs_as_data` wrote."""
    out = {}
    for v, fields in data.items():
        policies = fields.get("policies")
        out[v] = UnitCosts(**{**fields, "policies": None if policies is None
                              else PolicyCosts(**policies)})
    return out
