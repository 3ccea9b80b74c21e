"""What a checkpoint's ``extra`` may hold: values that load back with
``torch.load(weights_only=True)``, and a TypeError naming the first one that does not."""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from typing import Any

import torch


def _loads_back(value: Any) -> bool:
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:
        return False
    return True


def _first_unloadable(value: Any, where: str) -> tuple[str, Any]:
    """The path and value of the first leaf of `value` that does not load back."""
    if isinstance(value, Mapping):
        items: Iterable[tuple[str, Any]] = ((f"{where}[{k!r}]", v) for k, v in value.items())
    elif isinstance(value, (list, tuple, set)):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(value))
    else:
        return where, value
    for path, item in items:
        if not _loads_back(item):
            return _first_unloadable(item, path)
    return where, value


def check_extra(extra: Any) -> None:
    """TypeError (naming the value and the fix) unless `extra` loads back from a checkpoint,
    which is read with ``torch.load(weights_only=True)``: numbers, strings, bytes, None,
    lists, tuples, sets, dicts, tensors, dtypes (and types allowed with
    ``torch.serialization.add_safe_globals``)."""
    if _loads_back(extra):
        return
    where, value = _first_unloadable(extra, "extra")
    name = f"{type(value).__module__}.{type(value).__qualname__}"
    raise TypeError(
        f"{where} is a {name} ({_short_repr(value)}), which a checkpoint cannot load back (it "
        "is read with torch.load(weights_only=True)); convert it to plain data first: "
        "float(x) / int(x) for numpy scalars, torch.from_numpy(a) or a.tolist() for arrays "
        "(np.random.get_state() holds one), str(path) for a Path, vars(namespace) for an "
        "argparse Namespace, dataclasses.asdict(obj) for a dataclass; or allow the type with "
        "torch.serialization.add_safe_globals([...])"
    )


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
