"""Autocast regions inside a model's forward, as capture meets them: torch.export records each
``with torch.autocast(...)`` block as a ``wrap_with_autocast`` higher-order op (kept whole in
the flat graph, so it runs as written); torch.fx traces straight through such a block and would
drop it, so `AutocastSpy` notices the blocks an fx trace enters and `dropped` turns
them into a clear error instead of a silently different model."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import PreDispatchTorchFunctionMode
from torch.overrides import TorchFunctionMode

WRAP_WITH_AUTOCAST = torch.ops.higher_order.wrap_with_autocast


class AutocastSpy(PreDispatchTorchFunctionMode):
    """A torch-function mode, active around an fx trace, that records the autocast blocks the
    traced code enters: ``torch.autocast.__enter__`` reports itself (``torch.amp.
    _enter_autocast``) only to a pre-dispatch mode, which is why this is one. Every other
    function passes through unchanged. `regions`: (device type, dtype, enabled) each."""

    def __init__(self) -> None:
        TorchFunctionMode.__init__(self)  # no tracer: this mode records, it builds nothing
        self.regions: list[tuple[str, torch.dtype | None, bool]] = []
        self.active_at_start = {
            t for t in ("cpu", "cuda") if torch.is_autocast_enabled(t)
        }

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func is torch.amp._enter_autocast:
            device, dtype, enabled = args[0], args[1], bool(args[2])
            self.regions.append((str(device), dtype, enabled))
            return None
        if func is torch.amp._exit_autocast:
            return None
        return func(*args, **(kwargs or {}))

    def dropped(self, model_name: str) -> str | None:
        """Why the fx graph is wrong, when it lost a block: one that turns autocast on, or off
        while the capture runs under autocast (mixed_precision=); else None."""
        dropped = [
            r for r in self.regions if r[2] or r[0] in self.active_at_start
        ]
        if not dropped:
            return None
        shown = ", ".join(
            f'torch.autocast("{d}", dtype={t}, enabled={e})' for d, t, e in dropped
        )
        return (
            f"{model_name}'s forward enters {shown}; torch.fx cannot record an autocast block "
            "(the traced graph would run it in the surrounding precision, silently). Capture "
            "with torch.export instead (capture_method='export', which keeps the block), keep "
            "the module that enters it whole with leaf_modules=(ThatModule,), or remove the "
            "block and build the Pipeline with mixed_precision=torch.bfloat16 (or float16)"
        )


def retarget_autocast(node: fx.Node, device: torch.device) -> bool:
    """Point an exported autocast block captured on another device type (Hugging Face models
    name the device type of their inputs) at `device`'s type; returns whether it changed."""
    if node.target is not WRAP_WITH_AUTOCAST or not node.args or node.args[0] == device.type:
        return False
    node.update_arg(0, device.type)
    return True
