"""Does the memory plan hold from the first step? The heap peak of a Pipeline's first training
step against its steady steps, per activation policy (the demo-sized GPT at pp=2, one
process, planned at construction from example_input, so the first step holds no planning).

Heap bytes in use = glibc's mallinfo2 (uordblks + hblkhd: the small-block arenas and the
mmapped blocks: every CPU tensor and Python object), sampled by a thread every 0.2 ms while
the step runs; a step's peak is the most it read over the bytes in use just before the step.
Writes benchmarks/results/first_step.md and .json.

    python benchmarks/bench_first_step.py [--steps 6]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import sys
import threading
import time
from typing import Any

import torch
from report import write_results

from pipeline import Pipeline
from pipeline.app.demo import lm_loss
from pipeline.app.demo_config import DemoConfig
from pipeline.app.models import GPT
from pipeline.execution.activations import graph
from pipeline.execution.compiled import runner

REAL_PROBE = "selective-real-probe"
TOLERANCE = 0.05  # first step's peak over the steady one (sampling and allocator noise)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _MallInfo2


def heap_in_use() -> int:
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class Peak:
    """The most heap in use while the block runs, over what was in use when it began."""

    def __init__(self) -> None:
        self.base = self.peak = 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, heap_in_use())
            time.sleep(0.0002)

    def __enter__(self) -> Peak:
        gc.collect()
        self.base = self.peak = heap_in_use()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.peak = max(self.peak, heap_in_use())

    @property
    def added(self) -> int:
        return self.peak - self.base


def run(policy: str, steps: int, at_construction: bool) -> dict[str, Any]:
    """`policy`, or "selective-real-probe": "selective" with its keep plan probed by a real
    forward inside the first step (as before the probe ran on fake tensors), side by side."""
    if policy == REAL_PROBE:
        real = graph.keep_plan
        graph.keep_plan = lambda *a, fake=False: real(*a)  # type: ignore[assignment]
        try:
            return {**run("selective", steps, at_construction), "policy": REAL_PROBE}
        finally:
            graph.keep_plan = real
    runner._ARTEFACTS.clear()  # each run traces its blocks afresh, as a new process would
    config = DemoConfig()
    torch.manual_seed(0)
    model = GPT(vocab=256, dim=config.dim, layers=config.layers, heads=config.heads,
                max_seq=config.seq_len)
    x = torch.randint(0, 256, (config.batch_size, config.seq_len))
    pipe = Pipeline(model, stages=2, microbatches=config.microbatches, loss_fn=lm_loss,
                    checkpoint_activations=policy,
                    example_input=x if at_construction else None)
    added, stays = [], []
    for _ in range(steps):
        with Peak() as peak:
            pipe.step(x, x)
        model.zero_grad(set_to_none=True)
        gc.collect()
        added.append(peak.added)
        stays.append(heap_in_use() - peak.base)
    steady = statistics.median(added[1:])
    return {"policy": policy, "planned": "at construction" if at_construction else
            "in the first step", "first": added[0], "steady": steady, "steps": added,
            "ratio": added[0] / steady, "first_stays": stays[0],
            "step_ratio": (added[0] - stays[0]) / steady}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--policies", default=f"none,full,selective,{REAL_PROBE}")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sys.setswitchinterval(0.0005)  # the sampler gets the interpreter often
    rows = [run(policy, args.steps, at) for at in (True, False)
            for policy in args.policies.split(",")]
    mib = 2**20
    lines = [
        "# The first step's heap peak against the steady steps' (benchmarks/bench_first_step.py)",
        "",
        "Demo-sized GPT (DemoConfig: 6 layers, width 160, 16 x 64 tokens), pp=2, 4 "
        "microbatches, 1F1B, one process, planned at construction (example_input=) or in the "
        "first step; heap "
        "bytes in use (glibc mallinfo2) sampled every 0.2 ms during each step, over the bytes "
        f"in use before it; steady = median of steps 2-{args.steps}. '{REAL_PROBE}': "
        "\"selective\" with each block's keep plan probed by a real forward inside the first "
        "step, as before the probe ran on fake tensors.",
        "",
        "'stays': what the first step leaves in use after it (gradients cleared), the "
        "planning's state when it plans there (its captured graph, caches, the modules it "
        "imports); 'step / steady': the first step's peak less that, over the steady peak.",
        "",
        "| policy | planned | first step MiB | steady step MiB | first / steady | stays MiB "
        "| step / steady | every step MiB |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        every = ", ".join(f"{s / mib:.1f}" for s in r["steps"])
        lines.append(f"| {r['policy']} | {r['planned']} | {r['first'] / mib:.1f} | "
                     f"{r['steady'] / mib:.1f} | {r['ratio']:.2f} | "
                     f"{r['first_stays'] / mib:.1f} | {r['step_ratio']:.2f} | {every} |")
    write_results("first_step", rows, "\n".join(lines))
    _check(rows)


def _check(rows: list[dict[str, Any]]) -> None:
    """The plan holds from the first step: planned at construction, the first step's peak is
    within TOLERANCE of the steady one; planned in it, so is its peak less the planning's
    state it leaves (the real-probe rows show what the check catches)."""
    bad = [f"{r['policy']} planned {r['planned']}: {r['ratio']:.2f} (step alone "
           f"{r['step_ratio']:.2f})" for r in rows if r["policy"] != REAL_PROBE and (
               r["step_ratio"] if r["planned"] == "in the first step" else r["ratio"])
           > 1 + TOLERANCE]
    if bad:
        raise SystemExit("the first step's peak is over the steady one: " + "; ".join(bad))


if __name__ == "__main__":
    main()
