"""Devices the planner prices a job for without having them: `Target` records (peak FLOP/s per
dtype, memory bandwidth and capacity, kernel efficiency by shape, links) in `TARGETS`, the
NCCL-style collective model (`collectives`) and the local CPU measured by a microbenchmark
(`local`). Every constant is named next to its source; docs/planning-at-scale.md lists them."""

from dataclasses import replace
from typing import Any

from pipeline.planning.hardware.collectives import Placement, collective_seconds, p2p_seconds
from pipeline.planning.hardware.local import local_target
from pipeline.planning.hardware.targets import TARGETS, Network, Target

LOCAL = "cpu"
"""The name of the local CPU target (`local_target`: microbenchmarked, cached)."""


def target_named(name: str, gpus_per_node: int | None = None,
                 runtime: dict[str, Any] | None = None) -> Target:
    """The target called `name` ("cpu" measures this machine, cached, with the pipeline
    runtime's measured cost per action and per step `runtime` when given), with its node's
    GPU count replaced when `gpus_per_node` is given."""
    if name == LOCAL:
        found = local_target(runtime=runtime)
    elif name in TARGETS:
        found = TARGETS[name]
    else:
        raise ValueError(f"unknown target {name!r}; choose one of {[*TARGETS, LOCAL]}")
    if gpus_per_node is None:
        return found
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    return replace(found, network=replace(found.network, gpus_per_node=gpus_per_node))


__all__ = [
    "LOCAL",
    "TARGETS",
    "Network",
    "Placement",
    "Target",
    "collective_seconds",
    "p2p_seconds",
    "target_named",
]
