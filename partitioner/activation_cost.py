"""What each activation policy costs and saves, measured per block of a captured model (the
blocks `partitioner.blocks` cuts, which "full" and "selective" recompute one at a time) and
written onto the graph's units, so a stage's price under any partition is a sum over its units:

- ``kept_none`` / ``kept_full`` / ``kept_selective``: bytes the block keeps for its backward
  per microbatch under "none", "full" (its inputs) and "selective" (its inputs and the
  outputs of the saved ops), counted with `saved_bytes.SavedBytes` as the runtime does;
- ``forward_selective`` / ``replay_selective``: the time of a "selective" forward (which
  caches the saved ops' outputs) and of its recomputation, over that of a plain forward
  (timed over the whole model: one block is too short to time on a busy machine; a "full"
  recomputation is one forward);
- ``offload_time``: seconds to move the "none" bytes to host memory one way (at the copy
  bandwidth measured on the block's device; pinned host memory on CUDA); None on a CPU
  device, where "offload" moves nothing.

A block's figures go to the unit of its first node that belongs to a module. Measured in a
sandbox on the example microbatch: the model's state, training flags and RNG are left as they
were."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import fx
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from partitioner.blocks import BlockChain, block_key
from partitioner.captured import Captured
from partitioner.sandbox import sandbox
from partitioner.saved_bytes import SavedBytes

_TRIALS = 5


def _leaves(values: Sequence[Any]) -> list[Any]:
    """Fresh inputs for one measurement: float tensors as the outputs of an earlier block
    (needing grad, not leaves: a block's inputs are kept, a parameter is not), the rest as
    they are."""
    return [v.detach().requires_grad_().clone()
            if isinstance(v, torch.Tensor) and v.is_floating_point() else v for v in values]


def _kept(run: Callable[..., Any], values: Sequence[Any]) -> float:
    meter = SavedBytes()
    with torch.enable_grad(), meter.counting():
        out = run(*_leaves(values))
    held = meter.held
    del out
    return float(held)


def _seconds(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _selective_times(block: fx.GraphModule, values: Sequence[Any], save: list[Any],
                     device: torch.device) -> tuple[float, float, float]:
    """Seconds of the block's plain forward, of its forward keeping the saved ops' outputs,
    and of the replay of the other ops: each the fastest of a few trials (a busy machine only
    adds delays)."""
    plain = kept = replayed = float("inf")
    with torch.enable_grad():
        for _ in range(_TRIALS):
            plain = min(plain, _seconds(partial(block, *_leaves(values)), device))
            keep, replay = create_selective_checkpoint_contexts(save)
            args = _leaves(values)
            kept = min(kept, _seconds(partial(_under, keep, block, args), device))
            replayed = min(replayed, _seconds(partial(_under, replay, block, args), device))
    return plain, kept, replayed


def _under(context: Any, block: fx.GraphModule, args: list[Any]) -> None:
    with context:
        block(*args)


def copy_bandwidth(device: torch.device, nbytes: int = 8 << 20) -> float:
    """Bytes per second of a copy from `device` to host memory (pinned on CUDA)."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    seconds = min(_seconds(lambda: target.copy_(source), device) for _ in range(_TRIALS))
    return nbytes / seconds if seconds > 0 else float("inf")


def price_policies(
    captured: Captured, example_inputs: tuple[Any, ...], save_ops: Sequence[Any]
) -> None:
    """Write each policy's price (see the module docstring) onto the units of `captured`,
    measured on `example_inputs` (flat, as the graph's inputs) on the device the model's
    parameters are on; `save_ops`: the ops "selective" keeps."""
    gm, unit_of, order, graph = (captured.graph_module, captured.unit_of, captured.order,
                                 captured.graph)
    model = captured.model
    device = next((p.device for p in gm.parameters()), torch.device("cpu"))
    chain = BlockChain(gm)
    save = list(save_ops)
    bandwidth = copy_bandwidth(device) if device.type != "cpu" else None
    for name in order:
        graph.nodes[name].update(kept_none=0.0, kept_full=0.0, kept_selective=0.0,
                                 offload_time=None if bandwidth is None else 0.0)
    values = dict(zip((n.name for n in chain.placeholders), example_inputs, strict=False))
    times = [0.0, 0.0, 0.0]
    with sandbox(model):
        for block in chain.blocks:
            module = block.module
            args = [values[n] for n in block.inputs]
            none = _kept(module, args)
            full = _kept(lambda *a, m=module: checkpoint(m, *a, use_reentrant=False), args)
            selective = _kept(lambda *a, m=module: checkpoint(
                m, *a, use_reentrant=False, respect_saved_tensors_hooks=True,
                context_fn=lambda: create_selective_checkpoint_contexts(save)), args)
            first = next((n.name for n in module.graph.nodes
                          if n.name in unit_of and block_key(n) is not None),
                         next(n.name for n in module.graph.nodes if n.name in unit_of))
            graph.nodes[order[unit_of[first]]].update(
                kept_none=none, kept_full=full, kept_selective=selective,
                offload_time=None if bandwidth is None else none / bandwidth,
            )
            times = [t + u for t, u in zip(times, _selective_times(module, args, save, device),
                                           strict=True)]
            if block is not chain.blocks[-1]:
                with torch.no_grad():
                    values.update(zip(block.outputs, module(*args), strict=True))
    # The ratios over the whole model: one block's few milliseconds are too noisy to time.
    forward, replay = (times[1] / times[0], times[2] / times[0]) if times[0] > 0 else (1.0, 1.0)
    for name in order:
        graph.nodes[name].update(forward_selective=forward, replay_selective=replay)
