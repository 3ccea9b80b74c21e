"""Measure a captured graph node by node: forward time, backward time (split into input-grad and
weight-grad time), and the activation bytes autograd keeps for backward.

The split follows what a split-backward schedule runs: B (input grad) is the measured time of
the gradient w.r.t. the node's inputs alone, W (weight grad) is the rest of the backward,
backward - B. Timing the weight gradient alone would be wrong for a composite node (a block of
several layers): the weights of its inner layers need backprop through the block, so it costs
nearly the whole backward, while B has already done that walk when W runs.

Each node is run on its real inputs from one pass over the example input. Every timing (the
forward, the whole backward, the input-grad walk) first runs `warmup` times untimed (the pass's
own run does not count), so no unit, the first one included, pays for a cold start inside its
figure; then it is timed `repeats` times or until `BUDGET` seconds have been timed (a unit that
takes longer is timed once: its noise is small next to it), and the median is kept. Units of
the same ops on inputs of the same shapes (see `signature`) are measured once and share the
figure, so identical layers cost exactly the same and balance evenly. Everything happens
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
from partitioner.exported import retarget, unit_item
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


def _marked(value: Any, flags: Any, fresh: bool = False) -> Any:
    """`value` with the floating tensors a gradient reaches (`flags`, a tree of bools of its
    structure) as leaves needing grad (`fresh`: non-leaf copies of them, so in-place ops
    stay legal), the others as they are."""
    def mark(t: Any, flag: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and flag is True:
            leaf = t.detach().requires_grad_()
            return leaf.clone() if fresh else leaf
        return t

    return tree_map(mark, value, flags)


def _flags(value: Any) -> Any:
    """Per leaf of `value`, whether it is a tensor a gradient reaches."""
    return tree_map(lambda t: isinstance(t, torch.Tensor) and t.requires_grad, value)


def _detached(value: Any) -> Any:
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, value)


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
    have the same signature, whatever their module paths: `profile` measures one of them.
    Inputs are named by their flat position among the given leaves, whether a unit receives
    a value itself (the first unit: the model's input) or as an item of the tuple an earlier
    unit handed on (`unit_item`, no work of its own): the first of eight identical layers is
    identical to the others."""
    leaves = tree_flatten(inputs)[0]
    parts = [_describe(leaf) for leaf in leaves]
    if not isinstance(unit, fx.GraphModule):
        return "\n".join([_describe(unit), *parts])
    given = list(inputs[0]) if isinstance(inputs, tuple) and inputs and isinstance(
        inputs[0], tuple | list) else []
    position: dict[str, str] = {}
    held: dict[str, tuple[int, Any]] = {}  # placeholder -> (its first leaf's position, value)
    first = ops = 0
    for node in unit.graph.nodes:
        if node.op == "placeholder":
            value = given[len(held)] if len(held) < len(given) else None
            held[node.name] = (first, value)
            position[node.name] = f"in{first}"
            first += len(tree_flatten(value)[0])
            continue
        item = _item_of(node, held)
        if item is not None:
            position[node.name] = f"in{item}"
            continue
        position[node.name] = f"%{ops}"
        ops += 1
        if node.op in ("get_attr", "call_module"):
            what = _describe(unit.get_submodule(str(node.target)) if node.op == "call_module"
                             else _fetch(unit, str(node.target)))
        else:
            what = getattr(node.target, "__qualname__", None) or str(node.target)
        args = fx.node.map_arg((node.args, node.kwargs), lambda a: position[a.name])
        parts.append(f"{node.op} {what} {args}")
    return "\n".join(parts)


def _item_of(node: fx.Node, held: dict[str, tuple[int, Any]]) -> int | None:
    """The flat input position `node` reads when it takes an item of a placeholder's tuple
    (`unit_item`), else None."""
    if node.target is not unit_item:
        return None
    source, index = node.args
    if not isinstance(source, fx.Node) or source.name not in held or not isinstance(index, int):
        return None
    first, value = held[source.name]
    if not isinstance(value, tuple | list):
        return None
    return first + sum(len(tree_flatten(v)[0]) for v in value[:index])


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
        self.flags: dict[str, Any] = {}  # node -> which leaves of its value a gradient reaches

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
        if n.op in ("placeholder", "output") or (
                self.only is not None and n.name not in self.only[1]):
            result = super().run_node(n) if n.op in ("placeholder", "output") else (
                self._unmeasured(n))
            # The model's floating inputs may need grad, as the stages see them (and, not
            # measured here, a unit's outputs).
            self.flags[n.name] = tree_map(
                lambda t: isinstance(t, torch.Tensor) and t.is_floating_point(), result)
            return result
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        flags = fx.node.map_arg((n.args, n.kwargs), lambda a: self.flags[a.name])
        run = getattr(self, n.op)
        tracking = self.runner is not None  # compiled units are timed as the stages run them
        with torch.enable_grad() if tracking else torch.no_grad():
            # With grad: which outputs a gradient reaches, as in a step.
            result = run(n.target, *(_marked((args, kwargs), flags, fresh=True) if tracking
                                     else (args, kwargs)))
        self.flags[n.name] = _flags(result)
        result = _detached(result)
        # A compiled unit runs as the stages run it: its inputs needing grad as there.
        wrapped = self.runner is not None and n.op == "call_module"
        given = flags if wrapped else None
        key = signature(self.fetch_attr(str(n.target)), _marked((args, kwargs), flags)
                        if wrapped else (args, kwargs)) if n.op == "call_module" else None
        first = self.first.get(key) if key is not None else None
        if first is not None:  # an identical block (same ops, shapes) was measured already
            self.results[n.name] = dataclasses.replace(self.results[first], measured_as=first)
        else:
            if key is not None:
                self.first[key] = n.name
            self.results[n.name] = self._measure(n, self._timed(n, run), args, kwargs, given)
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

    def _measure(self, n: fx.Node, run: Any, args: Any, kwargs: Any, flags: Any) -> UnitCosts:
        """`flags`: for a compiled unit, which of its inputs need grad (as the stages give
        them); None for an eager one, whose every floating input is timed as needing grad
        (so identical layers, the first one too, share one measurement)."""
        wrapped = flags is not None
        with torch.set_grad_enabled(wrapped):  # see `profile`
            # Warmed up as every timing is (the pass's first run does not count: it ran
            # watched, and a unit's first runs pay for allocation and, compiled, compiling).
            forward = self._median(
                lambda: run(n.target, *(_marked((args, kwargs), flags) if wrapped
                                        else _fresh((args, kwargs)))),
                max(1, self.warmup) if wrapped else self.warmup)
        return self._backward(n, run, args, kwargs, forward, flags)

    def _backward(self, n: fx.Node, run: Any, args: Any, kwargs: Any, forward: float,
                  flags: Any) -> UnitCosts:
        own = []
        if n.op == "call_module":
            own = [p for p in self.fetch_attr(str(n.target)).parameters() if p.requires_grad]
        got = probe(run, n.target, args, kwargs, weights=own, needs=flags,
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
