"""`Pipeline(compile=...)`: the checked torch.compile settings (`CompileOptions`) and how a
graph is compiled with them.

The graphs compiled here are AOTAutograd's (ATen, functional, one per region and direction)
and each is run only for the input signature it was built for (the runner keys its artefacts
by it). With inductor they are therefore compiled by `torch._inductor.standalone_compile`,
not through torch.compile's frame evaluation: a call then skips Dynamo's guard checks, which
cost about a third of a small block's compiled call, paid per region, microbatch and
direction. Other backends, `dynamic=True` and CUDA-graph modes go through torch.compile."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

_KEYS = ("mode", "backend", "dynamic", "fullgraph", "options")


@dataclass(frozen=True)
class CompileOptions:
    """What `torch.compile` gets for every compiled graph of the stages."""

    backend: str | Callable[..., Any] = "inductor"
    mode: str | None = None
    dynamic: bool | None = None
    fullgraph: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)

    def compile(self, gm: Callable[..., Any]) -> Callable[..., Any]:
        """`gm` compiled (lazily, on its first call, as torch.compile does)."""
        patches = self._inductor_patches()
        if patches is not None and isinstance(gm, torch.fx.GraphModule):
            return _Standalone(gm, patches)
        return torch.compile(
            gm, backend=self.backend, mode=self.mode, dynamic=self.dynamic,
            fullgraph=self.fullgraph, options=dict(self.options) or None,
        )

    def without_gil(self) -> CompileOptions:
        """For stages run by threads of one process on CPU: inductor's C++ wrapper, which runs
        a whole compiled graph without holding the GIL (the default Python wrapper calls each
        fused C++ kernel holding it, so the ranks' threads queue on it). Unchanged where the
        settings name `cpp_wrapper` or a mode, or the backend is not inductor."""
        if self.backend != "inductor" or self.mode is not None or "cpp_wrapper" in self.options:
            return self
        return dataclasses.replace(self, options={**self.options, "cpp_wrapper": True})

    def decompositions(self) -> dict[Any, Callable[..., Any]] | None:
        """What the joint trace decomposes: inductor's table (as torch.compile traces for
        it), else nothing (a backend gets the ATen ops the stage holds)."""
        if self.backend != "inductor":
            return None
        from torch._inductor.decomposition import select_decomp_table

        return select_decomp_table()

    def _inductor_patches(self) -> dict[str, Any] | None:
        """Inductor's settings for a standalone compile (the mode's and `options`), or None
        where torch.compile must do it: another backend, dynamic shapes, CUDA graphs."""
        if self.backend != "inductor" or self.dynamic:
            return None
        import torch._inductor  # here, not at the top: it costs a second a process to import

        patches = dict(torch._inductor.list_mode_options(self.mode)) if self.mode else {}
        patches.update(self.options)
        if patches.get("triton.cudagraphs"):
            return None
        return patches

    def key(self) -> tuple[Any, ...]:
        """What distinguishes two settings' artefacts."""
        backend = self.backend if isinstance(self.backend, str) else id(self.backend)
        return (backend, self.mode, self.dynamic, self.fullgraph,
                tuple(sorted(self.options.items())))


def compile_options(value: object) -> CompileOptions | None:
    """`Pipeline(compile=...)` checked: False/None (eager), True (torch.compile's defaults) or
    a dict of torch.compile arguments (mode, backend, dynamic, fullgraph, options)."""
    if value is None or value is False:
        return None
    if value is True:
        return CompileOptions()
    if not isinstance(value, Mapping):
        raise TypeError(
            f"compile must be True, False or a dict of torch.compile arguments "
            f"({', '.join(_KEYS)}), got {value!r} ({type(value).__name__})"
        )
    unknown = sorted(set(map(str, value)) - set(_KEYS))
    if unknown:
        raise ValueError(
            f"compile got unknown torch.compile argument(s) {unknown}; use {', '.join(_KEYS)}"
        )
    if value.get("mode") is not None and value.get("options"):
        raise ValueError(
            "compile: give either mode or options (torch.compile takes one of them), not both"
        )
    backend = value.get("backend", "inductor")
    if not (isinstance(backend, str) or callable(backend)):
        raise TypeError(f"compile backend must be a name or a callable, got {backend!r}")
    import torch._dynamo  # here, not at the top: it costs a second a process to import

    if isinstance(backend, str) and backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ValueError(
            f"compile backend {backend!r} is not a torch.compile backend; use one of "
            f"{torch._dynamo.list_backends()}"
        )
    mode = value.get("mode")
    if mode is not None and not isinstance(mode, str):
        raise TypeError(f"compile mode must be a string such as 'max-autotune', got {mode!r}")
    dynamic = value.get("dynamic")
    if dynamic not in (None, True, False):
        raise TypeError(f"compile dynamic must be None, True or False, got {dynamic!r}")
    fullgraph = value.get("fullgraph", False)
    if not isinstance(fullgraph, bool):
        raise TypeError(f"compile fullgraph must be True or False, got {fullgraph!r}")
    return CompileOptions(backend, mode, dynamic, fullgraph, dict(value.get("options") or {}))


_COMPILING = threading.Lock()  # inductor's settings are patched process-wide while compiling


class _Standalone:
    """An ATen graph compiled by inductor on its first call, for that call's signature."""

    def __init__(self, gm: torch.fx.GraphModule, patches: dict[str, Any]) -> None:
        self.gm = gm
        self.patches = patches
        self.run: Callable[..., Any] | None = None

    def __call__(self, *args: Tensor) -> Any:
        if self.run is None:
            import torch._inductor

            # standalone_compile also packs the graph for saving, which is not wanted here;
            # where that finds nothing new (a cache hit) it logs a warning: kept quiet.
            quiet = logging.getLogger("torch._inductor.standalone_compile")
            with _COMPILING:
                level = quiet.level
                quiet.setLevel(logging.ERROR)
                try:
                    self.run = torch._inductor.standalone_compile(
                        self.gm, list(args), dynamic_shapes="from_example_inputs",
                        options={"config_patches": self.patches},
                    )
                finally:
                    quiet.setLevel(level)
        return self.run(*args)
