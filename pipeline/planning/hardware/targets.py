"""The table of devices a job can be planned for: each `Target` holds a GPU's (or the local
CPU's) peak FLOP/s per dtype, memory bandwidth and capacity, how efficiently kernels reach
them by shape, and its node's network; `Target.op_seconds` prices one kernel with it.

A kernel costs the roofline max(FLOPs / effective peak, bytes / effective bandwidth), never
less than a per-kernel floor. A matrix product's effective peak is the large-GEMM plateau
times its tile and wave quantization (NVIDIA's "Matrix Multiplication Background User's
Guide", DU-09799-001, ch. 3: the output is cut into tiles, tiles run in waves of one per SM,
a partial tile or wave costs a whole one); a fused attention kernel runs at the attention
efficiency; any other kernel is memory-bound at a fraction of the bandwidth.

Every constant names its source next to it (docs/planning-at-scale.md lists them): NVIDIA's
datasheets for peaks, bandwidths, capacities and links; published kernel and collective
microbenchmarks for efficiencies and bus bandwidths. No end-to-end training throughput figure
sets or checks any of them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GB = 1e9
TILE = (128, 128)
"""cuBLAS output tile used for quantization (one of the guide's "typical tile dimensions")."""


@dataclass(frozen=True)
class Network:
    """A node's links and the NCCL model's constants (seconds, bytes/s).

    Bus bandwidths are nccl-tests' busbw (doc/PERFORMANCE.md in NVIDIA/nccl-tests): the
    per-rank rate after the collective's factor (2(n-1)/n for all-reduce, (n-1)/n for
    all-gather and reduce-scatter), comparable across group sizes. Latencies are NCCL's own
    tuning model (src/graph/tuning.cc, Simple protocol): a base per call plus a per-step
    hardware latency inside a node (NVLink) or across nodes (network)."""

    gpus_per_node: int
    intra_busbw: float  # ring bus bandwidth inside a node
    nic_busbw: float  # what one NIC sustains; one NIC per GPU across nodes
    intra_allreduce_busbw: float | None = None  # NVLink SHARP all-reduce, where the node has it
    base_latency: float = 8.4e-6  # tuning.cc baseLat, Ring/Tree Simple
    intra_step_latency: float = 3.4e-6  # tuning.cc hwLat NVLINK Ring Simple
    intra_tree_step_latency: float = 4.0e-6  # tuning.cc hwLat NVLINK Tree Simple
    net_step_latency: float = 14.0e-6  # tuning.cc hwLat NET Ring / Tree Simple
    nvls_latency: float = 25e-6  # tuning.cc hwLat NVLINK NVLS Simple
    sources: tuple[str, ...] = ()


@dataclass(frozen=True)
class Target:
    """One device kind in its node. `peak_flops` by dtype name ("bf16", "fp16", "fp32");
    `gemm_efficiency`: the fraction of peak large matrix products reach; `sms`: streaming
    multiprocessors for wave quantization (None: no quantization, as on a CPU);
    `attention_efficiency`: fused attention kernels' fraction of peak; `memory_efficiency`:
    memory-bound kernels' fraction of `memory_bandwidth`; `kernel_floor`: the least a kernel
    costs; `action_overhead` and `step_overhead`: the pipeline runtime's own seconds per
    F/B/W action (its send or receive included) and per step where they hold the device
    (the local CPU: measured; 0 for a GPU, whose host work runs ahead of its kernels).
    `transport`: the pipeline's p2p backend, for its buffers ("gloo": every receive of a
    step posted at its start, each send kept to its end; "nccl": as the stage needs them).
    `sources` names where each figure comes from."""

    name: str
    description: str
    peak_flops: dict[str, float]
    memory_bandwidth: float
    memory_capacity: float
    gemm_efficiency: float
    attention_efficiency: float
    memory_efficiency: float
    kernel_floor: float
    network: Network
    sms: int | None = None
    sources: dict[str, str] = field(default_factory=dict)
    action_overhead: float = 0.0
    step_overhead: float = 0.0
    transport: str = "nccl"

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype` (a name in `peak_flops`)."""
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise ValueError(
                f"{self.name} has no peak for dtype {dtype!r}; use one of "
                f"{sorted(self.peak_flops)}"
            ) from None

    def gemm_quantization(self, m: int, n: int, batch: int = 1) -> float:
        """The fraction of a matrix product's tiles and waves doing useful work: the (m x n)
        output of each of `batch` products is cut into TILE tiles, and tiles run in waves of
        `sms` (the guide's tile and wave quantization). 1.0 without `sms`."""
        if self.sms is None or m <= 0 or n <= 0:
            return 1.0
        tiles_m, tiles_n = math.ceil(m / TILE[0]), math.ceil(n / TILE[1])
        tile_use = (m * n) / (tiles_m * TILE[0] * tiles_n * TILE[1])
        tiles = batch * tiles_m * tiles_n
        waves = math.ceil(tiles / self.sms)
        return tile_use * tiles / (waves * self.sms)

    def op_seconds(self, flops: float, moved: float, dtype: str, kind: str,
                   gemm: tuple[int, int, int] | None = None) -> float:
        """Seconds of one kernel: `kind` "gemm" (with `gemm` = (m, n, batch) of its output),
        "attention" or "memory"; `moved` bytes read and written."""
        memory = moved / (self.memory_bandwidth * self.memory_efficiency)
        if kind == "gemm":
            m, n, batch = gemm if gemm is not None else (0, 0, 1)
            rate = self.peak(dtype) * self.gemm_efficiency * self.gemm_quantization(m, n, batch)
        elif kind == "attention":
            rate = self.peak(dtype) * self.attention_efficiency
        else:
            rate = self.peak(dtype) * self.gemm_efficiency
        return max(flops / rate if flops else 0.0, memory, self.kernel_floor)


_NCCL_TUNING = "NCCL src/graph/tuning.cc (baseLat, hwLat; Simple protocol)"
_AUTOPARALLEL = ("meta-pytorch AutoParallel's roofline: memory-bound ops at 0.7 of HBM "
                 "bandwidth, 7 us per-kernel floor")

A100_SXM4_80GB = Target(
    name="a100-sxm4-80gb",
    description="NVIDIA A100 SXM4 80GB in a DGX A100 node (8 GPUs, NVLink 3 + NVSwitch; "
    "one 200 Gb/s HDR InfiniBand NIC per GPU)",
    # NVIDIA A100 datasheet: 312 TFLOP/s dense BF16/FP16 tensor, 156 TF32, 19.5 FP32.
    peak_flops={"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    memory_bandwidth=2039 * GB,  # A100 80GB SXM datasheet: HBM2e 2,039 GB/s
    memory_capacity=81920 * 2**20,  # 80 GB HBM2e; 81,920 MiB as the driver reports it
    gemm_efficiency=0.80,  # cuBLAS large BF16/FP16 GEMM plateau, NVIDIA matmul guide figs.
    attention_efficiency=0.60,  # FlashAttention-2 (Dao 2023): 50-73% of A100 peak, midpoint
    memory_efficiency=0.7,  # AutoParallel roofline
    kernel_floor=7e-6,  # AutoParallel roofline
    sms=108,  # A100 whitepaper: 108 SMs
    network=Network(
        gpus_per_node=8,
        intra_busbw=232.5 * GB,  # nccl-tests issue 175: all_reduce_perf -g 8, 232.54 GB/s
        nic_busbw=24 * GB,  # nccl issue 1048: one HDR HCA reaches 24 GB/s; nccl issue 812
        # (NVIDIA): DGX A100, 8 x 200 Gb/s, 192 GB/s all-reduce busbw = 8 x 24
        sources=(_NCCL_TUNING, "nccl-tests#175", "NVIDIA/nccl#1048", "NVIDIA/nccl#812"),
    ),
    sources={
        "peak_flops": "NVIDIA A100 Tensor Core GPU datasheet (dense)",
        "memory": "NVIDIA A100 80GB datasheet: HBM2e 2,039 GB/s, 80 GB",
        "nvlink": "NVIDIA A100 datasheet: NVLink 600 GB/s bidirectional per GPU",
        "gemm": "NVIDIA Matrix Multiplication Background User's Guide (tiles, waves, plateau)",
        "attention": "Dao 2023, FlashAttention-2: 50-73% of A100 peak",
        "memory_bound": _AUTOPARALLEL,
        "network": "nccl-tests busbw: NVIDIA/nccl-tests#175, NVIDIA/nccl#1048, #812",
    },
)

H100_SXM5_80GB = Target(
    name="h100-sxm5-80gb",
    description="NVIDIA H100 SXM5 80GB in a DGX H100 node (8 GPUs, NVLink 4 + NVSwitch; "
    "one 400 Gb/s NDR InfiniBand NIC per GPU)",
    # NVIDIA H100 datasheet (SXM): 989 TFLOP/s dense BF16/FP16 (1,979 with sparsity),
    # 494.5 TF32, 67 FP32.
    peak_flops={"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12},
    memory_bandwidth=3350 * GB,  # H100 SXM datasheet: HBM3 3.35 TB/s
    memory_capacity=81559 * 2**20,  # 80 GB HBM3; 81,559 MiB as the driver reports it
    gemm_efficiency=0.75,  # cuBLAS 12 BF16 GEMM plateau on H100 SXM (NVIDIA cuBLAS 12.0 blog)
    attention_efficiency=0.50,  # FlashAttention-3 paper: FA2 35-50%, FA3 up to 75% of peak
    memory_efficiency=0.7,  # AutoParallel roofline
    kernel_floor=7e-6,  # AutoParallel roofline
    sms=132,  # H100 SXM5 whitepaper: 132 SMs
    network=Network(
        gpus_per_node=8,
        intra_busbw=370 * GB,  # nccl-tests#212 (NVIDIA): effective NVLink 4 busbw 370 GB/s
        intra_allreduce_busbw=480 * GB,  # same thread: NVLink SHARP all-reduce ~480 GB/s
        nic_busbw=48 * GB,  # nccl-tests#267 (NVIDIA): CX-7 at NDR 400 Gb/s, 48-49 GB/s
        sources=(_NCCL_TUNING, "nccl-tests#212", "nccl-tests#267"),
    ),
    sources={
        "peak_flops": "NVIDIA H100 Tensor Core GPU datasheet, SXM5 (dense)",
        "memory": "NVIDIA H100 datasheet: HBM3 3.35 TB/s, 80 GB",
        "nvlink": "NVIDIA H100 datasheet: NVLink 900 GB/s bidirectional per GPU",
        "gemm": "NVIDIA matmul guide (tiles, waves); cuBLAS 12.0 on Hopper blog (plateau)",
        "attention": "Shah et al. 2024, FlashAttention-3 (FA2 and FA3 utilisation on H100)",
        "memory_bound": _AUTOPARALLEL,
        "network": "nccl-tests busbw: NVIDIA/nccl-tests#212, #267",
    },
)

TARGETS: dict[str, Target] = {t.name: t for t in (A100_SXM4_80GB, H100_SXM5_80GB)}
