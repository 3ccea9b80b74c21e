"""partitioner: capture a model as a `Captured` record of units (torch.export, grouped by
module; or torch.fx), profile it unit by unit, split it into balanced pipeline stages (exact
min-max over a topological order) and build the stage modules."""

from partitioner import torch_version  # noqa: F401 - first: the running torch is checked

# isort: split
from partitioner.capture import CaptureError, capture
from partitioner.captured import Captured
from partitioner.plan import Plan, partition
from partitioner.profile import profile
from partitioner.solver import partition_chain
from partitioner.split import StageModule, split_model
from partitioner.unit_costs import PolicyCosts, UnitCosts

__all__ = [
    "CaptureError",
    "Captured",
    "Plan",
    "PolicyCosts",
    "StageModule",
    "UnitCosts",
    "capture",
    "partition",
    "partition_chain",
    "profile",
    "split_model",
]
