"""Models built on the meta device under torch.distributed (gloo processes launched as torchrun
does): each process materialises only its own stages, and the weights equal those of the same
model materialised whole in one process, at pp=2 (Llama and the tied GPT-2) and pp=4 (Llama);
a step then equals the unsplit run in float64, and a second one, accumulated in place
(grad_accumulation="in_place"), doubles the gradients. A meta model with no weights fails its
first step on every rank at once, naming the parameters; a Llama loaded from a state dict gets
its rotary inv_freq.

This file is also the worker: ``python <this file> meta OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.distributed import HF_MODULES, Ended, all_ok, dump, launch

SEED = 11


def _build(name: str) -> torch.nn.Module:
    from tests.support.real_models import gpt2, llama

    return {"llama": llama, "gpt2": gpt2}[name]().double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, 48, (4, 6), generator=g), torch.randint(0, 48, (4, 6), generator=g)


def _reference(name: str) -> tuple[torch.nn.Module, float]:
    """The model materialised whole in one process, and its loss on the batch (with grads)."""
    from pipeline.execution.materialize import materialize
    from tests.support.models import lm_loss

    with torch.device("meta"):
        model = _build(name)
    materialize(model, [model], torch.device("cpu"), seed=SEED)
    x, y = _batch()
    loss = lm_loss(model(input_ids=x), y)
    loss.backward()
    return model, float(loss.detach())


def _init_checks(out: Path) -> None:
    """Every process: init from scratch on meta, gather the weights and grads on rank 0."""
    import torch.distributed as dist

    from pipeline import Pipeline
    from pipeline.checkpoint import gather_named
    from tests.support.models import lm_loss

    stages = dist.get_world_size()
    x, y = _batch()
    results = {}
    for name in ("llama", "gpt2") if stages == 2 else ("llama",):
        torch.manual_seed(SEED)
        with torch.device("meta"):
            model = _build(name)
        pipe = Pipeline(model, stages=stages, loss_fn=lm_loss, microbatches=2,
                        example_input={"input_ids": x}, init_fn="reset_parameters",
                        grad_accumulation="in_place")
        assert "estimated on meta" in str(pipe.plan)
        own = sum(p.numel() for p in pipe.parameters())
        total = sum(p.numel() for p in model.parameters())
        loss = float(pipe.step({"input_ids": x}, y))
        pipe.step({"input_ids": x}, y)  # accumulated in place (tied GPT-2 weight: the old way)
        state = pipe.state_dict()
        grads = gather_named({k: p.grad for k, p in pipe.named_parameters()},
                             pipe.distributed)
        if dist.get_rank() == 0:
            assert state is not None and grads is not None
            ref, ref_loss = _reference(name)
            for key, value in ref.state_dict().items():
                assert torch.equal(state[key], value), f"{name} {key} differs"
            for key, p in ref.named_parameters():
                got = grads[key]
                assert got is not None and torch.allclose(got, 2 * p.grad, atol=1e-10), key
            results[name] = {"loss": loss, "ref": ref_loss, "own": own, "total": total}
        else:
            results[name] = {"own": own, "total": total}
    (out / f"init{dist.get_rank()}.json").write_text(json.dumps(results))
    print("worker init: every check ran", flush=True)


def _load_checks(out: Path) -> None:
    """A meta Llama with no weights: the first step fails on every rank at once, naming them.
    Then one loaded from a state dict file (mmap): its inv_freq comes from the init."""
    import torch.distributed as dist

    from pipeline import Pipeline
    from tests.support.models import lm_loss

    x, y = _batch()
    stages = dist.get_world_size()
    with torch.device("meta"):
        model = _build("llama")
    pipe = Pipeline(model, stages=stages, loss_fn=lm_loss, microbatches=2,
                    example_input={"input_ids": x})
    start = time.monotonic()
    try:
        pipe.step({"input_ids": x}, y)
        raise AssertionError("a step on meta tensors ran")
    except ValueError as err:
        print(f"step failed after {time.monotonic() - start:.1f} s: {err}", flush=True)
    with torch.device("meta"):
        model = _build("llama")
    pipe = Pipeline(model, stages=stages, loss_fn=lm_loss, microbatches=2,
                    example_input={"input_ids": x})
    pipe.load_state_dict(torch.load(out / "weights.pt", mmap=True, weights_only=True))
    loss = float(pipe.step({"input_ids": x}, y))
    (out / f"load{dist.get_rank()}.json").write_text(json.dumps({"loss": loss}))
    print("worker load: every check ran", flush=True)


def _worker(out: Path) -> None:
    """The init checks; at world 2 the load checks after them in the same processes (a
    process start with torch costs seconds here)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    _init_checks(out)
    if dist.get_world_size() == 2:
        _load_checks(out)
    dist.destroy_process_group()


WORKERS = {"meta": _worker}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, list[Ended]]]:
    """The launches, made on first use: world size -> (their directory, how they ended)."""
    return {}


def _launched(runs: dict[int, tuple[Path, list[Ended]]], world: int,
              tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Ended]]:
    if world not in runs:
        out = tmp_path_factory.mktemp(f"world{world}")
        if world == 2:  # the load checks' weights, made whole in this process
            ref, ref_loss = _reference("llama")
            torch.save(ref.state_dict(), out / "weights.pt")
            (out / "ref.json").write_text(json.dumps({"loss": ref_loss}))
        # The load checks wait for nothing that fails: the timeout only bounds the meta step's
        # failure (asserted well within it).
        runs[world] = out, launch("meta", world, out, script=__file__, timeout=60.0,
                                  deadline=290.0, preload=HF_MODULES)
    return runs[world]


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 4])
def test_meta_init_is_layout_independent(
    runs: dict[int, tuple[Path, list[Ended]]], tmp_path_factory: pytest.TempPathFactory,
    stages: int,
) -> None:
    out, ended = _launched(runs, stages, tmp_path_factory)
    assert all("worker init: every check ran" in e.output for e in ended), dump(ended)
    if stages == 4:
        assert all(e.returncode == 0 for e in ended), dump(ended)
    found = [json.loads((out / f"init{r}.json").read_text()) for r in range(stages)]
    for name in found[0]:
        assert found[0][name]["loss"] == pytest.approx(found[0][name]["ref"], abs=1e-10)
        # Each process holds its share, not the model: the shares add up to about the whole.
        shares = [f[name]["own"] for f in found]
        assert max(shares) < found[0][name]["total"]


@pytest.mark.slow
def test_meta_unset_then_loaded_weights(
    runs: dict[int, tuple[Path, list[Ended]]], tmp_path_factory: pytest.TempPathFactory,
) -> None:
    tmp_path, ended = _launched(runs, 2, tmp_path_factory)
    all_ok(ended, "load")
    ref_loss = json.loads((tmp_path / "ref.json").read_text())["loss"]
    for e in ended:
        line = next(t for t in e.output.splitlines() if t.startswith("step failed after"))
        assert float(line.split()[3]) < 30.0, line  # well within the 60 s timeout
        assert "model.embed_tokens.weight" in line or "lm_head.weight" in line, line
        assert "init_fn=" in line, line
    for rank in range(2):
        loss = json.loads((tmp_path / f"load{rank}.json").read_text())["loss"]
        assert loss == pytest.approx(ref_loss, abs=1e-10)


if __name__ == "__main__":
    WORKERS[sys.argv[1]](Path(sys.argv[2]))
