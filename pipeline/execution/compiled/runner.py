"""Running a region compiled: `RegionRunner` is what the compiled stage's driver calls for one
region. For a training call it runs `RegionFunction`, an autograd node whose forward is the
region's compiled forward graph and whose backward picks, from what the engine will execute,
the compiled whole backward (both input and weight grads wanted), the compiled input-grad graph
(B of a split backward: it keeps the values W needs on the node) or the compiled weight-grad
graph (W: it starts from what B kept). Artefacts are cached process-wide by the region's
canonical code and input signature, so equal blocks, and later Pipelines of the same model,
reuse them.

A region that cannot be traced, or a graph whose compilation fails, runs eager, with a warning
naming it and why; never silently, and never by failing the step."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor
from torch.func import functional_call

from pipeline.execution.compiled.joint import JointGraphs, Partition, trace_joint
from pipeline.execution.compiled.options import CompileOptions
from pipeline.execution.compiled.regions import Region, canonical

log = logging.getLogger("hybridpipe")


@dataclass
class CompileStats:
    """Compile work of one Pipeline's stages: graphs compiled (and seconds spent tracing and
    compiling them), region calls served by an artefact another region compiled, and the
    regions or graphs that run eager with the reason."""

    seconds: float = 0.0
    graphs: int = 0
    reused: int = 0
    eager: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    logged: int = field(default=0, repr=False)

    def __str__(self) -> str:
        eager = f"; eager: {', '.join(self.eager)}" if self.eager else ""
        return (f"{self.graphs} graphs compiled in {self.seconds:.1f} s (tracing included), "
                f"{self.reused} region shapes served by an equal region's artefact{eager}")

    def log_news(self) -> None:
        """One log line when a step compiled something new (the first step, a new shape)."""
        if self.graphs != self.logged:
            self.logged = self.graphs
            log.info("hybridpipe compile: %s", self)

    def add(self, seconds: float, graphs: int = 0) -> None:
        with self.lock:
            self.seconds += seconds
            self.graphs += graphs

    def runs_eager(self, what: str, reason: str) -> None:
        with self.lock:
            if what in self.eager:
                return
            self.eager[what] = reason
        message = f"hybridpipe compile: {what} runs eager: {reason}"
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        log.warning(message)


_BUSY = [0]  # threads of this process tracing or compiling a region now
_BUSY_LOCK = threading.Lock()


@contextmanager
def _busy() -> Iterator[None]:
    with _BUSY_LOCK:
        _BUSY[0] += 1
    try:
        yield
    finally:
        with _BUSY_LOCK:
            _BUSY[0] -= 1


def compiling() -> bool:
    """Whether a thread of this process is tracing or compiling a region: the local
    executor's waits do not count that time against the timeout (a first step compiles)."""
    return _BUSY[0] > 0


class _Compiled:
    """One graph and its compiled form: the first call compiles (timed into the stats); if
    compiling fails the graph runs as it is from then on, with a warning."""

    def __init__(self, gm: Callable[..., Any], options: CompileOptions, what: str,
                 whole: bool = False) -> None:
        self.gm = gm
        self.what = what
        # Traced by torch.compile with its backward (a DTensor region): called as it is, under
        # the caller's autocast, which dynamo traces.
        self.whole = whole
        self.compiled: Callable[..., Any] = options.compile(gm)
        # A graph the options leave as it is (graph-level recompute) has nothing to compile.
        self.run: Callable[..., Any] | None = gm if self.compiled is gm else None
        self.lock = threading.Lock()

    def __call__(self, stats: CompileStats, *args: Any) -> Any:
        run = self.run
        if run is not None:
            return run(*args)
        with self.lock, _busy():
            if self.run is None:
                start = time.perf_counter()
                try:
                    result = self.compiled(*args)
                    self.run = self.compiled
                except Exception as err:  # noqa: BLE001 - a compiler failure must not fail the step
                    stats.runs_eager(self.what, f"torch.compile failed ({_reason(err)})")
                    self.run = self.gm
                    return self.gm(*args)
                seconds = time.perf_counter() - start
                stats.add(seconds, 1)
                log.info("hybridpipe compile: %s compiled in %.1f s", self.what, seconds)
                return result
        return self.run(*args)


class Artefact:
    """A region's compiled graphs for one input signature (forward, and lazily the whole
    backward, the input-grad and the weight-grad graphs)."""

    def __init__(self, joint: JointGraphs, options: CompileOptions, name: str,
                 stats: CompileStats) -> None:
        self.joint = joint
        self.name = name
        self.stats = stats
        self.forward = _Compiled(joint.forward, options, f"{name} forward")
        self.backward = _Compiled(joint.backward, options, f"{name} backward")
        split = joint.split
        self.input_grad = (None if split is None else
                           _Compiled(split.input_grad, options, f"{name} input-grad backward"))
        self.weight_grad = (None if split is None else
                            _Compiled(split.weight_grad, options, f"{name} weight-grad backward"))


def _reason(err: Exception) -> str:
    """An error in a line: in-place updates of inputs or buffers said plainly (AOTAutograd's
    own message prints its whole metadata)."""
    text = str(err)
    if "input mutations" in text:
        return ("it updates an input or a buffer in place, e.g. BatchNorm's running "
                "statistics; AOTAutograd's joint trace takes functional regions only")
    first = text.splitlines()[0] if text else ""
    return f"{type(err).__name__}: {first[:200]}"


class _Functional(nn.Module):
    """A region with modules called whole, taking their tensors as arguments (what
    torch.compile compiles for a forward-only call)."""

    def __init__(self, runner: RegionRunner) -> None:
        super().__init__()
        self.runner = runner

    def forward(self, *flat: Any) -> Any:
        return self.runner.run(*flat)


def _will_run(ctx: Any, indices: Sequence[int]) -> bool:
    """Whether this backward call needs the grad of any of the inputs at `indices`."""
    for i in indices:
        node = ctx.next_functions[i][0]
        if node is not None and torch._C._will_engine_execute_node(node):
            return True
    return False


class RegionFunction(torch.autograd.Function):
    """A compiled region as one autograd node (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, art: Artefact, device_type: str, splits: bool, *flat: Tensor) -> Any:
        joint = art.joint
        with _no_autocast(device_type):  # casts are in the traced graph
            result = art.forward(art.stats, *flat)
        outputs = result[: joint.num_outputs]
        ctx.art, ctx.device_type, ctx.count, ctx.pending = art, device_type, len(flat), None
        ctx.splits = splits
        ctx.save_for_backward(*result[joint.num_outputs:])
        ctx.mark_non_differentiable(
            *(o for i, o in enumerate(outputs) if i not in joint.tangents)
        )
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        art: Artefact = ctx.art
        # Unless the schedule splits the backward, every call wants the whole backward.
        joint, split, stats = art.joint, art.joint.split if ctx.splits else None, art.stats
        saved = ctx.saved_tensors
        tangents = [grads[i].contiguous() for i in joint.tangents]
        out: list[Tensor | None] = [None] * ctx.count
        with _no_autocast(ctx.device_type):
            need_x = split is not None and _will_run(ctx, split.inputs)
            need_w = split is not None and _will_run(ctx, split.weights)
            if split is None or art.input_grad is None or art.weight_grad is None or (
                need_x and need_w
            ):
                out = list(art.backward(stats, *saved, *tangents))
            elif need_x:  # B: input grads now, what W needs kept on the node
                got = art.input_grad(stats, *saved, *tangents)
                n = len(split.inputs)
                for i, g in zip(split.inputs, got[:n], strict=True):
                    out[i] = g
                every = (*saved, *tangents)
                ctx.pending = ([every[i] for i in split.picked], list(got[n:]))
            elif ctx.pending is not None:  # W after B: the weight grads only
                picked, kept = ctx.pending
                ctx.pending = None
                got = art.weight_grad(stats, *picked, *kept)
                for i, g in zip(split.weights, got, strict=True):
                    out[i] = g
            else:  # W without a B before it (e.g. re-walked under checkpointing)
                whole = art.backward(stats, *saved, *tangents)
                for i in split.weights:
                    out[i] = whole[i]
        return (None, None, None, *out)


def _uncached() -> AbstractContextManager[Any]:
    """Inductor's and AOTAutograd's on-disk caches off: an artefact of a DTensor region that
    another process compiled and cached was served and ran wrong (a pp=2 x tp=2 loss off by
    2%; exact with the caches off)."""
    import torch._inductor.config as inductor

    stack = ExitStack()
    stack.enter_context(inductor.patch(fx_graph_cache=False))
    stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
    return stack


def _no_autocast(device_type: str) -> AbstractContextManager[Any]:
    """Autocast off (the casts are in the traced graphs), entered only where it is on."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return nullcontext()


def _gate(t: Tensor) -> Tensor:
    # A leaf is given a view, so the node's backward can ask the engine whether its grad is
    # wanted (torch cannot answer that for a leaf inside autograd.grad).
    return t.view_as(t) if t.requires_grad and t.grad_fn is None else t


def _same(t: Tensor) -> Tensor:
    return t


def _signature(flat: Sequence[Any]) -> tuple[Any, ...]:
    sig: list[Any] = []
    for t in flat:
        if not isinstance(t, Tensor):
            raise TypeError(f"a {type(t).__name__} value crosses the region boundary")
        sig.append((tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad,
                    t.placements if isinstance(t, DTensor) else None))
    return tuple(sig)


def _autocast_state(device_type: str) -> tuple[Any, ...]:
    if not torch.is_autocast_enabled(device_type):
        return ()
    return (torch.get_autocast_dtype(device_type),)


_ARTEFACTS: dict[tuple[Any, ...], Artefact | _Compiled | str] = {}
_TRACED: dict[tuple[Any, ...], Artefact] = {}  # by the traced graphs' code
_TRACING = threading.Lock()
_MAX_SIGNATURES = 8  # per region: beyond that, new shapes run eager (a warning says so)


class RegionRunner:
    """Called by the driver as ``runner(*attrs, *inputs)``; returns the region's outputs."""

    def __init__(self, region: Region, owner: nn.Module, options: CompileOptions,
                 stats: CompileStats, where: str, splits: bool, quiet: bool = False) -> None:
        self.gm = canonical(region, owner)
        self.quiet = quiet  # a unit timed for the plan: its eager regions are logged only
        self.splits = splits  # the schedule splits the backward into B and W
        self.name = f"{where} region {region.name!r}"
        self.options = options
        self.stats = stats
        self.states = [name for name, _ in region.states]
        self.weights = len(region.attrs) + len(self.states)  # flat args that may be weights
        # Modules called whole are told apart by their code and settings (a torch.nn module's
        # repr), anything else by identity.
        self.modules = tuple(
            repr(m) if type(m).__module__.startswith("torch.nn") else id(m)
            for m in self.gm.children()
        )
        self.code = self.gm.code
        self.constants = tuple(  # tensors held in the code itself: not told apart by it
            id(c) for n in self.gm.graph.nodes for c in (*n.args, *n.kwargs.values())
            if isinstance(c, Tensor)
        )
        # What equal regions share (the part of an artefact's key fixed for this region).
        self.same = (self.code, self.constants, self.modules, options.key())
        self.signatures: set[tuple[Any, ...]] = set()
        self.eager: str | None = None
        self.__name__ = f"compiled_{region.name.replace('.', '_').replace('@', '_')}"

    def __call__(self, *flat: Any) -> Any:
        if self.eager is not None:
            return self.run(*flat)
        training = torch.is_grad_enabled() and any(
            isinstance(t, Tensor) and t.requires_grad for t in flat
        )
        device_type = next((t.device.type for t in flat if isinstance(t, Tensor)), "cpu")
        try:
            art = self._artefact(flat, training, device_type)
        except Exception as err:  # noqa: BLE001 - a region that cannot be traced runs eager
            self.eager = f"it could not be traced for compilation ({_reason(err)})"
            self._runs_eager(self.name, self.eager)
            return self.run(*flat)
        if isinstance(art, str):
            return self.run(*flat)
        if isinstance(art, _Compiled):
            if art.whole:
                with _uncached():
                    return art(self.stats, *flat)
            with _no_autocast(device_type):
                return art(self.stats, *flat)
        if not self.splits:  # the whole backward always: no need to ask what it wants
            return RegionFunction.apply(art, device_type, False, *flat)
        return RegionFunction.apply(art, device_type, True, *map(_gate, flat))

    def _runs_eager(self, what: str, reason: str) -> None:
        if self.quiet:
            log.info("hybridpipe compile: %s is timed eager: %s", what, reason)
        else:
            self.stats.runs_eager(what, reason)

    def _partition(self) -> Partition | None:
        """How the joint graph is cut (None: the min-cut partitioner, as torch.compile)."""
        return None

    def run(self, *flat: Any) -> Any:
        """The region as it is (eager): attrs, states of the modules called whole, inputs."""
        if not self.states:
            return self.gm(*flat)
        a, s = self.weights - len(self.states), len(self.states)
        state = dict(zip(self.states, flat[a : a + s], strict=True))
        return functional_call(self.gm, state, (*flat[:a], *flat[a + s :]))

    def _artefact(self, flat: Sequence[Any], training: bool, device_type: str) -> Any:
        key = (self.same, _signature(flat), training, _autocast_state(device_type))
        art = _ARTEFACTS.get(key)
        if art is not None:
            if key not in self.signatures:
                self.signatures.add(key)
                with self.stats.lock:
                    self.stats.reused += 1
            return art
        with _TRACING, _busy():
            art = _ARTEFACTS.get(key)
            if art is None:
                if len(self.signatures) >= _MAX_SIGNATURES:
                    self._runs_eager(
                        f"{self.name} (new input shapes)",
                        f"it was compiled for {_MAX_SIGNATURES} input shapes already; give "
                        "batches of fewer distinct shapes (e.g. pad to a few lengths)")
                    return "eager"
                art = _ARTEFACTS[key] = self._build(flat, training, device_type)
            self.signatures.add(key)
        return art

    def _whole(self) -> _Compiled:
        """A tensor-parallel region (DTensor weights and inputs), compiled by torch.compile:
        AOTAutograd's joint export refuses a traceable tensor subclass, dynamo takes DTensors
        (their collectives traced). Forward and backward are one autograd node (so B and W
        are not kept apart: split-backward schedules are refused with tp and compile=). Static
        shapes unless `dynamic=` says otherwise: a dynamic-shape trace of DTensor ops
        overflows the recursion of torch's symbolic-size proxies."""
        # Its backward may run twice (B, then W, the graph retained): AOTAutograd must donate
        # no buffers, which it checks when the backward runs, so for the whole process.
        options = self.options
        if options.dynamic is None:
            options = dataclasses.replace(options, dynamic=False)
        return _Compiled(_Functional(self), options, f"{self.name} (DTensor)", whole=True)

    def _build(self, flat: Sequence[Tensor], training: bool, device_type: str) -> Any:
        if any(isinstance(t, DTensor) for t in flat):
            return self._whole()
        if not training:
            region = _Functional(self) if self.states else self.gm
            return _Compiled(region, self.options, f"{self.name} (forward only)")
        start = time.perf_counter()
        args = [t.detach().requires_grad_(t.requires_grad) for t in flat]
        # Which outputs need a grad, from a run on fake tensors (no side effects, such as a
        # running statistic updated twice). Saved tensors of the probe and the trace bypass
        # the caller's hooks (an activation checkpoint counts the tensors its forward saves).
        with torch.enable_grad(), saved_tensors_hooks(_same, _same):
            with FakeTensorMode(allow_non_fake_inputs=True) as fake:
                probe = [fake.from_tensor(t).requires_grad_(t.requires_grad) for t in args]
                outputs = self.run(*probe)
            differentiable = [isinstance(o, Tensor) and o.requires_grad for o in outputs]
            weights = [i for i in range(self.weights) if flat[i].requires_grad]
            joint = trace_joint(lambda *a: tuple(self.run(*a)), args, differentiable, weights,
                                self.options.decompositions(), self._partition())
        for node in joint.forward.graph.nodes:
            if node.op == "output":
                saved = node.args[0][joint.num_outputs:]
                if any(not isinstance(n.meta.get("val"), Tensor) for n in saved):
                    raise RuntimeError("the forward keeps non-tensor values for the backward")
        self.stats.add(time.perf_counter() - start)
        # Regions told apart before tracing (modules called whole, compared by identity) may
        # still trace to the same graphs: they share the compiled ones.
        graphs = [joint.forward, joint.backward]
        if any(n.op == "get_attr" for g in graphs for n in g.graph.nodes):
            return Artefact(joint, self.options, self.name, self.stats)
        key = (*(g.code for g in graphs), self.options.key(), _signature(flat))
        art = _TRACED.get(key)
        if art is None:
            art = _TRACED[key] = Artefact(joint, self.options, self.name, self.stats)
        else:
            with self.stats.lock:
                self.stats.reused += 1
        return art
