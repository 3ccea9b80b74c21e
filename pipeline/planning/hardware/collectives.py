"""Collectives and point-to-point transfers priced the way NCCL's tuner prices them
(src/graph/tuning.cc): time = latency + bytes x factor / bus bandwidth, for a ring and a
tree, the faster one taken.

- factor (nccl-tests doc/PERFORMANCE.md): all-reduce 2(n-1)/n, all-gather and
  reduce-scatter (n-1)/n of the full buffer; a tree all-reduce moves the buffer up and down
  at half the bus bandwidth (tuning.cc's 0.5 ratio, after its 0.92 tree factor);
- latency: the base per call plus, per ring step, the NVLink step latency for steps inside a
  node and the network one for the 2(nodes-1) (all-reduce) or nodes-1 steps that cross
  nodes; a tree pays 2 x ((ranks per node - 1) x NVLink + log2(nodes) x network);
- bus bandwidth by placement: a group inside one node runs at the node's NVLink busbw (NVLink
  SHARP for an all-reduce where the node has it); a group across nodes is bounded by the NICs
  its ranks own on each node (one per GPU: k ranks per node drive k NICs) and by NVLink.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.planning.hardware.targets import Network

KINDS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class Placement:
    """A process group: `ranks` in all, `per_node` of them on each node it spans."""

    ranks: int
    per_node: int

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.per_node < 1 or self.per_node > self.ranks:
            raise ValueError(
                f"a group needs 1 <= per_node <= ranks, got ranks={self.ranks}, "
                f"per_node={self.per_node}"
            )

    @property
    def nodes(self) -> int:
        return math.ceil(self.ranks / self.per_node)


def _busbw(net: Network, group: Placement, kind: str) -> float:
    intra = net.intra_busbw
    if kind == "all_reduce" and net.intra_allreduce_busbw is not None and group.nodes == 1:
        intra = net.intra_allreduce_busbw
    if group.nodes == 1:
        return intra
    return min(intra, group.per_node * net.nic_busbw)


def _ring_latency(net: Network, group: Placement, kind: str) -> float:
    n, nodes = group.ranks, group.nodes
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    inter = 0 if nodes == 1 else (2 * (nodes - 1) if kind == "all_reduce" else nodes - 1)
    return (net.base_latency + (steps - inter) * net.intra_step_latency
            + inter * net.net_step_latency)


def _tree_latency(net: Network, group: Placement) -> float:
    return net.base_latency + 2 * ((group.per_node - 1) * net.intra_tree_step_latency
                                   + math.log2(group.nodes) * net.net_step_latency)


def collective_seconds(net: Network, kind: str, nbytes: float, group: Placement) -> float:
    """Seconds of one `kind` collective ("all_reduce", "all_gather", "reduce_scatter") of
    `nbytes` (the full buffer: the all-reduced tensor, the gathered output, the scattered
    input) over `group`. 0 for a group of one."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; use one of {KINDS}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    n = group.ranks
    if n == 1:
        return 0.0
    busbw = _busbw(net, group, kind)
    factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    ring = _ring_latency(net, group, kind) + nbytes * factor / busbw
    if kind != "all_reduce":
        return ring
    if group.nodes == 1 and net.intra_allreduce_busbw is not None:
        nvls = net.nvls_latency + nbytes * factor / busbw
        return min(ring, nvls)
    tree = _tree_latency(net, group) + nbytes / (0.5 * 0.92 * busbw)
    return min(ring, tree)


def p2p_seconds(net: Network, nbytes: float, same_node: bool) -> float:
    """Seconds of one send of `nbytes` between two ranks: over NVLink inside a node (its
    effective busbw), over the sender's NIC across nodes; one ring step's latency."""
    if same_node:
        return net.intra_step_latency + nbytes / net.intra_busbw
    return net.net_step_latency + nbytes / net.nic_busbw
