#!/usr/bin/env bash
# One prepared check for a machine with CUDA GPUs (at most 13.5 minutes: the per-check limits
# below add up to 810 s). It runs tests/pipeline/execution/test_cuda.py (the stream layer; the
# local executor on CUDA streams for four schedules; bf16 and fp16 mixed precision on CUDA
# against the unsplit model under torch.autocast("cuda") and torch.amp.GradScaler; Llama captured on CPU then run
# on CUDA, exact in float64; every activation policy on CUDA (offload keeping nothing on the
# device; its copies on a side stream, the device memory freed, the backward bit-exact); an autocast block captured on CPU that must run under CUDA
# autocast), compiled stages on CUDA (tests/pipeline/execution/test_compile.py -m cuda: inductor
# with mode="max-autotune-no-cudagraphs", 1F1B and ZB-H1 against the eager pipeline), the CPU
# mixed-precision tests, a short bf16-vs-fp32 step timing on the GPU and the activation-policy
# benchmark on CUDA (benchmarks/bench_activations.py with BENCH_DEVICE=cuda, 2 rounds),
# tensor parallelism over NCCL (scripts/tp_device_check.py under torchrun, one process per GPU:
# GPT-2 at tp=2, pp=2 x tp=2 with 4 GPUs, fp32 and bf16 autocast against the unsplit model),
# then prints a summary. Exits non-zero when a check fails, times out or is skipped (a skipped
# CUDA test means no CUDA). The tensor-parallel check needs 2 GPUs (NCCL refuses two ranks on
# one device): with fewer it is listed as NOT RUN in the summary, counted neither as a pass
# nor as a failure (the exit status stays 0 if everything else passed, and the last line
# names what did not run). Needs no network: it uses $PYTHON, else .venv/bin/python, else
# python3, with torch (and transformers, for Llama) already installed.
# Run: bash scripts/gpu_check.sh      (logs in $GPU_CHECK_LOGS, default a temporary folder)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
LOGS="${GPU_CHECK_LOGS:-$(mktemp -d -t gpu_check.XXXXXX)}"
mkdir -p "$LOGS"
NAMES=()
VERDICTS=()
SECONDS_TAKEN=()
FAILED=0

# check NAME LIMIT_SECONDS COMMAND...: run COMMAND under a time limit, keep its log, show its
# tail and record PASS / FAIL / TIMEOUT (a log reporting skipped tests counts as FAIL).
check() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS rc verdict=PASS
  echo "== $name (limit ${limit} s)"
  timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  tail -n 20 "$LOGS/$name.log"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    verdict="TIMEOUT"
  elif [ "$rc" -ne 0 ]; then
    verdict="FAIL (exit $rc)"
  elif grep -qE "[0-9]+ skipped" "$LOGS/$name.log"; then
    verdict="FAIL (tests skipped)"
  fi
  if [ "$verdict" != PASS ]; then
    FAILED=1
  fi
  NAMES+=("$name")
  VERDICTS+=("$verdict")
  SECONDS_TAKEN+=("$((SECONDS - start))")
}

check environment 60 "$PY" - <<'PYEOF'
import torch

print("torch", torch.__version__, "CUDA", torch.version.cuda)
if not torch.cuda.is_available():
    raise SystemExit("no CUDA device visible to torch")
print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
print("bf16 supported", torch.cuda.is_bf16_supported())
try:
    import transformers
    print("transformers", transformers.__version__)
except ImportError:
    print("transformers missing: the Llama check will fail")
PYEOF

check cuda-tests 200 "$PY" -m pytest -q -rs -p no:cacheprovider tests/pipeline/execution/test_cuda.py

check compile-cuda 190 "$PY" -m pytest -q -rs -p no:cacheprovider -m cuda \
  tests/pipeline/execution/test_compile.py

check precision-cpu 90 "$PY" -m pytest -q -rs -p no:cacheprovider -m "not slow" \
  tests/pipeline/execution/test_precision.py

check bf16-timing 50 "$PY" - <<'PYEOF'
"""bf16 against fp32 on CUDA, two ranks on one GPU (informational timing; checks finite
losses and that bf16 moves bf16 tensors between the stages of an MLP stack)."""
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F

from pipeline import Pipeline

torch.manual_seed(0)
x, y = torch.randn(64, 256, 1024, device="cuda"), torch.randn(64, 256, 1024, device="cuda")
times = {}
for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
    layers = []
    for _ in range(8):
        layers += [nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024), nn.GELU()]
    model = nn.Sequential(*layers).cuda()
    pipe = Pipeline(model, stages=2, microbatches=8, loss_fn=F.mse_loss, balance="parameters",
                    devices=["cuda:0", "cuda:0"], mixed_precision=dtype)
    crossing = []
    pipe.step(x, y)
    pipe.stage_modules[0].register_forward_hook(
        lambda _m, _i, out: crossing.extend(t.dtype for t in out))
    samples = []
    for _ in range(5):
        pipe.zero_grad()
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = pipe.step(x, y)
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
        assert torch.isfinite(loss), loss
    times[name] = statistics.median(samples)
    print(f"{name}: median step {times[name] * 1e3:.1f} ms, stage 0 sends {set(crossing)}")
    assert set(crossing) == ({torch.float32} if dtype is None else {torch.bfloat16}), crossing
print(f"bf16 / fp32 step time: {times['bf16'] / times['fp32']:.2f}")
PYEOF

# Activation policies on CUDA (benchmarks/bench_activations.py, 2 rounds): per-rank held bytes
# predicted vs counted, the allocator's peak, step times; offload really moves to pinned host
# memory here. The tables land in $LOGS/activations_cuda.md.
check activations-cuda 130 env BENCH_DEVICE=cuda BENCH_ROUNDS=2 "$PY" benchmarks/bench_activations.py
cp benchmarks/results/activations_cuda.md "$LOGS/" 2>/dev/null

# Tensor parallelism over NCCL: one process per GPU (cuda:LOCAL_RANK), 2 or 4 of them.
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
NOT_RUN=()
if [ "${GPUS:-0}" -ge 2 ]; then
  if [ "$GPUS" -ge 4 ]; then RANKS=4; else RANKS=2; fi
  check tp-nccl 90 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$RANKS" \
    scripts/tp_device_check.py --device cuda
else
  echo "== tp-nccl"
  echo "NOT RUN: tensor parallelism over NCCL needs 2 GPUs, this machine has ${GPUS:-0}"
  NAMES+=("tp-nccl")
  VERDICTS+=("NOT RUN (needs 2 GPUs)")
  SECONDS_TAKEN+=(0)
  NOT_RUN+=("tp-nccl")
fi

echo
echo "== summary (logs in $LOGS)"
for i in "${!NAMES[@]}"; do
  printf '%-16s %-24s %5s s\n' "${NAMES[$i]}" "${VERDICTS[$i]}" "${SECONDS_TAKEN[$i]}"
done
if [ "$FAILED" -eq 0 ] && [ "${#NOT_RUN[@]}" -gt 0 ]; then
  echo "gpu_check: every check that ran passed; NOT RUN: ${NOT_RUN[*]}"
elif [ "$FAILED" -eq 0 ]; then
  echo "gpu_check: every check passed"
else
  echo "gpu_check: some checks failed (see their logs above)${NOT_RUN[*]:+; NOT RUN: ${NOT_RUN[*]}}"
fi
exit "$FAILED"
