"""Captured graphs with fixed costs, for planner tests whose answer must not depend on timing."""

from __future__ import annotations

import torch

from partitioner import Captured, UnitCosts, capture
from pipeline.app.models import mlp_stack


def synthetic_graph() -> Captured:
    """8 residual blocks + read-out with fixed costs per node (profiled on 4 samples): F=1,
    B=1, W=1 s, 1000 activation bytes; parameter bytes are the real ones."""
    graph = capture(mlp_stack(blocks=8, dim=4, hidden=4), (torch.randn(4, 4),))
    unit = UnitCosts(forward=1.0, input_grad=1.0, weight_grad=1.0, activation_bytes=1000.0)
    return graph.with_costs(dict.fromkeys(graph.order, unit))
