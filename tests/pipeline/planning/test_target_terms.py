"""The GPU target's step-time terms beside the op-by-op pricing: gradient accumulation
between microbatches, the data-parallel sync in the executor's 25 MiB buckets, and the
optimizer's passes over its fp32 state (meta tensors, no device)."""

from __future__ import annotations

import pytest

from pipeline.planning.hardware import TARGETS
from pipeline.planning.hardware.collectives import Placement, collective_seconds
from pipeline.planning.scale.layout import Job, parse_layout
from pipeline.planning.scale.memory import BUCKET
from pipeline.planning.scale.predict import (
    ADAM_BYTES,
    bucketed_seconds,
    finish,
    predict,
    simulate_layout,
)
from pipeline.planning.scale.stages import accumulate_seconds, stage_costs
from pipeline.planning.scale.transformer import parse_spec
from pipeline.planning.scale.units import priced_units

H100 = TARGETS["h100-sxm5-80gb"]
SPEC = parse_spec("gpt:layers=8,hidden=64,heads=4,vocab=256,seq=64")


def test_gradient_accumulation_is_paid_by_every_microbatch_after_the_first() -> None:
    job = Job(SPEC, H100, 8, 32)
    units = priced_units(SPEC, H100, "bf16", 1, 1)
    one = stage_costs(Job(SPEC, H100, 2, 1), parse_layout("pp=2,microbatches=1"), units)
    many = stage_costs(Job(SPEC, H100, 2, 8), parse_layout("pp=2,microbatches=8"), units)
    bw = H100.memory_bandwidth * H100.memory_efficiency
    for s in range(2):
        extra = many.weight_grad[s] - one.weight_grad[s]
        # 3 bf16 gradient transfers per parameter, on 7 of 8 microbatches (per microbatch)
        assert extra == pytest.approx(3 * 2 * many.parameters[s] / bw * 7 / 8)
        assert many.forward[s] == one.forward[s]
    # FSDP without a pipeline reduce-scatters each microbatch: nothing accumulates, whether
    # the layout is simulated as FSDP or finished as FSDP from another ZeRO choice's run.
    job = Job(SPEC, H100, 2, 16)
    fsdp, none = (parse_layout(f"pp=1,microbatches=8,zero={z}") for z in ("fsdp", "none"))
    direct = predict(job, fsdp)
    shared = finish(job, simulate_layout(job, none), "fsdp")
    assert direct.step_time == pytest.approx(shared.step_time)
    shed = 8 * accumulate_seconds(job, fsdp, SPEC.parameters())
    assert predict(job, none).pipeline_time - direct.pipeline_time == pytest.approx(
        shed, rel=0.05)  # the tied head's weight counted twice in the units


def test_the_gradient_sync_pays_one_latency_per_bucket() -> None:
    net, group = H100.network, Placement(16, 1)
    whole = 3.5 * BUCKET
    bucketed = bucketed_seconds(net, "all_reduce", whole, group)
    assert bucketed == pytest.approx(3 * collective_seconds(net, "all_reduce", BUCKET, group)
                                     + collective_seconds(net, "all_reduce", BUCKET / 2, group))
    assert bucketed > collective_seconds(net, "all_reduce", whole, group)
    assert bucketed_seconds(net, "reduce_scatter", BUCKET / 4, group) == pytest.approx(
        collective_seconds(net, "reduce_scatter", BUCKET / 4, group))


def test_the_optimizer_reads_and_writes_its_state_pass_by_pass() -> None:
    job = Job(SPEC, H100, 2, 8)
    p = predict(job, parse_layout("pp=2,microbatches=4,schedule=1f1b"))
    costs = stage_costs(job, p.layout, priced_units(SPEC, H100, "bf16", 1, 4))
    params = max(costs.parameters)
    bw = H100.memory_bandwidth * H100.memory_efficiency
    assert p.optimizer_time == pytest.approx(params * (ADAM_BYTES + 2 * 2) / bw)
    assert ADAM_BYTES > 24  # more than one fused pass over master weight, m and v
