"""The device model: targets' kernel pricing (roofline, tile and wave quantization, floor)
and the NCCL-style collectives (nccl-tests' bus-bandwidth factors, NCCL's latency model,
placement inside and across nodes)."""

from __future__ import annotations

import math

import pytest

from pipeline.planning.hardware import (
    TARGETS,
    Placement,
    collective_seconds,
    p2p_seconds,
    target_named,
)
from pipeline.planning.hardware.local import target_from
from pipeline.planning.hardware.targets import TILE

A100, H100 = TARGETS["a100-sxm4-80gb"], TARGETS["h100-sxm5-80gb"]


def test_datasheet_figures_are_the_ones_named() -> None:
    assert A100.peak("bf16") == 312e12 and H100.peak("bf16") == 989e12
    assert A100.memory_bandwidth == 2039e9 and H100.memory_bandwidth == 3350e9
    assert A100.network.gpus_per_node == H100.network.gpus_per_node == 8
    # One NIC per GPU: 200 Gb/s HDR and 400 Gb/s NDR lines, nccl-tests' sustained rates.
    assert A100.network.nic_busbw <= 200e9 / 8 and H100.network.nic_busbw <= 400e9 / 8
    assert all(t.sources for t in TARGETS.values())


def test_gemm_quantization_counts_tiles_and_waves() -> None:
    full = A100.sms * TILE[0]
    assert A100.gemm_quantization(full, TILE[1]) == 1.0  # one full wave of full tiles
    # One tile more: a second wave with one tile in it.
    assert A100.gemm_quantization(full + TILE[0], TILE[1]) == pytest.approx(
        (A100.sms + 1) / (2 * A100.sms))
    # Half a tile wide: half of each tile idle.
    assert A100.gemm_quantization(full, TILE[1] // 2) == pytest.approx(0.5)


def test_op_seconds_is_a_roofline_with_a_floor() -> None:
    big = 2 * 8192**3
    waves = math.ceil(64 * 64 / H100.sms)  # 4096 tiles of 128 x 128 on 132 SMs
    compute = big / (H100.peak("bf16") * H100.gemm_efficiency * 4096 / (waves * H100.sms))
    assert H100.op_seconds(big, 3 * 8192**2 * 2, "bf16", "gemm", (8192, 8192, 1)) == (
        pytest.approx(compute))
    moved = 1e9
    assert H100.op_seconds(0, moved, "bf16", "memory") == pytest.approx(
        moved / (H100.memory_bandwidth * H100.memory_efficiency))
    assert H100.op_seconds(10, 10, "bf16", "memory") == H100.kernel_floor


def test_all_reduce_inside_a_node_follows_the_bus_bandwidth_definition() -> None:
    net, n, size = A100.network, 8, 4e9
    group = Placement(n, n)
    seconds = collective_seconds(net, "all_reduce", size, group)
    latency = net.base_latency + 2 * (n - 1) * net.intra_step_latency
    # nccl-tests: busbw = algbw x 2(n-1)/n, so a large all-reduce runs at the node's busbw.
    assert seconds == pytest.approx(latency + size * 2 * (n - 1) / n / net.intra_busbw)
    gather = collective_seconds(net, "all_gather", size, group)
    assert gather == pytest.approx(net.base_latency + (n - 1) * net.intra_step_latency
                                   + size * (n - 1) / n / net.intra_busbw)
    assert collective_seconds(net, "reduce_scatter", size, group) == pytest.approx(gather)
    assert collective_seconds(net, "all_reduce", size, Placement(1, 1)) == 0.0


def test_groups_across_nodes_are_bounded_by_their_nics() -> None:
    net, size = H100.network, 8e9
    one_per_node = collective_seconds(net, "all_reduce", size, Placement(16, 1))
    eight_per_node = collective_seconds(net, "all_reduce", size, Placement(64, 8))
    # One rank per node drives one NIC; eight drive eight (but NVLink bounds them first).
    assert one_per_node == pytest.approx(size * 2 * 15 / 16 / net.nic_busbw, rel=0.01)
    assert eight_per_node == pytest.approx(
        size * 2 * 63 / 64 / min(net.intra_busbw, 8 * net.nic_busbw), rel=0.02)
    # Small messages: a tree's log2(nodes) latency beats a ring's 2(nodes-1) steps.
    small = collective_seconds(net, "all_reduce", 1e3, Placement(64, 1))
    assert small < net.base_latency + 2 * 63 * net.net_step_latency
    assert small == pytest.approx(net.base_latency + 2 * math.log2(64) * net.net_step_latency,
                                  rel=0.01)


def test_p2p_uses_the_link_of_the_placement() -> None:
    net = A100.network
    assert p2p_seconds(net, 1e9, True) < p2p_seconds(net, 1e9, False)
    assert p2p_seconds(net, 1e9, False) == pytest.approx(net.net_step_latency + 1e9 / 24e9)


def test_bad_inputs_name_the_fix() -> None:
    with pytest.raises(ValueError, match="unknown target"):
        target_named("v100")
    with pytest.raises(ValueError, match="unknown collective"):
        collective_seconds(A100.network, "broadcast", 1.0, Placement(2, 2))
    with pytest.raises(ValueError, match="per_node"):
        Placement(2, 4)
    with pytest.raises(ValueError, match="dtype"):
        A100.peak("int4")
    assert target_named("a100-sxm4-80gb", gpus_per_node=4).network.gpus_per_node == 4


def test_local_target_is_built_from_measured_figures_only() -> None:
    figures = {
        "fp64": {"gemm": 4e10, "bandwidth": 8e9, "floor": 2e-6},
        "fp32": {"gemm": 1.6e11, "bandwidth": 1.2e10, "floor": 3e-6, "attention": 8e10},
        "gloo": {"p2p_latency": 5e-5, "p2p_bandwidth": 2e9, "allreduce_small": 1.5e-4},
        "cpus": 2,
    }
    cpu = target_from(figures)
    assert cpu.peak("fp64") == 4e10 and cpu.peak("fp32") == 1.6e11
    assert cpu.memory_bandwidth == 1.2e10 and cpu.kernel_floor == 3e-6
    assert cpu.gemm_efficiency == cpu.memory_efficiency == 1.0
    assert cpu.attention_efficiency == 0.5  # measured attention rate over the GEMM's
    assert cpu.network.intra_step_latency == 5e-5
    assert cpu.network.base_latency == pytest.approx(1.5e-4 - 2 * 5e-5)
    assert cpu.action_overhead == cpu.step_overhead == 0.0  # no runtime figures given
    timed = target_from(figures, runtime={"action": 4e-4, "step": 1.5e-3})
    assert (timed.action_overhead, timed.step_overhead) == (4e-4, 1.5e-3)
