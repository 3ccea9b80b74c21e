"""`meta_init()`: build a model with its parameters on the meta device and its buffers real,
as Hugging Face accelerate's ``init_empty_weights(include_buffers=False)`` does. A big model
then costs no memory until the Pipeline materialises each process's own stages (``init_fn=``
or a loaded state dict), while buffers computed in ``__init__`` (a rotary table, a causal mask)
keep the values the model's code gave them, so they need no initialiser of their own."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

_LOCK = threading.Lock()  # the patch is process-wide: one meta_init at a time


@contextmanager
def meta_init() -> Iterator[None]:
    """Within the block, every parameter registered on a module is moved to the meta device
    (keeping its class and requires_grad); buffers and plain tensors stay where they are made.

    Example::

        with pipeline.meta_init():
            model = MyTransformer(config)          # parameters on meta, buffers real
        pipe = Pipeline(model, stages=4, init_fn="reset_parameters")
    """
    if not _LOCK.acquire(blocking=False):
        raise RuntimeError("meta_init() blocks do not nest; build the model in one block")
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            moved = param.to("meta")
            module._parameters[name] = type(param)(moved, requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
        _LOCK.release()
