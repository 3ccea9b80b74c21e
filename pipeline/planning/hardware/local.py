"""The local CPU as a `Target`, its constants measured by a short microbenchmark (a few
seconds, once, then cached as JSON): matrix-product FLOP/s (operands cycled past the
caches), memory bandwidth (a large copy),
the least an op costs (tiny ops recorded by autograd and their backward, per kernel), fused
attention's rate (SDPA forward and backward), and gloo between two processes on this host
(a small send's latency, a large send's bandwidth, a small all-reduce's base). Never
fitted to training steps: a step predicted from these alone is the check."""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeline.planning.hardware.targets import Network, Target

CACHE_ENV = "HYBRIDPIPE_CACHE"


def _best(fn: Callable[[], Any], repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _compute(dtype: torch.dtype) -> dict[str, float]:
    n, count = 512, 24
    # Operands cycled through 24 pairs (48 MiB in fp32, past the per-core caches), as a
    # model's weights and activations are between its kernels; one pair repeated stays in
    # cache and runs about 20% faster here than a model's matrix products.
    pairs = [(torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype))
             for _ in range(count)]

    def products() -> None:
        for a, b in pairs:
            torch.mm(a, b)

    gemm = count * 2 * n**3 / _best(products, 3)
    big = torch.empty(8 * 2**20, dtype=torch.float32)  # 32 MiB: past the caches
    out = torch.empty_like(big)
    bandwidth = 2 * big.numel() * 4 / _best(lambda: out.copy_(big))
    return {"gemm": gemm, "bandwidth": bandwidth, "floor": _floor(dtype),
            "attention": _attention(dtype)}


def _attention(dtype: torch.dtype) -> float:
    """FLOP/s of causal fused attention, forward and backward (SDPA on 2 x 8 heads x 128
    tokens x 32; flop_counter's count: 4 b h s^2 d forward, 2.5 times that backward)."""
    import torch.nn.functional as F

    q = torch.randn(2, 8, 128, 32, dtype=dtype, requires_grad=True)

    def step() -> None:
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        out.backward(torch.ones_like(out))

    return 3.5 * 4 * 2 * 8 * 128**2 * 32 / _best(step)


def _floor(dtype: torch.dtype, ops: int = 16) -> float:
    """The least a training op costs: a chain of `ops` tiny multiplies recorded by autograd,
    then its backward (one kernel each way, plus the sum and its seed), per kernel."""
    x = torch.ones(64, dtype=dtype, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(ops):
            y = y * 1.0001
        y.sum().backward()

    return statistics.median(_best(chain, 3) for _ in range(10)) / (2 * ops + 3)


def _gloo_worker(rank: int, path: str, result: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    small, large = torch.zeros(4), torch.zeros(4 * 2**20)  # 16 B, 16 MiB

    def pingpong(t: torch.Tensor) -> None:
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)

    latency = _best(lambda: pingpong(small), 20) / 2
    bandwidth = large.numel() * 4 / (_best(lambda: pingpong(large), 5) / 2 - latency)
    reduce = _best(lambda: dist.all_reduce(small), 20)
    if rank == 0:
        Path(result).write_text(json.dumps(
            {"p2p_latency": latency, "p2p_bandwidth": bandwidth, "allreduce_small": reduce}))
    dist.destroy_process_group()


def _gloo() -> dict[str, float]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "gloo.json")
        mp.spawn(_gloo_worker, args=(os.path.join(tmp, "store"), result), nprocs=2,
                 join=True)
        return dict(json.loads(Path(result).read_text()))


def measure() -> dict[str, Any]:
    """Run the microbenchmark (one thread per op, as each pipeline rank runs here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        f64, f32 = _compute(torch.float64), _compute(torch.float32)
    finally:
        torch.set_num_threads(threads)
    return {"fp64": f64, "fp32": f32, "gloo": _gloo(), "host": platform.node(),
            "torch": torch.__version__, "cpus": os.cpu_count()}


def cache_file(kind: str = "target-v4") -> Path:
    """Where this host's measured `kind` of figures is cached (`HYBRIDPIPE_CACHE` moves it)."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hybridpipe")
    return root / f"local-{kind}-{platform.node()}-{torch.__version__}.json"


def cached(kind: str, measure_now: Callable[[], dict[str, Any]], refresh: bool = False
           ) -> dict[str, Any]:
    """This host's `kind` of figures from its cache file, or measured now by `measure_now`
    (and cached) when `refresh` or absent."""
    path = cache_file(kind)
    if not refresh and path.exists():
        return dict(json.loads(path.read_text()))
    figures = measure_now()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=2) + "\n")
    return figures


def measured(refresh: bool = False) -> dict[str, Any]:
    """The microbenchmark's figures, from the cache unless `refresh` or absent."""
    return cached("target-v4", measure, refresh)


def target_from(figures: dict[str, Any], processes: int = 2,
                runtime: dict[str, Any] | None = None) -> Target:
    """A `Target` from measured `figures`: peak = the measured matrix-product rate
    (efficiency 1), bandwidth = the measured copy, floor = the tiny op, and a "node" of
    `processes` ranks linked by the measured gloo send; `runtime`: the pipeline runtime's
    measured CPU seconds per "action" and per "step" (pipeline.facade.runtime_cost; none
    given: 0)."""
    f64, f32, gloo = figures["fp64"], figures["fp32"], figures["gloo"]
    net = Network(
        gpus_per_node=processes,
        intra_busbw=gloo["p2p_bandwidth"],
        nic_busbw=gloo["p2p_bandwidth"],
        base_latency=max(0.0, gloo["allreduce_small"] - 2 * gloo["p2p_latency"]),
        intra_step_latency=gloo["p2p_latency"],
        intra_tree_step_latency=gloo["p2p_latency"],
        net_step_latency=gloo["p2p_latency"],
        sources=("measured: gloo send/recv and all_reduce on this host",),
    )
    return Target(
        name="cpu",
        description=f"this host's CPU ({figures.get('cpus')} cores), one thread per rank",
        peak_flops={"fp64": f64["gemm"], "fp32": f32["gemm"], "bf16": f32["gemm"],
                    "fp16": f32["gemm"]},
        memory_bandwidth=f32["bandwidth"],
        memory_capacity=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        gemm_efficiency=1.0,
        attention_efficiency=f32["attention"] / f32["gemm"],
        memory_efficiency=1.0,
        kernel_floor=f32["floor"],
        network=net,
        sources={"all": "measured by pipeline.planning.hardware.local (microbenchmark)",
                 "runtime": "measured by pipeline.facade.runtime_cost (microbenchmark)"},
        action_overhead=float((runtime or {}).get("action", 0.0)),
        step_overhead=float((runtime or {}).get("step", 0.0)),
        transport="gloo",
    )


def local_target(refresh: bool = False, runtime: dict[str, Any] | None = None) -> Target:
    """This machine as a target (microbenchmarked once, then cached), with the runtime's
    measured cost per action and per step when `runtime` is given."""
    return target_from(measured(refresh), runtime=runtime)
