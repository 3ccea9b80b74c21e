"""Activation memory policies per stage: what a stage keeps of its forward for its backward
("none", "full" and "selective" recompute per block, "offload" to host memory), and how a
stage's forward runs under each (pipeline.execution.stage_run applies them)."""

from pipeline.execution.activations.policies import (
    POLICIES,
    SELECTIVE_SAVE_OPS,
    Policy,
    Selective,
    check_policies,
    recomputes,
    stage_policies,
)

__all__ = [
    "POLICIES",
    "SELECTIVE_SAVE_OPS",
    "Policy",
    "Selective",
    "check_policies",
    "recomputes",
    "stage_policies",
]
