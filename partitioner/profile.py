"""Measure a captured graph node by node: forward time, backward time (split into input-grad and
weight-grad time), and the activation bytes autograd keeps for backward.

The split follows what a split-backward schedule runs: B (input grad) is the measured time of
the gradient w.r.t. the node's inputs alone, W (weight grad) is the rest of the backward,
backward - B. Timing the weight gradient alone would be wrong for a composite node (a block of
several layers): the weights of its inner layers need backprop through the block, so it costs
nearly the whole backward, while B has already done that walk when W runs.

Each node is run on its real inputs from one pass over the example input, after `warmup` runs
(the pass itself is the forward's first), `repeats` times or until `BUDGET` seconds have been
timed (a unit that takes longer is timed once: its noise is small next to it); the median is
kept. Units of the same ops and shapes (see `signature`) are measured once. Everything happens
in a sandbox (see `sandbox.py`), so the model's parameters, buffers, .training flags and RNG
state are unchanged afterwards."""

from __future__ import annotations

import copy
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten, tree_map

from partitioner.captured import Captured
from partitioner.exported import retarget
from partitioner.probe import probe
from partitioner.sandbox import Sandbox, sandbox
from partitioner.unit_costs import UnitCosts

Progress = Callable[[int, int, str], None]
BUDGET = 0.25  # seconds of timed runs per measurement, past which no more repeats are run


class _Clock:
    """Times a callable on CPU (perf_counter) or CUDA (events, synchronised)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return float(start.elapsed_time(end)) / 1e3
        begin = time.perf_counter()
        fn()
        return time.perf_counter() - begin


def _stderr_progress() -> Progress:
    """Print a line to stderr at most every 2 s, so only long profiles show progress."""
    last = [time.monotonic()]

    def report(done: int, total: int, name: str) -> None:
        now = time.monotonic()
        if now - last[0] >= 2.0:
            last[0] = now
            print(f"profiling {done}/{total} nodes ({name})", file=sys.stderr, flush=True)

    return report


def _fresh(value: Any) -> Any:
    """Clone tensors so in-place ops in a repeated node never change the values it reads."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, value)


def _as_in_step(value: Any) -> Any:
    """Floating tensors as a training step passes them (needing grad), so a compiled unit's
    forward is the code the backward's probe and the stages run (compiled once)."""
    return tree_map(lambda t: t.detach().requires_grad_() if isinstance(t, torch.Tensor)
                    and t.is_floating_point() else t, value)


def _describe(value: Any) -> str:
    """A parameter, buffer, submodule or input by what its cost depends on, not its name."""
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype} {value.requires_grad} {value.device}"
    if isinstance(value, nn.Module):
        held = [_describe(t) for t in (*value.parameters(), *value.buffers())]
        return f"{type(value).__qualname__} {value!r} {held}"
    return repr(value) if isinstance(value, int | float | bool | str | None) else type(
        value).__qualname__


def signature(unit: nn.Module, inputs: Any) -> str:
    """What a unit's cost depends on: its ops in order (each op's target, its arguments with
    graph values by position and constants as written, each parameter, buffer or submodule
    it reads by class and shapes) and the shapes and dtypes of the inputs it is given. Blocks
    of one class with the same shapes (GPT-2's layers, ALBERT's shared layer at each call)
    have the same signature, whatever their module paths: `profile` measures one of them."""
    parts = [_describe(leaf) for leaf in tree_flatten(inputs)[0]]
    if not isinstance(unit, fx.GraphModule):
        return "\n".join([_describe(unit), *parts])
    position: dict[str, str] = {}
    for i, node in enumerate(unit.graph.nodes):
        position[node.name] = f"%{i}"
        if node.op in ("get_attr", "call_module"):
            what = _describe(unit.get_submodule(str(node.target)) if node.op == "call_module"
                             else _fetch(unit, str(node.target)))
        else:
            what = getattr(node.target, "__qualname__", None) or str(node.target)
        args = fx.node.map_arg((node.args, node.kwargs), lambda a: position[a.name])
        parts.append(f"{node.op} {what} {args}")
    return "\n".join(parts)


def _fetch(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class _Profiler(fx.Interpreter):
    def __init__(
        self, gm: fx.GraphModule, clock: _Clock, repeats: int, warmup: int, progress: Progress,
        box: Sandbox, runner: Callable[[nn.Module], nn.Module] | None = None,
        only: tuple[Captured, set[str], torch.device] | None = None,
    ) -> None:
        super().__init__(gm)
        self.runner = runner
        self.only = only  # (the capture, the units to measure, where), when not all of them
        self.clock = clock
        self.box = box
        self.repeats = repeats
        self.warmup = warmup
        self.progress = progress
        self.total = sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "output"))
        self.done = 0
        self.params = {p.data_ptr() for p in gm.parameters()}
        self.results: dict[str, UnitCosts] = {}
        self.first: dict[str, str] = {}  # signature -> the unit measured for it

    def _median(self, fn: Callable[[], Any], warmup: int | None = None) -> float:
        # Unwatched (no dispatch-mode overhead in the timings): the node's first run, watched,
        # has already saved whatever parameter it writes.
        with self.box.paused():
            for _ in range(self.warmup if warmup is None else warmup):
                fn()
            times: list[float] = []
            while len(times) < self.repeats and sum(times) < BUDGET:
                times.append(self.clock(fn))
            return statistics.median(times)

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "output"):
            return super().run_node(n)
        if self.only is not None and n.name not in self.only[1]:
            return self._unmeasured(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        run = getattr(self, n.op)
        with torch.no_grad():
            result = run(n.target, args, kwargs)
        key = signature(self.fetch_attr(str(n.target)), (args, kwargs)) if (
            n.op == "call_module") else None
        first = self.first.get(key) if key is not None else None
        if first is not None:  # an identical block (same ops, shapes) was measured already
            self.results[n.name] = dataclasses.replace(self.results[first], measured_as=first)
        else:
            if key is not None:
                self.first[key] = n.name
            self.results[n.name] = self._measure(n, self._timed(n, run), args, kwargs)
        self.done += 1
        self.progress(self.done, self.total, n.name)
        return result

    def _unmeasured(self, n: fx.Node) -> Any:
        """A unit not measured here: run (untimed) when it holds its tensors, else zeros for
        the values it hands on, shaped as at capture (its tensors are another process's)."""
        unit = self.fetch_attr(str(n.target))
        if all(t.numel() for t in (*unit.parameters(), *unit.buffers())):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            with torch.no_grad():
                return getattr(self, n.op)(n.target, args, kwargs)
        assert self.only is not None
        captured, _, device = self.only
        out = next(node for node in unit.graph.nodes if node.op == "output")
        values = []
        for node in out.args[0]:
            value = captured.values.get(node.name)
            if value is None or not value.tensor or value.shape is None:
                raise ValueError(
                    f"unit {n.name!r} hands on {node.name!r}, which is not one tensor "
                    f"({value}), and its weights are not here: its successors cannot be "
                    "measured apart from it; profile the whole model (balance='profile')"
                )
            dtype = getattr(torch, value.dtype.removeprefix("torch."))
            values.append(torch.zeros(value.shape, dtype=dtype, device=device))
        return tuple(values)

    def _timed(self, n: fx.Node, run: Any) -> Any:
        """What runs the node when it is measured: `run`, or the runner's form of a unit."""
        if self.runner is None or n.op != "call_module":
            return run
        unit = self.runner(self.fetch_attr(str(n.target)))
        return lambda _target, args, kwargs: unit(*args, **kwargs)

    def _measure(self, n: fx.Node, run: Any, args: Any, kwargs: Any) -> UnitCosts:
        wrapped = self.runner is not None and n.op == "call_module"
        fresh = _as_in_step if wrapped else _fresh
        with torch.set_grad_enabled(wrapped):  # see `profile`
            forward = self._median(
                lambda: run(n.target, *fresh((args, kwargs))),
                max(1, self.warmup) if wrapped else max(0, self.warmup - 1),
            )
        return self._backward(n, run, args, kwargs, forward)

    def _backward(self, n: fx.Node, run: Any, args: Any, kwargs: Any, forward: float
                  ) -> UnitCosts:
        own = []
        if n.op == "call_module":
            own = [p for p in self.fetch_attr(str(n.target)).parameters() if p.requires_grad]
        got = probe(run, n.target, args, kwargs, weights=own,
                    is_param=lambda t: t.data_ptr() in self.params,
                    key=lambda t: (t.data_ptr(), t.numel()))
        if not got.has_backward:
            return UnitCosts(forward=forward, activation_bytes=got.activation_bytes)
        leaves, weights = got.leaves, got.weights
        backward = self._median(got.grad_of(leaves + weights))
        # B: the input-grad walk alone (capped by the whole backward against timing noise).
        if not leaves:
            input_grad = 0.0
        elif not weights:
            input_grad = backward
        else:
            input_grad = min(backward, self._median(got.grad_of(leaves)))
        return UnitCosts(forward=forward, input_grad=input_grad,
                         weight_grad=backward - input_grad,
                         activation_bytes=got.activation_bytes)


def _copy_to(gm: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """A deep copy of `gm` whose tensors are made on `device` directly (deepcopy's memo holds
    their copies there), so the host never holds a second copy of the model."""
    memo: dict[int, Any] = {}
    for t in (*gm.parameters(), *gm.buffers()):
        copied = t.detach().to(device, copy=True)
        memo[id(t)] = (
            nn.Parameter(copied, requires_grad=t.requires_grad)
            if isinstance(t, nn.Parameter) else copied
        )
    return copy.deepcopy(gm, memo)


def profile(
    captured: Captured,
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    *,
    device: str | torch.device = "cpu",
    repeats: int = 3,
    warmup: int = 1,
    progress: Progress | None = None,
    runner: Callable[[nn.Module], nn.Module] | None = None,
    units: Collection[str] | None = None,
) -> dict[str, UnitCosts]:
    """The `UnitCosts` of every unit of a `capture`d model, measured: forward, input-grad and
    weight-grad seconds (see the module docstring) and activation bytes. The record is left as
    it was; ``captured.with_costs(costs)`` is the one to partition by profiled time.

    `model` is the model the graph was captured from (its state is sandboxed). On a `device`
    other than the model's, a copy is measured there. `progress(done, total, node)` is called
    after each node; by default a line goes to stderr every 2 s for long profiles.

    `runner(unit)`: what runs a unit when it is measured, e.g. its compiled form (over the
    same parameters), so the costs are those of the code the steps will run. Such a unit's
    forward is timed as a training step runs it (recording for its backward: a compiled
    forward that only infers is other code), after its warm-up runs (which compile it).

    `units`: measure only these (the ones a process holds once the model is split): every
    other unit runs untimed, or, when its tensors were freed (another process holds them),
    gives zeros shaped as its values were at capture (`Captured.values`); so pass the inputs
    the model was captured on. Only the measured units' costs are returned."""
    if repeats < 1 or warmup < 0:
        raise ValueError(
            f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}"
        )
    if not isinstance(example_inputs, tuple):
        raise TypeError(
            f"example_inputs must be a tuple, got {type(example_inputs).__name__}; wrap as (x,)"
        )
    target = torch.device(device)
    gm = captured.unit_module  # one call_module per unit
    current = next((p.device for p in gm.parameters()), torch.device("cpu"))
    same = current.type == target.type and target.index in (None, current.index)
    with sandbox(model) as box:
        if not same:
            gm = _copy_to(gm, target)
            for sub in gm.modules():
                if isinstance(sub, fx.GraphModule):
                    retarget(sub, target)
            example_inputs = tree_map(
                lambda t: t.to(target) if isinstance(t, torch.Tensor) else t, example_inputs
            )
        profiler = _Profiler(
            gm, _Clock(target), repeats, warmup, progress or _stderr_progress(), box, runner,
            None if units is None else (captured, set(units), target),
        )
        profiler.run(*example_inputs)
    return dict(profiler.results)
