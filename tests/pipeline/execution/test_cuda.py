"""CUDA paths: the stream layer and the local executor on GPU devices. These need a CUDA device
and are skipped without one (CI has none); every other test covers the same code on CPU, where
the stream layer is a no-op. On a one-GPU machine all ranks share cuda:0, which still exercises
the per-rank streams, events and copies."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from pipeline import Pipeline
from pipeline.app.models import GPT, SkipNet
from pipeline.execution import streams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ATOL = 1e-10


def test_stream_layer_orders_work_across_streams() -> None:
    device = torch.device("cuda:0")
    producer, consumer = streams.new_stream(device), streams.new_stream(device)
    assert isinstance(producer, torch.cuda.Stream)
    with streams.use_stream(producer):
        x = torch.ones(1 << 20, device=device)
        for _ in range(20):
            x = x * 1.0001
        event = streams.record_event(producer)
    streams.wait_event(consumer, event)
    with streams.use_stream(consumer):
        streams.record_stream(x, consumer)
        y = x.sum()
    torch.cuda.synchronize()
    expected = torch.full((1 << 20,), 1.0001**20, device=device).sum()
    torch.testing.assert_close(y, expected)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved-1f1b", "zbv"])
def test_local_executor_on_cuda_matches_cpu(schedule: str) -> None:
    torch.manual_seed(0)
    model = SkipNet(dim=16, blocks=6).double()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16, dtype=torch.float64)
    y = torch.randint(0, 10, (8,))
    pipe = Pipeline(
        model.cuda(),
        stages=2,
        schedule=schedule,
        microbatches=4,
        loss_fn=F.cross_entropy,
        balance="uniform",
        devices=["cuda:0", "cuda:0"],
    )
    loss = pipe.step(x.cuda(), y.cuda())
    ref_loss = sum(
        F.cross_entropy(reference(xm), ym) * len(xm) / len(x)
        for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True)
    )
    ref_loss.backward()
    torch.testing.assert_close(loss.cpu(), ref_loss.detach(), atol=ATOL, rtol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("policy", ["full", "selective", "offload", "auto"])
def test_activation_policies_on_cuda(policy: str) -> None:
    """Every activation policy on CUDA trains exactly as the unsplit model (float64, a split
    backward); "offload" keeps nothing on the device (saved tensors in pinned host memory),
    and "auto" under a limit prices the copies at the measured bandwidth."""
    torch.manual_seed(0)
    model = GPT(vocab=32, dim=16, layers=4, heads=2, max_seq=8).double().cuda()
    reference = copy.deepcopy(model)
    x, y = torch.randint(0, 32, (8, 6)).cuda(), torch.randint(0, 32, (8, 6)).cuda()

    def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.size(-1)), target.reshape(-1))

    pipe = Pipeline(model, stages=2, schedule="zb-h1", microbatches=4, loss_fn=lm_loss,
                    devices=["cuda:0", "cuda:0"], example_input=x,
                    checkpoint_activations=policy,
                    memory_limit=1e12 if policy == "auto" else None)
    meters = pipe.count_saved_activations()
    loss = pipe.step(x, y)
    ref_loss = sum(lm_loss(reference(xm), ym) * len(xm) / len(x)
                   for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True))
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), atol=ATOL, rtol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=0, msg=name)
    if policy == "offload":
        assert all(m.peak == 0 for m in meters.values())
    if policy == "auto":
        units = pipe.captured.costs
        assert all(units[v].policies is not None and units[v].policies.offload_time is not None
                   for v in pipe.captured.order)


def test_offload_copies_on_a_side_stream_and_frees_the_device() -> None:
    """The offload hooks on CUDA: after a transformer block's forward the device holds its
    output, not its saved tensors (they went to pinned host memory on the side stream, and
    the allocator freed them once the copies were done); they come back for an exact
    backward (float64, bit for bit)."""
    from contextlib import AbstractContextManager, nullcontext

    from pipeline.app.models import TransformerBlock
    from pipeline.execution.activations.offload import Offloader

    device = torch.device("cuda:0")
    torch.manual_seed(0)
    block = TransformerBlock(64, 4).double().to(device)
    x = torch.randn(4, 32, 64, dtype=torch.float64, device=device)

    def run(hooks: AbstractContextManager[object]) -> tuple[int, list[torch.Tensor]]:
        leaf = x.clone().requires_grad_()
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        with hooks:
            out = block(leaf.clone())
        torch.cuda.synchronize(device)
        torch.empty(1, device=device)  # the allocator frees blocks whose copies are done
        held = torch.cuda.memory_allocated(device) - before
        return held, list(torch.autograd.grad(out.sum(), [leaf, *block.parameters()]))

    none_held, want = run(nullcontext())
    offloader = Offloader(device)
    assert offloader.stream != torch.cuda.current_stream(device)
    held, got = run(offloader.hooks())
    assert offloader.copied > 0
    assert held <= 0.25 * none_held, (held, none_held)
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, atol=0, rtol=0)


# -- mixed precision and capture-on-CPU-then-run-on-CUDA (scripts/gpu_check.sh runs these) -------


def _gap(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max((got[k].cpu() - w.cpu()).abs().max().item() for k, w in want.items())


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.detach().cpu().clone() for k, p in model.named_parameters()
            if p.grad is not None}


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_bf16_on_cuda_matches_unsplit_autocast(schedule: str) -> None:
    """Stages on CUDA streams under bf16 autocast: the grads equal the unsplit model's under
    torch.autocast("cuda") (cuBLAS may pick other algorithms per stream, so "equal" is: at
    most a tenth of the distance between the bf16 and the fp32 runs) and the loss to 1e-3."""
    from tests.support.precision import M, float_batch, mse, reference, res_model

    model = res_model().cuda()
    x, y = (t.cuda() for t in float_batch())
    fp32 = reference(model, x, y, None)[1]  # no autocast
    ref = copy.deepcopy(model)
    want_loss = 0.0
    for xm, ym in zip(x.tensor_split(M), y.tensor_split(M), strict=True):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = ref(xm)
        part = mse(out.float(), ym) * (len(ym) / len(y))
        part.backward()
        want_loss += part.item()
    bf16 = _grads(ref)
    pipe = Pipeline(model, stages=2, schedule=schedule, microbatches=M, loss_fn=mse,
                    balance="uniform", devices=["cuda:0", "cuda:0"],
                    mixed_precision=torch.bfloat16)
    loss = pipe.step(x, y)
    assert abs(loss.item() - want_loss) <= 1e-3 * abs(want_loss), (loss.item(), want_loss)
    got = _grads(model)
    assert _gap(got, bf16) <= 0.1 * _gap(fp32, bf16), (_gap(got, bf16), _gap(fp32, bf16))
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_fp16_scaling_on_cuda_follows_grad_scaler() -> None:
    from tests.support.precision import M, float_batch, mlp_model, mse

    model = mlp_model().cuda()
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, stages=2, microbatches=M, loss_fn=mse, balance="uniform",
                    devices=["cuda:0", "cuda:0"], mixed_precision=torch.float16)
    assert pipe.scaler is not None
    pipe.scaler.load_state_dict({"scale": 2.0**40, "_growth_tracker": 0, "growth_interval": 2})
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**40, growth_interval=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(12):
        x, y = (t.cuda() for t in float_batch(step))
        pipe.step(x, y)
        pipe.optimizer_step(opt)
        opt.zero_grad()
        for xm, ym in zip(x.tensor_split(M), y.tensor_split(M), strict=True):
            with torch.autocast("cuda", dtype=torch.float16):
                out = ref(xm)
            scaler.scale(mse(out.float(), ym) * (len(ym) / len(y))).backward()
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()
        assert pipe.scaler.get_scale() == scaler.get_scale(), f"step {step}"
    assert pipe.scaler.get_scale() < 2.0**40
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-3, rtol=1e-3)


def test_llama_captured_on_cpu_runs_on_cuda() -> None:
    """Captured on CPU, split, moved to CUDA: every device the graph names follows its stage
    (Llama's rotary `aten.to` names its device positionally), exact in float64."""
    from tests.support.real_models import SPECS, build

    model = build("llama")  # float64, on CPU
    reference = copy.deepcopy(model).cuda()
    spec = SPECS["llama"]
    torch.manual_seed(1)
    x, y = spec.batch(4, 8)
    pipe = Pipeline(model, stages=2, microbatches=2, loss_fn=spec.loss_fn,
                    balance="parameters", devices=["cuda:0", "cuda:0"])
    loss = pipe.step(x, y)
    want = sum(
        spec.loss_fn(reference(**{k: v[i * 2:(i + 1) * 2].cuda() for k, v in x.items()}),
                     y[i * 2:(i + 1) * 2].cuda()) * 0.5
        for i in range(2)
    )
    assert isinstance(want, torch.Tensor)
    want.backward()
    torch.testing.assert_close(loss.cpu(), want.detach().cpu(), atol=ATOL, rtol=0)
    got, expected = _grads(model), _grads(reference)
    assert sorted(got) == sorted(expected)
    for k, g in got.items():
        torch.testing.assert_close(g, expected[k], atol=ATOL, rtol=0, msg=k)


class _DeviceAutocast(torch.nn.Module):
    """An autocast block named by its input's device type (as Hugging Face code does)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            h = torch.relu(self.b(h))
        return self.c(h.float())


class _NoBlock(_DeviceAutocast):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def test_autocast_block_captured_on_cpu_runs_under_cuda_autocast() -> None:
    """The block captured on CPU names "cpu"; moved with its stage it must run under CUDA
    autocast: the grads are close to the CUDA reference's (a tenth of the distance to the run
    without the block, which is what a block left on "cpu" would give)."""
    from tests.support.precision import M, mse

    model = _DeviceAutocast()
    references = [copy.deepcopy(model).cuda(), _NoBlock().cuda()]
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    pipe = Pipeline(model, stages=2, microbatches=M, loss_fn=mse, balance="uniform",
                    devices=["cuda:0", "cuda:0"])
    pipe.step(x, y)  # captured on CPU, run on CUDA
    for ref in references:
        for xm, ym in zip(x.cuda().tensor_split(M), y.cuda().tensor_split(M), strict=True):
            (mse(ref(xm), ym) * (len(ym) / len(y))).backward()
    want, without = (_grads(ref) for ref in references)
    got = _grads(model)
    assert _gap(got, want) <= 0.1 * _gap(without, want), (_gap(got, want), _gap(without, want))
