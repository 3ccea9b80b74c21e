"""What each activation policy costs and saves, measured per block of a captured model (the
blocks `partitioner.blocks` cuts, which "full" and "selective" recompute one at a time) and
returned per unit as a `PolicyCosts` (partitioner.unit_costs), so a stage's price under any
partition is a sum over its units:

- `kept`: bytes the block keeps for its backward per microbatch under "none", "full" (its
  inputs) and "selective" (its inputs and the outputs the rule of `selective_keep`
  chooses), run as the runtime runs them (the runs given to `price_policies`) and counted
  with `saved_bytes.SavedBytes` as the runtime does; `kept_later`, the same in a stage after
  the first, whose runtime makes every input a gradient reaches (`split.needs_grad`) need
  grad, those made from the model's floating inputs too (a rotary table made from buffers
  needs none). A value an earlier block read too counts with that block only;
  `shared_reads` names such values and their bytes, which a later stage receives, and
  keeps, once;
- `added` ("full", "selective"): the time a forward and backward under each takes beyond a
  plain one (recomputation at graph level, or under the checkpoint where a block does not
  trace), over the plain one's; timed block by block (as many at once as the process runs
  rank threads), each the fastest of a few trials, and summed over the whole model (one
  block is too short to time on a busy machine);
- `recompute_flops` ("full", "selective"): FLOPs of the matmuls, convolutions and attention
  (the candidate ops) that a recomputation under each runs;
- `held_to_w` ("full", "selective"): bytes a split backward's B keeps for its W under each
  (the output grads and recomputed inputs the weight grads read);
- `offload_time`: seconds to move the "none" bytes to host memory one way (at the copy
  bandwidth measured on the block's device; pinned host memory on CUDA); None on a CPU
  device, where "offload" moves nothing.

A block's figures go to the unit of its first node that belongs to a module. Measured in a
sandbox on the example microbatch: the model's state, training flags and RNG are left as they
were."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from partitioner.blocks import BlockChain, block_key
from partitioner.captured import Captured
from partitioner.sandbox import sandbox
from partitioner.saved_bytes import SavedBytes
from partitioner.split import needs_grad
from partitioner.unit_costs import PolicyCosts

_TRIALS = 3
_JOIN_TIMEOUT = 300.0  # seconds one timed block step may take in a pricing thread


def _leaves(values: Sequence[Any], marks: Sequence[bool] | None = None) -> list[Any]:
    """Fresh inputs for one measurement: a tensor that needs grad (marked so in `values`, or,
    given `marks`, where it marks a floating one) as the output of an earlier block (not a
    leaf: a block's inputs are kept, a parameter is not); the rest as they are (a rotary
    table computed from buffers needs none, so the ops using it save less)."""
    return [v.detach().requires_grad_().clone()
            if isinstance(v, torch.Tensor) and (
                v.requires_grad if marks is None else marks[i] and v.is_floating_point())
            else v
            for i, v in enumerate(values)]


def _marked(value: Any) -> Any:
    """A block's output as the next block's input value: detached, marked as needing grad
    when it did."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    return value


def _kept(run: Callable[..., Any], values: Sequence[Any], marks: Sequence[bool] | None,
          shared: Sequence[bool]) -> float:
    """Bytes `run` keeps for its backward, not counting the inputs marked `shared` (read by an
    earlier block too: a stage keeps such a value once, e.g. a rotary table)."""
    meter = SavedBytes()
    args = _leaves(values, marks)
    meter.ignore([a for a, s in zip(args, shared, strict=True)
                  if s and isinstance(a, torch.Tensor)])
    with torch.enable_grad(), meter.counting():
        out = run(*args)
    held = meter.held
    del out
    return float(held)


def _nbytes(t: torch.Tensor) -> float:
    return float(t.numel() * t.element_size())


def _seconds(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _step_seconds(run: Callable[..., Any], values: Sequence[Any],
                  device: torch.device, threads: int = 1) -> float:
    """Seconds of a forward and backward of `run` (from every float output it returns); with
    `threads`, of that many run at once, one a thread (as rank threads share a process)."""
    def step() -> None:
        with torch.enable_grad():
            outs = [o for o in tree_leaves(run(*_leaves(values)))
                    if isinstance(o, torch.Tensor) and o.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    if threads == 1:
        return _seconds(step, device)
    failed: list[BaseException] = []
    # torch keeps the intra-op thread count per thread and a new thread starts at every
    # core: each takes the caller's, as the local executor's rank threads do.
    intra_op = torch.get_num_threads()

    def guarded() -> None:
        try:
            torch.set_num_threads(intra_op)
            step()
        except BaseException as err:  # noqa: BLE001 - raised in the caller's thread below
            failed.append(err)

    def together() -> None:
        workers = [threading.Thread(target=guarded, daemon=True) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(_JOIN_TIMEOUT)
            if w.is_alive():
                raise TimeoutError(f"a priced block step ran over {_JOIN_TIMEOUT:g} s")

    seconds = _seconds(together, device)
    if failed:
        raise failed[0]
    return seconds


def copy_bandwidth(device: torch.device, nbytes: int = 8 << 20) -> float:
    """Bytes per second of a copy from `device` to host memory (pinned on CUDA)."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    seconds = min(_seconds(lambda: target.copy_(source), device) for _ in range(_TRIALS))
    return nbytes / seconds if seconds > 0 else float("inf")


@dataclass(frozen=True)
class BlockFigures:
    """A block's figures from its last calls under "full" and "selective": policy -> the
    recompute FLOPs of its candidate ops, and policy -> the bytes a split backward's B keeps
    for W."""

    recompute_flops: Mapping[str, float]
    held_to_w: Mapping[str, float]


RunsOf = Callable[[fx.GraphModule, Sequence[Any], float | None],
                  tuple[dict[str, Callable[..., Any]], Callable[[], BlockFigures]]]
"""How a block runs under "full" and "selective" (given the candidate ops and the budget),
and, after those runs, its `BlockFigures`."""

_POLICIES = ("none", "full", "selective")
_RECOMPUTING = ("full", "selective")


def price_policies(
    captured: Captured, example_inputs: tuple[Any, ...], save_ops: Sequence[Any],
    budget: float | None, runs_of: RunsOf, threads: int = 1,
) -> dict[str, PolicyCosts]:
    """Each unit's `PolicyCosts` (see the module docstring) in `captured`, measured on
    `example_inputs` (flat, as the graph's inputs) on the device the model's parameters are
    on; `save_ops` and `budget`: the candidate ops "selective" may keep and its byte budget
    (selective_keep); `runs_of`: how the runtime runs a block under "full" and "selective"
    (pipeline.execution.activations.graph.block_runs); `threads`: how many pipeline ranks the
    process runs in threads (the local executor on CPU): the policies are timed that many at
    once, as they run, since what they add holds the interpreter lock differently from a
    plain block (a traced backward runs its ops from Python, autograd's own in C++). Attach
    them with `partitioner.unit_costs.with_policies`."""
    gm, unit_of, order = captured.graph_module, captured.unit_of, captured.order
    device = next((p.device for p in gm.parameters()), torch.device("cpu"))
    chain = BlockChain(gm)
    flowing = needs_grad(captured)
    save = list(save_ops)
    bandwidth = copy_bandwidth(device) if device.type != "cpu" else None
    none_kept = dict.fromkeys(_POLICIES, 0.0)
    none_figures = dict.fromkeys(_RECOMPUTING, 0.0)
    prices = {name: PolicyCosts(kept=none_kept, kept_later=none_kept, added={},
                                recompute_flops=none_figures, held_to_w=none_figures,
                                offload_time=None if bandwidth is None else 0.0)
              for name in order}
    values = dict(zip((n.name for n in chain.placeholders), example_inputs, strict=False))
    read: set[str] = set()  # values read by a block already
    times = dict.fromkeys(_POLICIES, 0.0)
    with sandbox(captured.model):
        for block in chain.blocks:
            module = block.module
            args = [values[n] for n in block.inputs]
            recomputing, figures = runs_of(module, save, budget)
            runs: dict[str, Callable[..., Any]] = {"none": module, **recomputing}
            shared = [n in read for n in block.inputs]
            read.update(block.inputs)
            marks = [n in flowing for n in block.inputs]  # as a later stage receives them
            later = {p: _kept(run, args, marks, shared) for p, run in runs.items()}
            kept = {p: _kept(run, args, None, shared) for p, run in runs.items()}
            got = figures()  # of the last calls: the first stage's ones
            first = next((n.name for n in module.graph.nodes
                          if n.name in unit_of and block_key(n) is not None),
                         next(n.name for n in module.graph.nodes if n.name in unit_of))
            unit = order[unit_of[first]]
            prices[unit] = PolicyCosts(
                kept=kept, kept_later=later, added={}, recompute_flops=got.recompute_flops,
                held_to_w=got.held_to_w,
                offload_time=None if bandwidth is None else kept["none"] / bandwidth,
                shared_reads={**prices[unit].shared_reads, **{
                    n: _nbytes(values[n]) for n, s in zip(block.inputs, shared, strict=True)
                    if s and isinstance(values[n], torch.Tensor)}},
            )
            fastest = dict.fromkeys(runs, float("inf"))
            for _ in range(_TRIALS):  # interleaved: a busy spell slows every policy alike
                for p, run in runs.items():
                    fastest[p] = min(fastest[p], _step_seconds(run, args, device, threads))
            for p, t in fastest.items():
                times[p] += t
            if block is not chain.blocks[-1]:
                with torch.enable_grad():
                    outputs = module(*_leaves(args))
                values.update(zip(block.outputs, map(_marked, outputs), strict=True))
    # The ratios over the whole model: one block's few milliseconds are too noisy to time.
    plain = times["none"]
    added = {p: max(0.0, times[p] / plain - 1.0) if plain > 0 else 1.0 for p in _RECOMPUTING}
    return {name: dataclasses.replace(c, added=added) for name, c in prices.items()}
