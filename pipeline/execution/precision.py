"""Mixed precision for a pipeline: `Precision` runs each stage's forward (and its recomputation
under activation checkpointing) under ``torch.autocast`` for the stage's device, hands the last
stage's output to the loss in fp32, and refuses a caller's own autocast that the stages would
not apply. Parameters and their ``.grad`` stay in their own dtype (fp32 master weights); the
tensors crossing stages keep the dtype autocast gave them. fp16 loss scaling lives in
pipeline.execution.loss_scale.

Autocast is thread-local, so a caller's ``with torch.autocast(...)`` around ``pipe.step``
reaches the stages in one executor and not in the other (worker threads); instead the policy
is the Pipeline's ``mixed_precision=`` and a caller's autocast must agree with it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map_only

from pipeline.execution.loss_scale import LossScaler, Stepper

log = logging.getLogger("hybridpipe")
DTYPES = (torch.bfloat16, torch.float16)
_LOW = frozenset(DTYPES)


def check_mixed_precision(value: object) -> torch.dtype | None:
    """`value` as the autocast dtype of a Pipeline (None: full precision)."""
    if value is None or value in DTYPES:
        return value
    if value == torch.float32:
        raise ValueError(
            "mixed_precision=torch.float32 is full precision: pass mixed_precision=None "
            "(the default), or torch.bfloat16 / torch.float16"
        )
    raise TypeError(
        f"mixed_precision must be torch.bfloat16, torch.float16 or None, got {value!r}; "
        "the parameters stay fp32 and each stage's forward runs under torch.autocast"
    )


def _device_types(extra: Iterable[str] = ()) -> list[str]:
    """Device types whose autocast state matters here (cuda only where it exists)."""
    types = ["cpu", *(["cuda"] if torch.cuda.is_available() else []), *extra]
    return list(dict.fromkeys(types))


def caller_autocast(device_types: Iterable[str] = ()) -> dict[str, torch.dtype]:
    """The device types on which the calling thread has autocast enabled, and its dtype."""
    return {
        t: torch.get_autocast_dtype(t)
        for t in _device_types(device_types)
        if torch.is_autocast_enabled(t)
    }


class Precision:
    """One Pipeline's precision policy: `dtype` (torch.bfloat16, torch.float16 or None) for
    every stage's forward. Shared by the planner's capture, both executors' runtimes and the
    facade; `scaler` (fp16 only) is the loss scaler whose scale seeds each step's backward."""

    def __init__(
        self, dtype: torch.dtype | None = None, scaler: LossScaler | None = None,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        self.dtype = check_mixed_precision(dtype)
        self.scaler = scaler
        self.reduce_dtype = reduce_dtype  # the data-parallel gradient average's (None: fp32)

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    def __repr__(self) -> str:
        return f"Precision({self.dtype})"

    def autocast(self, device: torch.device | str) -> AbstractContextManager[Any]:
        """Autocast for a stage on `device` (nothing in full precision)."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(torch.device(device).type, dtype=self.dtype)

    def planning(self, devices: Iterable[torch.device | str] = ()) -> AbstractContextManager[Any]:
        """Autocast for capture and profiling: on CPU (where capture runs), CUDA where it
        exists, and `devices`. Capturing under autocast records what a model enters only when
        autocast is on (Hugging Face's ``maybe_autocast`` regions that keep rotary embeddings
        in fp32) and gives the graph the dtypes its tensors will have."""
        stack = ExitStack()
        if self.dtype is not None:
            for t in _device_types(torch.device(d).type for d in devices):
                stack.enter_context(torch.autocast(t, dtype=self.dtype))
        return stack

    def stage(self, module: nn.Module, device: torch.device | str) -> Callable[..., Any]:
        """`module`'s forward under this policy's autocast: what the runtime calls, and what
        ``torch.utils.checkpoint`` recomputes (entering autocast itself, so the recomputation
        runs under the same policy whatever state the backward runs in)."""
        if self.dtype is None:
            return module
        device_type, dtype = torch.device(device).type, self.dtype

        def forward(*args: Any) -> Any:
            with torch.autocast(device_type, dtype=dtype):
                return module(*args)

        return forward

    def loss_input(self, output: Any) -> Any:
        """The model output as the loss sees it: bf16/fp16 tensors upcast to fp32, so the loss
        is computed in fp32 (the output the caller gets from ``pipe(x)`` is left as is)."""
        if self.dtype is None:
            return output
        return tree_map_only(Tensor, lambda t: t.float() if t.dtype in _LOW else t, output)

    def seed(self, loss: Tensor) -> Tensor | None:
        """The gradient the backward of `loss` starts from: None (1) or the loss scale."""
        if self.scaler is None:
            return None
        return self.scaler.seed(loss)

    def unscale_(self, grads: list[Tensor]) -> None:
        """After a step: its fresh gradients divided by the loss scale (fp16 only)."""
        if self.scaler is not None:
            self.scaler.unscale_(grads)

    def optimizer_step(
        self, optimizer: Stepper, any_rank: Callable[[Tensor], Tensor], *args: Any,
        **kwargs: Any,
    ) -> bool:
        """The optimizer's step, skipped everywhere after an inf/NaN anywhere (fp16)."""
        if not callable(getattr(optimizer, "step", None)):
            raise TypeError(
                f"optimizer_step needs an optimizer (with a step() method), got "
                f"{type(optimizer).__name__}; build one over pipe.parameters()"
            )
        if self.scaler is None:
            optimizer.step(*args, **kwargs)
            return True
        return self.scaler.optimizer_step(optimizer, any_rank, *args, **kwargs)

    @contextmanager
    def calling(self, what: str, device_types: Iterable[str] = ()) -> Iterator[None]:
        """Around `pipe.step` / `pipe(x)` in the caller's thread: a caller's autocast that
        the stages would not apply is refused (naming ``mixed_precision=``); one that agrees
        with this policy is switched off for the call, so that only the stages' own autocast
        applies, the same in both executors, and the loss stays fp32."""
        active = caller_autocast(device_types)
        wrong = {t: d for t, d in active.items() if d != self.dtype}
        if wrong:
            shown = ", ".join(f'torch.autocast("{t}", dtype={d})' for t, d in wrong.items())
            fix = (
                f"build the Pipeline with mixed_precision={wrong[next(iter(wrong))]} instead"
                if self.dtype is None
                else f"the Pipeline was built with mixed_precision={self.dtype}: drop the "
                "autocast, or make it agree"
            )
            raise ValueError(
                f"{what} was called under {shown}; autocast is thread-local and would not "
                f"reach the pipeline's stages the same way in every executor: {fix} (each "
                "stage's forward then runs under autocast, parameters and grads stay fp32)"
            )
        with ExitStack() as stack:
            for t in active:
                stack.enter_context(torch.autocast(t, enabled=False))
            yield


def warn_low_precision_parameters(model: nn.Module, dtype: torch.dtype | None) -> None:
    """A model cast to bf16/fp16 as a whole trains without fp32 master weights: its grads,
    optimizer state and gradient average are low precision too. Say so, once per Pipeline."""
    low = sorted({str(p.dtype) for p in model.parameters() if p.dtype in _LOW})
    if low:
        log.warning(
            "hybridpipe: the model's parameters are %s, so its gradients, optimizer state and "
            "data-parallel gradient average are too (no fp32 master weights)%s",
            " and ".join(low),
            "" if dtype is not None else "; keep the model in fp32 and pass "
            "mixed_precision=torch.bfloat16 (or float16) to Pipeline instead",
        )


def make_precision(
    dtype: object, reduce_dtype: object = None, shard: str | None = None
) -> Precision:
    """The policy for ``Pipeline(mixed_precision=dtype, reduce_dtype=...)``: fp16 gets a loss
    scaler (fp16's 5 exponent bits underflow small gradients; bf16 has fp32's range and needs
    none); `reduce_dtype` is the data-parallel gradient average's dtype (None: fp32)."""
    checked = check_mixed_precision(dtype)
    if reduce_dtype is not None and reduce_dtype not in DTYPES:
        raise TypeError(
            f"reduce_dtype must be torch.bfloat16, torch.float16 or None (the gradients' own "
            f"fp32), got {reduce_dtype!r}"
        )
    if reduce_dtype is not None and shard == "full":
        raise ValueError(
            f"reduce_dtype={reduce_dtype} sets the dtype of the data-parallel gradient average "
            "this pipeline makes, but with shard='full' FSDP2 reduce-scatters the gradients "
            "itself (in fp32): drop reduce_dtype, or use shard=None / 'optimizer'"
        )
    scaler = LossScaler() if checked == torch.float16 else None
    return Precision(checked, scaler, reduce_dtype)
