"""Compiled stages (`Pipeline(compile=...)`): a compiled step equals the unsplit model's (float64,
1e-12) on every schedule, the zero-bubble ones included, for the demo GPT and for Hugging Face
GPT-2 (tied embedding) and Llama; the compiled code really runs (a recording backend counts its
calls, so a silent eager fallback fails); B and W of a split backward together run exactly the
matrix products of one whole backward (W does not redo the input-grad work); equal blocks share
one artefact; checkpointing, bf16 autocast, a later batch of another shape and forward only run
compiled, also after torch.fx capture; a region that cannot be traced runs eager with a
warning naming it; torchrun is in distributed/test_compile_distributed.py; bad settings are
errors naming the fix. The input-grad / weight-grad cut is checked on a graph of its own, and
one test runs the real inductor backend."""

from __future__ import annotations

import copy
import logging
import time
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import pipeline
from pipeline import Pipeline
from pipeline.execution.compiled import compile_options
from pipeline.execution.compiled.joint import trace_joint
from scheduler import SCHEDULES
from tests.support.models import lm_loss, make_model
from tests.support.real_models import SPECS, build, check_step

ATOL = 1e-12
_MATMULS = ("mm", "addmm", "bmm", "baddbmm")


class Recorder:
    """A torch.compile backend that runs the graph as it is and counts, per call, the graph's
    matrix products: what the compiled path executed."""

    def __init__(self) -> None:
        self.calls = 0
        self.matmuls = 0

    def __call__(self, gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        products = sum(
            1 for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "__name__", "").split(".")[0]
            in _MATMULS
        )

        def run(*args: Any) -> Any:
            self.calls += 1
            self.matmuls += products
            return gm.forward(*args)

        return run


RECORDER = Recorder()  # one backend for the module: artefacts are shared between tests


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))


def _compiled(model: nn.Module, schedule: str, **kwargs: Any) -> Pipeline:
    return Pipeline(model, 2, schedule=schedule, microbatches=4, loss_fn=lm_loss,
                    compile={"backend": RECORDER}, **kwargs)


def _stats(pipe: Pipeline) -> Any:
    stats = pipe.compile_stats
    assert stats is not None
    return stats


def test_compile_settings_checked() -> None:
    assert compile_options(False) is None and compile_options(None) is None
    assert compile_options(True) is not None
    assert compile_options({"mode": "max-autotune-no-cudagraphs"}).mode == (  # type: ignore[union-attr]
        "max-autotune-no-cudagraphs")
    with pytest.raises(TypeError, match="compile must be True, False or a dict"):
        compile_options("yes")
    with pytest.raises(ValueError, match=r"unknown torch.compile argument\(s\) \['modes'\]"):
        compile_options({"modes": "default"})
    with pytest.raises(ValueError, match="either mode or options"):
        compile_options({"mode": "default", "options": {"max_autotune": True}})
    with pytest.raises(ValueError, match="'nope' is not a torch.compile backend"):
        compile_options({"backend": "nope"})
    with pytest.raises(TypeError, match="fullgraph must be True or False"):
        compile_options({"fullgraph": 1})


def test_cpu_rank_threads_use_the_cpp_wrapper() -> None:
    """Stages run by threads of one process on CPU compile with inductor's C++ wrapper (a
    compiled graph then runs without holding the GIL the threads share), unless the settings
    name it or a mode; other backends are left alone."""
    def options(compile: Any) -> Any:
        return Pipeline(make_model(), 2, loss_fn=lm_loss, compile=compile)._executor.compile

    assert options(True).options == {"cpp_wrapper": True}
    assert options({"options": {"cpp_wrapper": False}}).options == {"cpp_wrapper": False}
    assert options({"mode": "max-autotune-no-cudagraphs"}).options == {}
    assert options({"backend": RECORDER}).options == {}
    assert options({"options": {"max_autotune": True}}).options == {
        "max_autotune": True, "cpp_wrapper": True}


def test_split_backward_graphs() -> None:
    """x -> gelu(x @ W^T + b) -> sum: the input-grad graph has one product (dx = g W), the
    weight-grad graph one (dW = g^T x) and reads g from what the input-grad graph keeps."""
    w, b, x = torch.randn(4, 3), torch.randn(4), torch.randn(2, 3)
    args = [w.requires_grad_(), b.requires_grad_(), x.requires_grad_()]

    def fn(*a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (F.gelu(F.linear(a[2], a[0], a[1])).sum(-1),)

    joint = trace_joint(fn, args, [True], weights=[0, 1])
    split = joint.split
    assert split is not None and split.inputs == (2,) and split.weights == (0, 1)

    def products(gm: fx.GraphModule) -> int:
        return sum(1 for n in gm.graph.nodes if str(n.target).startswith("aten.mm"))

    assert (products(joint.backward), products(split.input_grad),
            products(split.weight_grad)) == (2, 1, 1)
    # Run the pieces: they give the whole backward's grads.
    out = joint.forward(w, b, x)
    saved, tangent = out[1:], torch.ones(2)
    whole = joint.backward(*saved, tangent)
    first = split.input_grad(*saved, tangent)
    every = (*saved, tangent)
    dw = split.weight_grad(*(every[i] for i in split.picked), *first[len(split.inputs):])
    torch.testing.assert_close(first[0], whole[2])
    torch.testing.assert_close(dw[0], whole[0])
    torch.testing.assert_close(dw[1], whole[1])


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    model = make_model()
    x, y = _batch()
    loss = lm_loss(model(x), y)
    loss.backward()
    return {"loss": loss.detach(), "grads": {k: p.grad for k, p in model.named_parameters()}}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_compiled_schedules_exact(schedule: str, reference: dict[str, Any]) -> None:
    model = make_model()
    x, y = _batch()
    pipe = _compiled(model, schedule, example_input=x)  # planned (units profiled) first
    calls, matmuls = RECORDER.calls, RECORDER.matmuls
    loss = pipe.step(x, y)
    torch.testing.assert_close(loss, reference["loss"], atol=ATOL, rtol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference["grads"][name], atol=ATOL, rtol=0, msg=name)
    # Every region ran compiled: the recorded graphs did the step's work.
    stats = _stats(pipe)
    assert stats.eager == {}
    assert RECORDER.calls > calls
    # The same products as a whole backward per microbatch: a split backward's W does not
    # redo the input-grad work. Per block 4 linear layers: 4 products forward, 8 backward
    # (input and weight grad each; attention is one fused op); the head 1 + 2; the embedding
    # gather none.
    per_microbatch = 4 * (4 + 8) + 1 + 2
    assert RECORDER.matmuls - matmuls == 4 * per_microbatch


@pytest.mark.slow
def test_equal_blocks_share_one_artefact() -> None:
    """The four blocks (two per stage) compile one forward and one backward together; a
    second Pipeline of the model compiles nothing new."""
    model = make_model()
    x, y = _batch()
    pipe = _compiled(model, "1f1b", example_input=x)
    regions = [r for s in pipe._executor.runtimes for m in s.stages.values()
               for r in _runners(m)]
    assert sorted(r.name.split("'")[1] for r in regions) == [
        "blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f", "tok"]
    assert len({r.code for r in regions if "blocks" in r.name}) == 1
    pipe.step(x, y)
    again = _compiled(make_model(), "1f1b")
    again.step(x, y)
    assert _stats(again).graphs == 0 and _stats(again).reused >= 6


def _runners(module: nn.Module) -> list[Any]:
    graph = module.graph
    assert isinstance(graph, fx.Graph)
    return [n.target for n in graph.nodes
            if n.op == "call_function" and hasattr(n.target, "signatures")]


@pytest.mark.slow
def test_fx_capture_compiles() -> None:
    """torch.fx capture (blocks called whole as modules): the modules' tensors become the
    region's arguments, so it compiles too; blocks of one class trace to the same graphs and
    share them."""
    model = make_model()
    ref = copy.deepcopy(model)
    x, y = _batch()
    pipe = Pipeline(model, 2, schedule="zb-h1", microbatches=4, loss_fn=lm_loss,
                    capture_method="fx", compile={"backend": RECORDER})
    calls = RECORDER.calls
    check_step(pipe, model, ref, x, y, atol=ATOL)
    assert _stats(pipe).eager == {} and RECORDER.calls > calls
    assert _stats(pipe).reused >= 3  # blocks 1..3 use block 0's graphs


@pytest.mark.slow
@pytest.mark.parametrize(("name", "schedule", "microbatches"),
                         [("gpt2", "zb-h1", 2), ("llama", "zbv", 4)])
def test_compiled_real_models(name: str, schedule: str, microbatches: int) -> None:
    spec = SPECS[name]
    model = build(name)
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    x, y = spec.batch(4, 8)
    pipe = Pipeline(model, 2, microbatches=microbatches, loss_fn=spec.loss_fn, schedule=schedule,
                    compile={"backend": RECORDER})
    calls = RECORDER.calls
    check_step(pipe, model, ref, x, y, atol=ATOL)
    assert _stats(pipe).eager == {} and RECORDER.calls > calls
    if name == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight  # still tied


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["full", "selective", "bf16"])
def test_compiled_equals_eager_pipeline(setting: str) -> None:
    """Activation policies (recomputed region by region) and bf16 autocast: the compiled
    step equals the eager pipeline's (bf16: the casts are in the traced graph, and nothing
    is cast twice)."""
    kwargs: dict[str, Any] = (
        {"mixed_precision": torch.bfloat16} if setting == "bf16"
        else {"checkpoint_activations": setting}
    )
    dtype = torch.float32 if setting == "bf16" else torch.float64
    x, y = _batch()
    results = []
    for options in (False, {"backend": RECORDER}):
        model = make_model().to(dtype)
        pipe = Pipeline(model, 2, schedule="zb-h1", microbatches=4, loss_fn=lm_loss,
                        compile=options, **kwargs)
        calls = RECORDER.calls
        loss = pipe.step(x, y)
        results.append((loss, {k: p.grad for k, p in model.named_parameters()}))
        if options:
            assert _stats(pipe).eager == {} and RECORDER.calls > calls
    (eager_loss, eager_grads), (loss, grads) = results
    torch.testing.assert_close(loss, eager_loss, atol=ATOL, rtol=0)
    for name, g in grads.items():
        torch.testing.assert_close(g, eager_grads[name], atol=ATOL, rtol=0, msg=name)


@pytest.mark.slow
def test_new_shapes_and_forward_only() -> None:
    """A batch of another length compiles its shapes, in a step whose timeout (1 s) is
    shorter than the tracing: time spent compiling is not a stuck stage. Forward only (no
    grad) runs the compiled forward too; both equal the unsplit model."""
    model = make_model()
    ref = copy.deepcopy(model)
    pipe = _compiled(model, "1f1b", timeout=1.0)
    torch.manual_seed(2)
    x, y = torch.randint(0, 32, (8, 5)), torch.randint(0, 32, (8, 5))
    check_step(pipe, model, ref, x, y, atol=ATOL)
    calls = RECORDER.calls
    with torch.no_grad():
        out = pipe(x)
    torch.testing.assert_close(out, ref(x), atol=ATOL, rtol=0)
    assert RECORDER.calls > calls and _stats(pipe).eager == {}


class _Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 6)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.slow
def test_untraceable_region_runs_eager_with_a_warning() -> None:
    """BatchNorm's running statistics are updated in place, which the joint trace refuses:
    that region runs eager, a warning names it and why; the others compile; the step is
    exact (float64) against the eager pipeline."""
    torch.manual_seed(0)
    model = _Normed().double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    eager = copy.deepcopy(model)
    expected = Pipeline(eager, 2, microbatches=2, loss_fn=F.mse_loss).step(x, y)
    pipe = Pipeline(model, 2, microbatches=2, loss_fn=F.mse_loss,
                    compile={"backend": RECORDER})
    calls = RECORDER.calls
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = pipe.step(x, y)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("region 'layers.1' runs eager" in m and "running statistics" in m
               for m in messages), messages
    eager_regions = _stats(pipe).eager
    assert list(eager_regions) == [m.split("compile: ")[1].split(" runs")[0] for m in messages]
    assert RECORDER.calls > calls  # the Linear regions compiled
    torch.testing.assert_close(loss, expected, atol=ATOL, rtol=0)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=0, msg=name)
    for a, b in zip(model.buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


@pytest.mark.slow
def test_meta_built_model_compiles() -> None:
    """A model built on meta (pipeline.meta_init, buffers computed in __init__) and
    materialised by init_fn compiles: its ZB-H1 step runs compiled graphs, none eager, and
    equals the unsplit model given the weights the pipeline made (on meta the planner
    estimates the units: there is nothing to time)."""
    from tests.pipeline.test_meta_init import SEQ, VOCAB, Model

    torch.manual_seed(0)
    with pipeline.meta_init():
        model = Model()
    pipe = _compiled(model, "zb-h1", init_fn="reset_parameters")
    x, y = torch.randint(0, VOCAB, (4, SEQ)), torch.randint(0, VOCAB, (4, SEQ))
    calls = RECORDER.calls
    loss = pipe.step(x, y)
    assert RECORDER.calls > calls and _stats(pipe).eager == {}
    ref = Model()
    ref.load_state_dict(pipe.state_dict())
    want = lm_loss(ref(x), y)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), atol=ATOL, rtol=0)
    grads = dict(pipe.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, atol=ATOL, rtol=0, msg=name)


class _Slow:
    """A torch.compile backend whose graphs sleep `delay` s per call before running: what a
    profile of compiled code sees, and eager code does not."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.calls = 0

    def __call__(self, gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            self.calls += 1
            time.sleep(self.delay)
            return gm.forward(*args)

        return run


@pytest.mark.slow
def test_balance_profiles_compiled_units() -> None:
    """Under compile= the planner's profile times the units compiled (not eager): with a
    backend that adds 50 ms to every compiled graph call, each block's forward, backward and
    input-grad walk cost at least that, and so do the stage costs the balance used; the
    stages then reuse the block artefacts the profile compiled."""
    delay = 0.05
    slow = _Slow(delay)
    x, _ = _batch()
    pipe = Pipeline(make_model(), 2, microbatches=2, loss_fn=lm_loss,
                    compile={"backend": slow}, example_input=x)
    assert slow.calls > 0  # planning ran compiled code
    blocks = {n: c for n, c in pipe.captured.costs.items() if n.startswith("blocks")}
    assert len(blocks) == 4
    for name, c in blocks.items():
        # F: one forward graph call; backward: the whole backward graph; B: the input-grad one.
        assert c.forward >= delay, name
        assert c.backward >= delay and c.input_grad >= delay, name
    costs = pipe.profiled_costs()
    assert all(f >= 2 * delay for f in costs.forward), costs.forward  # two blocks a stage
    stats = _stats(pipe)
    planned = stats.graphs
    x, y = _batch()
    pipe.step(x, y)
    assert stats.reused >= 2 and stats.eager == {}  # the stages' blocks: the profiled ones
    assert stats.graphs - planned < planned


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_profile_compiles_input_grad_graphs_only_for_split_schedules(
    schedule: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The planner times B apart from the whole backward only where the schedule splits it:
    under 1F1B the profiled units compile no input-grad graph, under ZB-H1 they do."""
    x, _ = _batch()
    with caplog.at_level(logging.INFO, logger="hybridpipe"):
        Pipeline(make_model(), 2, schedule=schedule, microbatches=2, loss_fn=lm_loss,
                 compile={"backend": Recorder()}, example_input=x)
    compiled = [r.getMessage() for r in caplog.records
                if "profiled unit" in r.getMessage() and "compiled in" in r.getMessage()]
    assert any(" backward compiled" in m for m in compiled), compiled
    assert any("input-grad" in m for m in compiled) == (schedule == "zb-h1"), compiled


@pytest.mark.slow
def test_inductor_exact() -> None:
    """The real inductor backend (C++ on CPU), float64: 1F1B and ZB-H1 equal the unsplit
    model; dynamo's counters show the graphs were compiled by inductor."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = nn.Sequential(*[_Block(8) for _ in range(4)]).double()
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    ref = copy.deepcopy(model)
    before = Counter(counters["inductor"])
    for schedule in ("1f1b", "zb-h1"):
        pipe = Pipeline(model, 2, schedule=schedule, microbatches=2, loss_fn=F.mse_loss,
                        compile=True)
        check_step(pipe, model, ref, x, y, atol=ATOL)
        assert _stats(pipe).eager == {}
    compiled = Counter(counters["inductor"]) - before
    # fw, whole bw (stage 0), input-grad and weight-grad bw: each from inductor or its cache.
    assert compiled["fxgraph_cache_miss"] + compiled["fxgraph_cache_hit"] >= 4, compiled


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_cuda_compiled_max_autotune(schedule: str) -> None:
    """On CUDA (two ranks on one GPU), inductor with mode="max-autotune-no-cudagraphs"
    (Triton kernels): the compiled step equals the eager pipeline's to float32 rounding
    (TF32 off), B and W kept apart under ZB-H1, nothing eager."""
    torch.backends.cuda.matmul.allow_tf32 = False
    x, y = (t.cuda() for t in _batch())
    results = []
    for options in (False, {"mode": "max-autotune-no-cudagraphs"}):
        model = make_model().float().cuda()
        pipe = Pipeline(model, 2, schedule=schedule, microbatches=4, loss_fn=lm_loss,
                        devices=["cuda:0", "cuda:0"], compile=options)
        loss = pipe.step(x, y)
        results.append((loss, {k: p.grad for k, p in model.named_parameters()}))
        if options:
            assert _stats(pipe).eager == {} and _stats(pipe).graphs > 0
    (eager_loss, eager_grads), (loss, grads) = results
    torch.testing.assert_close(loss, eager_loss, atol=1e-5, rtol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, eager_grads[name], atol=1e-5, rtol=1e-4, msg=name)



@pytest.mark.slow
def test_auto_stages_survey_profiles_compiled_units(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stages="auto" with compile=: the layout's survey (which the ranking and the plan that
    reuses it read) times the units compiled, through the artefacts the stages then run. A
    one-process gloo job, a two-layer MLP."""
    import torch.distributed as dist

    from pipeline.facade import planning_phase as setup

    surveys: list[tuple[Any, int]] = []
    choose = setup.choose_layout

    def spied(*args: Any, **kwargs: Any) -> Any:
        before = RECORDER.calls
        chosen = choose(*args, **kwargs)
        surveys.append((kwargs["hooks"], RECORDER.calls - before))
        return chosen

    monkeypatch.setattr(setup, "choose_layout", spied)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
        x, y = torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64)
        pipe = Pipeline(model, stages="auto", loss_fn=F.mse_loss,
                        compile={"backend": RECORDER}, example_input=x)
        [(hooks, calls)] = surveys
        assert hooks.unit_runner is not None and calls > 0  # the survey ran compiled code
        assert pipe.captured.costs  # the plan reused the surveyed (compiled) costs
        pipe.step(x, y)
        stats = _stats(pipe)
        assert stats.reused > 0 and stats.eager == {}  # the survey's artefacts, reused
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_llama_blocks_compile_once() -> None:
    """Llama's rotary cos and sin reach stage 1 without grad, as stage 0's blocks get them
    (no gradient path to them: the plan marks them), so every block of both stages, and the
    unit the profile timed, runs one artefact (one forward, one backward graph): with cos and
    sin needing grad in stage 1 the block compiled twice. The step equals the unsplit
    model's."""
    spec = SPECS["llama"]
    model = build("llama")
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    x, y = spec.batch(4, 8)
    pipe = Pipeline(model, 2, microbatches=2, loss_fn=spec.loss_fn, schedule="1f1b",
                    compile={"backend": RECORDER})
    check_step(pipe, model, ref, x, y, atol=ATOL)
    blocks = [r for s in pipe._executor.runtimes for m in s.stages.values()
              for r in _runners(m) if "layers" in r.name]
    stages = {r.name.split()[1] for r in blocks}
    assert len(blocks) == 3 and stages == {"0", "1"}, [r.name for r in blocks]
    assert len({key for r in blocks for key in r.signatures}) == 1
