"""Planning at scale from meta tensors: the priced units reproduce published analytic
results exactly (Korthikanti et al. 2022's activation bytes per layer, the Zero Bubble
paper's F/B/W FLOPs and bubbles), and a layout's prediction and the search hold together."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.app.cli import main
from pipeline.planning.hardware import TARGETS
from pipeline.planning.scale.layout import Job, Layout, fit, parse_layout
from pipeline.planning.scale.predict import predict
from pipeline.planning.scale.pricing import UnitPrice, price
from pipeline.planning.scale.stages import _block
from pipeline.planning.scale.transformer import TransformerLM, block, parse_spec
from pipeline.planning.scale.units import priced_units
from scheduler import build_schedule, simulate
from scheduler.simulate import peak_held

A100 = TARGETS["a100-sxm4-80gb"]
B, S, H, A = 2, 64, 32, 4  # microbatch, sequence, hidden, heads: a s / h = 8
GPT = parse_spec(f"gpt:layers=4,hidden={H},heads={A},vocab=128,seq={S},attention=math")


def _priced(tp: int = 1, spec=GPT) -> UnitPrice:
    with torch.device("meta"):
        m = block(spec, tp).to(torch.bfloat16)
        x = torch.empty(B, S, H, dtype=torch.bfloat16, requires_grad=True)
    return price(m, (x,), A100, S)


NORM_STATS = 2 * 2 * 4 * S * B  # two LayerNorms' fp32 mean and rstd per token


def test_activation_bytes_match_korthikanti_table_2() -> None:
    sbh = S * B * H
    none = _priced()
    assert none.saved - NORM_STATS == sbh * (34 + 5 * A * S / H)
    assert none.saved_core == sbh * 5 * A * S / H  # the seq x seq part selective drops
    t = 2
    tp = _priced(t)
    assert tp.saved - NORM_STATS == sbh * (10 + 24 / t + 5 * A * S / (H * t))
    units = priced_units(GPT, A100, "bf16", t, B)
    sp = _block(units, Layout(tp=t, recompute="none", sequence_parallel=True), 0.0)
    assert sp.held - NORM_STATS / t == sbh * (34 / t + 5 * A * S / (H * t))
    full = _block(units, Layout(tp=t, recompute="full", sequence_parallel=True), 0.0)
    assert full.held == 2 * sbh / t  # the layer input, sequence-sharded
    selective = _block(priced_units(GPT, A100, "bf16", 1, B), Layout(recompute="selective"),
                       0.0)
    assert selective.held - NORM_STATS == sbh * 34


def test_flash_attention_holds_no_seq_by_seq_tensor() -> None:
    flash = _priced(spec=parse_spec(f"gpt:layers=4,hidden={H},heads={A},vocab=128,seq={S}"))
    # 34 sbh, the norm statistics, the kernel's fp32 log-sum-exp per head and token, and
    # its dropout RNG state (a 2-element and a 0-d uint64: 24 bytes).
    assert flash.saved == S * B * H * 34 + NORM_STATS + 4 * B * A * S + 24
    assert flash.saved_core == 0


def test_forward_input_grad_weight_grad_flops_are_the_zero_bubble_papers() -> None:
    p = _priced()
    sbh = S * B * H
    assert p.forward_flops == sbh * (24 * H + 4 * S)
    assert p.input_grad_flops == sbh * (24 * H + 8 * S)
    assert p.backward_flops - p.input_grad_flops == sbh * 24 * H


@pytest.mark.parametrize(("name", "idle"), [
    ("1f1b", lambda f, b, w: f + b + w),
    ("zb-h1", lambda f, b, w: f + b - w),
])
def test_bubbles_from_priced_flops_are_the_zero_bubble_formulas(name, idle) -> None:
    p, m = 4, 8
    units = _priced()
    f, b = units.forward_flops, units.input_grad_flops
    w = units.backward_flops - b
    timeline = simulate(build_schedule(name, p, m), [f] * p, [b] * p, [w] * p)
    step = max(e.end for e in timeline.events) - min(e.start for e in timeline.events)
    assert step - m * (f + b + w) == pytest.approx((p - 1) * idle(f, b, w))


# DeepSeek-V3 report, Table 2 (and the DualPipe repository's table): F, B, W per chunk with B
# the full backward (input grad + W), PP stages; 1F1B and ZB1P on PP devices, DualPipeV on PP/2.
# Chunk costs (F, input grad, W) of comparable size, as a transformer's are (the table's
# regime); docs/planning-at-scale.md says where dualpipev's idle time leaves the formula.
_COSTS = [(1.0, 1.0, 1.0), (2.0, 1.0, 1.0), (3.0, 2.0, 1.0), (1.0, 1.0, 0.5), (1.0, 1.1, 0.9),
          (1.0, 1.2, 0.5), (2.0, 2.0, 1.0)]


def _bubble_and_peak(name: str, ranks: int, m: int, f: float, b_in: float, w: float
                     ) -> tuple[float, tuple[float, ...], int]:
    schedule = build_schedule(name, ranks, m)
    n = schedule.num_stages
    timeline = simulate(schedule, [f] * n, [b_in] * n, [w] * n)
    step = max(e.end for e in timeline.events) - min(e.start for e in timeline.events)
    chunks = n // ranks
    return (step - m * chunks * (f + b_in + w), peak_held(schedule, [1.0] * n),
            max(len(schedule.stages_of(r)) for r in range(ranks)))


@pytest.mark.parametrize(("f", "b_in", "w"), _COSTS)
@pytest.mark.parametrize("pp", [4, 6, 8])
def test_the_dualpipe_table_as_far_as_a_sequential_rank_runs_it(f, b_in, w, pp) -> None:
    big_b = b_in + w  # the table's full backward
    for m in (pp, 2 * pp):
        bubble, peak, chunks = _bubble_and_peak("1f1b", pp, m, f, b_in, w)
        assert bubble == pytest.approx((pp - 1) * (f + big_b))
        assert (max(peak), chunks) == (pp, 1)
        bubble, peak, chunks = _bubble_and_peak("zb-h1", pp, m, f, b_in, w)
        assert bubble == pytest.approx((pp - 1) * (f + big_b - 2 * w))
        assert (max(peak), chunks) == (pp, 1)
        # DualPipeV: PP stages on PP/2 ranks; parameters 2 chunks, activations PP + 1 per rank.
        bubble, peak, chunks = _bubble_and_peak("dualpipev", pp // 2, m, f, b_in, w)
        assert peak == (pp + 1,) * (pp // 2) and chunks == 2
        # The table's (PP/2-1)(F&B + B - 3W) with F&B = F + B (F and B of a pair one after
        # the other, as our ranks run them) is (PP/2-1) input-grad Bs over what the
        # simulated schedule idles: (PP/2-1)(F + B - 2W), ZB1P's bracket on PP/2 ranks.
        table = (pp // 2 - 1) * ((f + big_b) + big_b - 3 * w)
        assert bubble == pytest.approx((pp // 2 - 1) * (f + big_b - 2 * w))
        assert bubble == pytest.approx(table - (pp // 2 - 1) * b_in)


def _job(world: int = 16, batch: int = 32) -> Job:
    spec = parse_spec("gpt:layers=8,hidden=64,heads=4,vocab=256,seq=64")
    return Job(spec, A100, world, batch)


def test_a_layout_prediction_adds_up() -> None:
    job = _job()
    p = predict(job, parse_layout("tp=2,pp=4,microbatches=8,schedule=1f1b,zero=zero1"))
    assert (p.dp, p.microbatch_size) == (2, 2)
    assert p.step_time >= p.pipeline_time > 0
    # 1F1B: the first rank holds p microbatches, the last one.
    assert p.peak_memory[0] == max(p.peak_memory)
    mem = p.memory
    assert mem.weights == mem.gradients  # 16-bit weight and gradient
    assert mem.optimizer == pytest.approx(mem.weights / 2 * 12 / p.dp)  # ZeRO-1 shard
    assert 0 < p.mfu < 1 and p.tflops_per_gpu > 0
    none = predict(job, parse_layout("tp=2,pp=4,microbatches=8,schedule=1f1b"))
    assert none.memory.optimizer == pytest.approx(mem.optimizer * p.dp)


def test_the_runtime_cost_per_action_and_step_enters_the_prediction() -> None:
    from dataclasses import replace

    from pipeline.planning.scale.predict import finish, simulate_layout

    job, act, step = _job(), 1e-3, 5e-3
    timed = Job(job.spec, replace(A100, action_overhead=act, step_overhead=step),
                job.world_size, job.batch_size)
    for name in ("1f1b", "zb-h1"):
        layout = parse_layout(f"tp=2,pp=4,microbatches=8,schedule={name}")
        plain, slow = simulate_layout(job, layout), simulate_layout(timed, layout)
        for rank, (a, b) in enumerate(zip(plain.times, slow.times, strict=True)):
            actions = len(slow.schedule.actions[rank])  # F, B (and W when split apart)
            busy = sum(e - s for s, e in b) - sum(e - s for s, e in a)
            assert busy == pytest.approx(actions * act)
        assert finish(timed, slow).step_time >= finish(job, plain).step_time + step


def test_layouts_that_do_not_fit_say_why() -> None:
    job = _job()
    with pytest.raises(ValueError, match="does not divide world size"):
        fit(job, Layout(tp=2, pp=3))
    with pytest.raises(ValueError, match="spans nodes"):
        fit(Job(job.spec, A100, 32, 32), Layout(tp=16))
    with pytest.raises(ValueError, match="batch 32 does not split"):
        fit(job, Layout(pp=4, microbatches=3))
    with pytest.raises(ValueError, match="keys"):
        parse_layout("tp=2,color=red")
    with pytest.raises(ValueError, match="lacks"):
        parse_spec("gpt:layers=2,hidden=64")
    with pytest.raises(ValueError, match="multiple of heads"):
        parse_spec("llama:layers=2,hidden=64,heads=3,vocab=8,seq=8")


def test_family_model_builds_on_meta_with_the_counted_parameters() -> None:
    spec = parse_spec("llama:layers=2,hidden=64,heads=4,kv_heads=2,vocab=256,seq=16")
    with torch.device("meta"):
        model = TransformerLM(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.parameters()
    assert model(torch.zeros(2, 16, dtype=torch.long, device="meta")).shape == (2, 16, 256)


def test_plan_cli_predicts_a_layout_with_the_json_fields(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    code = main(["plan", "gpt:layers=8,hidden=64,heads=4,vocab=256,seq=64", "--world-size",
                 "16", "--target", "h100-sxm5-80gb", "--batch-size", "32", "--layout",
                 "tp=2,pp=4,microbatches=8,virtual_stages=2,schedule=interleaved-1f1b,"
                 "recompute=full", "--json", str(out)])
    assert code == 0
    row = json.loads(out.read_text())["candidates"][0]
    for key in ("step_time", "peak_memory", "tp", "microbatch_size", "tflops_per_gpu", "mfu"):
        assert key in row
    assert row["tp"] == 2 and row["microbatch_size"] == 2 and len(row["peak_memory"]) == 4
    assert "TFLOP/s per GPU" in capsys.readouterr().out


@pytest.mark.slow
def test_search_ranks_fitting_layouts_and_counts_rejections() -> None:
    from pipeline.planning.scale.search import search

    job = _job(world=16, batch=32)
    plan = search(job, keep=5, schedules=["1f1b", "interleaved-1f1b", "zb-h1"])
    steps = [c.step_time for c in plan.candidates]
    assert steps == sorted(steps) and len(steps) == 5
    assert all(c.max_memory <= plan.memory_limit for c in plan.candidates)
    tight = search(job, keep=5, schedules=["1f1b"],
                   memory_limit=min(c.max_memory for c in plan.candidates) * 0.6)
    assert tight.rejected.get("over the memory cap", 0) > 0
    assert all(c.max_memory <= tight.memory_limit for c in tight.candidates)
    assert "rejected" in tight.table()


def test_synthesised_schedule_and_fp32_state() -> None:
    job = _job(world=2, batch=8)
    synth = predict(job, parse_layout("pp=2,microbatches=4,schedule=synth"))
    assert synth.built is not None and "actions" in synth.to_dict()
    one_f_one_b = predict(job, parse_layout("pp=2,microbatches=4,schedule=1f1b"))
    assert synth.pipeline_time <= one_f_one_b.pipeline_time * 1.001
    fp32 = predict(Job(job.spec, A100, 2, 8, "fp32"), parse_layout("pp=2,microbatches=4"))
    mem = fp32.memory  # fp32 Adam: 4 (weight) + 4 (gradient) + 8 (moments) per parameter
    assert mem.weights == mem.gradients == mem.optimizer / 2


def test_fsdp_without_a_pipeline_shards_everything_and_pays_its_gathers() -> None:
    job = _job(world=8, batch=8)
    zero1 = predict(job, parse_layout("pp=1,microbatches=1,zero=zero1"))
    fsdp = predict(job, parse_layout("pp=1,microbatches=1,zero=fsdp"))
    mem = fsdp.memory
    assert mem.weights == pytest.approx(zero1.memory.weights / 8)  # ZeRO-3: 16-bit weights
    assert mem.gradients == pytest.approx(zero1.memory.gradients / 8)  # and grads sharded
    assert mem.optimizer == pytest.approx(zero1.memory.optimizer)
    assert fsdp.step_time >= zero1.pipeline_time


def test_any_model_is_captured_on_meta_and_priced_unit_by_unit() -> None:
    from pipeline.planning.scale.graph import price_graph

    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
    spec = price_graph("stack", model, (torch.randn(8, 64),), A100)
    assert len(spec.units) == 4 and spec.batch == 8
    assert all(u.forward_flops == 2 * 8 * 64 * 64 for u in spec.units)
    assert spec.units[0].input_grad_flops == 2 * 8 * 64 * 64  # the input's grad
    assert spec.units[0].parameters == 64 * 64 + 64
    job = Job(spec, A100, 4, 32)
    p = predict(job, parse_layout("pp=2,microbatches=2,schedule=1f1b"))
    assert p.dp == 2 and p.microbatch_size == 8 and len(p.peak_memory) == 2
    assert predict(job, parse_layout("pp=2,microbatches=4")).microbatch_size == 4
    with pytest.raises(ValueError, match="families only"):
        fit(job, Layout(tp=2, pp=2))
    with pytest.raises(ValueError, match="families only"):
        fit(job, Layout(pp=2, microbatches=2, recompute="full"))


@pytest.mark.slow  # imports transformers: several seconds
def test_a_hugging_face_config_by_name_plans_for_a_target(tmp_path) -> None:
    from pipeline.app.cli.model_arg import hf_config, load_model
    from pipeline.planning.scale.graph import price_graph

    model = "hf:gpt2,n_layer=2,n_embd=32,n_head=2,vocab_size=128,n_positions=32,seq=16"
    out = tmp_path / "plan.json"
    assert main(["plan", model, "--world-size", "4", "--target", "a100-sxm4-80gb",
                 "--batch-size", "16", "--layout", "pp=2,microbatches=4,schedule=1f1b",
                 "--json", str(out)]) == 0
    row = json.loads(out.read_text())["candidates"][0]
    assert (row["pp"], row["dp"], row["microbatch_size"]) == (2, 2, 2)
    with torch.device("meta"):
        built = load_model(model)
    priced = price_graph(model, built, (torch.randint(0, 128, (2, 16)),), A100)
    # Every parameter priced, the head's weight tied to the token embedding at both of its
    # units (a pipeline holds it on the first and the last stage).
    assert sum(u.parameters for u in priced.units) == sum(
        p.numel() for p in built.parameters()) + 128 * 32
    assert len(row["peak_memory"]) == 2
    with pytest.raises(ValueError, match="no model type 'gpt3'; did you mean"):
        hf_config("hf:gpt3")
    with pytest.raises(ValueError, match="is not key=value"):
        hf_config("hf:gpt2,n_layer")
