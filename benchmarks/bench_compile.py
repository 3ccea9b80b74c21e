"""Benchmark: ``Pipeline(compile=True)`` against the eager pipeline, side by side with the
unsplit model eager and under ``torch.compile``, in one run on CPU (inductor's C++ backend):

- step time at pp=2 (local executor, 1F1B, 4 microbatches) for the demo GPT
  (pipeline/app/models.py) and a Hugging Face Llama config; the runs of a model step in
  turn, round after round (order rotated), so load on the machine hits them alike. The figure
  of merit: (pipeline compiled speedup) / (unsplit compiled speedup), goal >= 0.95. In one
  process on CPU the compiled stages use inductor's C++ wrapper by default; the pipeline
  also with the Python wrapper (``options={"cpp_wrapper": False}``) for comparison;
- the same pipelines under torchrun (2 gloo processes, one per stage, 1 thread each: no GIL
  shared between the stages), eager vs compiled, against the in-process unsplit speedup;
- the float32 agreement of the compiled pipeline's loss and gradients with the compiled
  unsplit model and with the eager pipeline (largest |difference| over the largest |value|);
- under ZB-H1: the measured mean B (input grads) and W (weight grads) per stage, eager and
  compiled (`pipe.calibration`); a compiled W costs about the weight-grad work, not a whole
  backward; and the calibrated simulation against the measured step;
- compile time of the demo GPT at 4 and 16 identical blocks (each in a fresh process with an
  empty inductor cache), and 16 blocks again with that cache warm.

Writes benchmarks/results/compile.{md,json}.
Run: .venv/bin/python benchmarks/bench_compile.py    (BENCH_REPEATS sets the rounds, default 8)
"""

from __future__ import annotations

import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from launch import gather, hand_back
from report import write_results
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline import Pipeline  # noqa: E402
from pipeline.app.models import GPT  # noqa: E402

REPEATS, WARMUP = int(os.environ.get("BENCH_REPEATS", "8")), 2
# The pipeline runs: compiled as by default (in one process on CPU: inductor's C++ wrapper,
# which runs a whole compiled graph without holding the GIL), and with the Python wrapper,
# which calls each fused C++ kernel holding it, so the local executor's rank threads queue.
RUNS: dict[str, Any] = {
    "unsplit eager": False, "unsplit compiled": True, "pipeline eager": False,
    "pipeline compiled": True,
    "pipeline compiled (Python wrapper)": {"options": {"cpp_wrapper": False}},
}
ROWS, SEQ, VOCAB, M = 16, 64, 256, 4


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def demo_gpt(layers: int = 4, dim: int = 128) -> nn.Module:
    torch.manual_seed(0)
    return GPT(vocab=VOCAB, dim=dim, layers=layers, heads=4, max_seq=SEQ)


class Llama(nn.Module):
    """transformers' LlamaForCausalLM (a small config), returning the logits."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
            bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )
        self.model = LlamaForCausalLM(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (ROWS, SEQ), generator=g),
            torch.randint(0, VOCAB, (ROWS, SEQ), generator=g))


def _unsplit(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model(x), y)
        loss.backward()
        return loss.detach()

    return step


def _runs(build: Callable[[], nn.Module]) -> dict[str, tuple[nn.Module, Callable[..., Any], Any]]:
    """name -> (model, step(x, y), pipe or None): four copies of the same weights."""
    base = build()
    runs: dict[str, tuple[nn.Module, Callable[..., Any], Any]] = {}
    for name, compiled in RUNS.items():
        model = copy.deepcopy(base)
        if name.startswith("unsplit"):
            fn = torch.compile(model) if compiled else model
            runs[name] = (model, _unsplit(fn), None)
        else:
            pipe = Pipeline(model, 2, microbatches=M, loss_fn=lm_loss, compile=compiled)
            runs[name] = (model, pipe.step, pipe)
    return runs


def _agreement(a: nn.Module, b: nn.Module) -> float:
    """Largest |grad difference| over the largest |grad|, across parameters."""
    worst = 0.0
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        scale = q.grad.abs().max().item() or 1.0
        worst = max(worst, (p.grad - q.grad).abs().max().item() / scale)
    return worst


def step_times(label: str, build: Callable[[], nn.Module]) -> dict[str, Any]:
    x, y = batch()
    runs = _runs(build)
    start = time.perf_counter()
    first: dict[str, float] = {}
    for name, (model, step, _) in runs.items():
        t0 = time.perf_counter()
        for _ in range(WARMUP):
            model.zero_grad(set_to_none=True)
            step(x, y)
        first[name] = time.perf_counter() - t0
    # One more step each from zero grads: the gradients compared below.
    losses = {}
    for name, (model, step, _) in runs.items():
        model.zero_grad(set_to_none=True)
        losses[name] = step(x, y).item()
    agree = {
        "pipeline compiled vs unsplit compiled": _agreement(
            runs["pipeline compiled"][0], runs["unsplit compiled"][0]),
        "pipeline compiled vs pipeline eager": _agreement(
            runs["pipeline compiled"][0], runs["pipeline eager"][0]),
        "unsplit compiled vs unsplit eager": _agreement(
            runs["unsplit compiled"][0], runs["unsplit eager"][0]),
    }
    samples: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(REPEATS):
        for name in names[r % len(names):] + names[: r % len(names)]:
            model, step, _ = runs[name]
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            step(x, y)
            samples[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(v) for name, v in samples.items()}
    unsplit = median["unsplit eager"] / median["unsplit compiled"]
    pipeline = median["pipeline eager"] / median["pipeline compiled"]
    wrapped = median["pipeline eager"] / median["pipeline compiled (Python wrapper)"]
    stats = runs["pipeline compiled"][2].compile_stats
    return {
        "model": label, "median_s": median, "samples_s": samples, "warmup_s": first,
        "losses": losses, "agreement": agree,
        "unsplit_speedup": unsplit, "pipeline_speedup": pipeline,
        "ratio": pipeline / unsplit, "compile": str(stats),
        "python_wrapper_speedup": wrapped, "python_wrapper_ratio": wrapped / unsplit,
        "paired_ratio": _paired(samples, "pipeline compiled"),
        "compile_seconds": stats.seconds, "wall_s": time.perf_counter() - start,
    }


def _paired(samples: dict[str, list[float]], compiled: str) -> float:
    """The ratio round by round (the four runs of a round meet the same load on the shared
    machine), its median over the rounds."""
    rounds = zip(samples["pipeline eager"], samples[compiled], samples["unsplit eager"],
                 samples["unsplit compiled"], strict=True)
    return statistics.median((pe / pc) / (ue / uc) for pe, pc, ue, uc in rounds)


MODELS: dict[str, Callable[[], nn.Module]] = {"demo GPT": demo_gpt, "Llama (transformers)": Llama}


def _worker(label: str) -> None:
    """One torchrun process (a stage each): eager and compiled pipelines of `label`, stepped
    in turn; rank 0 hands back the median step times."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    x, y = batch()
    base = MODELS[label]()
    pipes = {name: Pipeline(copy.deepcopy(base), 2, microbatches=M, loss_fn=lm_loss,
                            compile=flag) for name, flag in (("eager", False), ("compiled", True))}
    for pipe in pipes.values():
        for _ in range(WARMUP):
            pipe.zero_grad()
            pipe.step(x, y)
    samples: dict[str, list[float]] = {name: [] for name in pipes}
    for r in range(REPEATS):
        for name in list(pipes)[r % 2:] + list(pipes)[: r % 2]:
            pipes[name].zero_grad()
            dist.barrier()
            t0 = time.perf_counter()
            pipes[name].step(x, y)
            samples[name].append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        hand_back({name: statistics.median(v) for name, v in samples.items()})
    dist.destroy_process_group()


def torchrun_steps(label: str, unsplit: float) -> dict[str, Any]:
    """The pipeline eager vs compiled under torchrun; `unsplit`: the in-process unsplit
    speedup the ratio is taken against."""
    median = gather(__file__, 2, label)
    speedup = median["eager"] / median["compiled"]
    return {"median_s": median, "speedup": speedup, "ratio": speedup / unsplit}


def split_backward() -> dict[str, Any]:
    """ZB-H1 on the demo GPT, eager and compiled: B and W per stage from the calibration,
    and the calibrated prediction against the measured step."""
    x, y = batch()
    out: dict[str, Any] = {}
    base = demo_gpt()
    for name, flag in (("eager", False), ("compiled", True)):
        pipe = Pipeline(copy.deepcopy(base), 2, schedule="zb-h1", microbatches=M,
                        loss_fn=lm_loss, compile=flag)
        times = []  # the measured step (first action start to last action end)
        for _ in range(WARMUP + REPEATS):
            pipe.zero_grad()
            pipe.step(x, y)
            times.append(pipe.trace.step_time)
        cal = pipe.calibration
        assert cal is not None
        step = statistics.median(times[WARMUP:])
        predicted = pipe.simulate().step_time
        out[name] = {
            "forward_s": cal.forward, "input_grad_s": cal.backward, "weight_grad_s": cal.weight,
            "step_s": step, "predicted_s": predicted, "error": predicted / step - 1,
        }
    return out


def compile_time(layers: int, cache: str, setting: str = "True") -> dict[str, Any]:
    """One first step of the demo GPT with `layers` blocks in a fresh process using the
    inductor cache folder `cache`; `setting`: the Pipeline's compile= (Python source)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, PYTHONPATH=str(ROOT))
    code = (
        "import json, time, torch; torch.set_num_threads(1)\n"
        "import sys; sys.path.insert(0, 'benchmarks')\n"
        "from bench_compile import demo_gpt, batch, lm_loss\n"
        "from pipeline import Pipeline\n"
        f"pipe = Pipeline(demo_gpt({layers}, dim=64), 2, microbatches=4, loss_fn=lm_loss,"
        f" compile={setting})\n"
        "x, y = batch(); t = time.perf_counter(); pipe.step(x, y)\n"
        "first = time.perf_counter() - t; t = time.perf_counter(); pipe.step(x, y)\n"
        "s = pipe.compile_stats\n"
        "print(json.dumps({'first_step_s': first, 'second_step_s': time.perf_counter() - t,"
        " 'compile_s': s.seconds, 'graphs': s.graphs, 'reused': s.reused}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=False,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the compile-time run failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _report(data: dict[str, Any]) -> str:
    lines = [
        "# Compiled stages: `Pipeline(compile=True)` (benchmarks/bench_compile.py)", "",
        f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared), "
        f"torch {torch.__version__}, inductor C++ backend, 1 intra-op thread; "
        f"{ROWS} rows x {SEQ} tokens, pp=2, {M} microbatches, 1F1B; "
        f"median of {REPEATS} interleaved rounds after {WARMUP} warm-up steps. The ratio is "
        "(pipeline eager / pipeline compiled) / (unsplit eager / unsplit compiled) of the "
        "medians; the paired ratio is that ratio taken within each round, its median "
        "(less sensitive to the load of other users of the machine moving between rounds).",
        "",
        "| model | unsplit eager | unsplit compiled | speedup | pipeline eager | "
        "pipeline compiled | speedup | ratio (goal >= 0.95) | paired ratio | "
        "with the Python wrapper | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["steps"]:
        m = r["median_s"]
        lines.append(
            f"| {r['model']} | {m['unsplit eager'] * 1e3:.0f} ms | "
            f"{m['unsplit compiled'] * 1e3:.0f} ms | {r['unsplit_speedup']:.2f}x | "
            f"{m['pipeline eager'] * 1e3:.0f} ms | {m['pipeline compiled'] * 1e3:.0f} ms | "
            f"{r['pipeline_speedup']:.2f}x | {r['ratio']:.2f} | {r['paired_ratio']:.2f} | "
            f"{m['pipeline compiled (Python wrapper)'] * 1e3:.0f} ms "
            f"({r['python_wrapper_speedup']:.2f}x) | {r['python_wrapper_ratio']:.2f} |")
    lines += ["", "Under torchrun (2 gloo processes, one stage each, 1 thread each; the unsplit "
              "speedup from the in-process runs above):", "",
              "| model | pipeline eager | pipeline compiled | speedup | ratio (goal >= 0.95) |",
              "|---|---|---|---|---|"]
    for r in data["steps"]:
        t = r["torchrun"]
        lines.append(f"| {r['model']} | {t['median_s']['eager'] * 1e3:.0f} ms | "
                     f"{t['median_s']['compiled'] * 1e3:.0f} ms | {t['speedup']:.2f}x | "
                     f"{t['ratio']:.2f} |")
    lines += ["", "float32 agreement of the gradients (largest |difference| / largest |value|):",
              ""]
    for r in data["steps"]:
        text = ", ".join(f"{k}: {v:.1e}" for k, v in r["agreement"].items())
        lines.append(f"- {r['model']}: {text}")
    lines += ["", "Compile work of the pipeline (first steps): "
              + "; ".join(f"{r['model']}: {r['compile']}" for r in data["steps"]), ""]
    zb = data["split_backward"]
    lines += ["## ZB-H1: B (input grads) and W (weight grads), demo GPT", "",
              "| run | stage | F | B | W | W / (B + W) |", "|---|---|---|---|---|---|"]
    for name in ("eager", "compiled"):
        r = zb[name]
        for s, (f, b, w) in enumerate(zip(r["forward_s"], r["input_grad_s"],
                                          r["weight_grad_s"], strict=True)):
            lines.append(f"| {name} | {s} | {f * 1e3:.1f} ms | {b * 1e3:.1f} ms | "
                         f"{w * 1e3:.1f} ms | {w / (b + w):.2f} |")
    lines += ["", "Calibrated simulation vs measured step: " + ", ".join(
        f"{name} {zb[name]['predicted_s'] * 1e3:.0f} ms predicted / "
        f"{zb[name]['step_s'] * 1e3:.0f} ms measured ({zb[name]['error']:+.0%})"
        for name in ("eager", "compiled")), ""]
    ct = data["compile_time"]
    lines += ["## Compile time, demo GPT (dim 64), pp=2, fresh process", "",
              "The first step plans (the profiled units compile) and compiles the stages; "
              "inductor's C++ wrapper (the default in one process on CPU) unless noted.", "",
              "| blocks | inductor cache | first step | second step | compile | graphs |",
              "|---|---|---|---|---|---|"]
    for key, r in ct.items():
        blocks, cache = key.split("/")
        lines.append(f"| {blocks} | {cache} | {r['first_step_s']:.1f} s | "
                     f"{r['second_step_s'] * 1e3:.0f} ms | {r['compile_s']:.1f} s | "
                     f"{r['graphs']} ({r['reused']} shared) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    torch.set_num_threads(1)
    data: dict[str, Any] = {"repeats": REPEATS, "warmup": WARMUP}
    with tempfile.TemporaryDirectory() as cold4, tempfile.TemporaryDirectory() as cold16, \
            tempfile.TemporaryDirectory() as python4:
        data["compile_time"] = {
            "4/cold, Python wrapper": compile_time(
                4, python4, '{"options": {"cpp_wrapper": False}}'),
            "4/cold": compile_time(4, cold4),
            "16/cold": compile_time(16, cold16),
            "16/warm": compile_time(16, cold16),
        }
    data["steps"] = [step_times(label, build) for label, build in MODELS.items()]
    for r in data["steps"]:
        r["torchrun"] = torchrun_steps(r["model"], r["unsplit_speedup"])
    data["split_backward"] = split_backward()
    write_results("compile", data, _report(data))


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker(sys.argv[-1])
    else:
        main()
