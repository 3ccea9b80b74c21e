"""What crosses between processes at setup, as data and never as code: a value tree encoded as
JSON with its tensors' bytes appended (the safetensors idea), decoded only into the shapes it
knows. Nothing received from the c10d store or another rank is unpickled, so a value planted in
the store by a foreign client, or sent by a peer running other code, is refused with a clear
error instead of running.

Known shapes: None, bool, int, float, str, bytes, tuple, list, set, frozenset, dict, torch
tensors (meta ones as dtype + shape), dtypes, devices, torch.Size, pytree TreeSpecs (torch's
JSON form), enum members and dataclasses defined in hybridpipe's own packages (rebuilt through
their constructors, every field decoded by these same rules). Anything else is a TypeError when
sent and a `WireError` when received.

`gather_bytes` / `broadcast_bytes` / `gather_values` / `broadcast_value` move encoded values
with tensor collectives, replacing torch's object collectives (which unpickle what they get).
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import importlib
import json
import struct
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._pytree import TreeSpec, treespec_dumps, treespec_loads

_MAGIC = b"HPW1"
_OURS = ("pipeline.", "partitioner.", "scheduler.", "viz.")
_SCALARS = (type(None), bool, int, float, str)


class WireError(ValueError):
    """A received message is not a hybridpipe value (foreign, damaged or of an unknown shape)."""


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WireError(f"unknown dtype {name!r} in a received message")
    return dtype


class _Encoder:
    def __init__(self) -> None:
        self.blobs: list[bytes] = []
        self.size = 0

    def tensor(self, t: Tensor) -> dict[str, Any]:
        head = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        if t.is_meta:
            return {"$": "meta", **head}
        data = t.detach().to("cpu").contiguous().reshape(-1)
        raw = data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
        self.blobs.append(raw)
        self.size += len(raw)
        return {"$": "tensor", **head, "at": self.size - len(raw), "n": len(raw)}

    def value(self, obj: Any) -> Any:
        if isinstance(obj, enum.Enum):
            return {"$": "enum", "type": _qualified(type(obj)), "value": self.value(obj.value)}
        if isinstance(obj, _SCALARS):
            if isinstance(obj, float) and obj != obj:
                return {"$": "float", "v": "nan"}
            if isinstance(obj, float) and obj in (float("inf"), float("-inf")):
                return {"$": "float", "v": str(obj)}
            return obj
        if isinstance(obj, Tensor):
            return self.tensor(obj)
        if isinstance(obj, torch.Size):
            return {"$": "size", "v": list(obj)}
        if isinstance(obj, (list, tuple, set, frozenset)):
            kind = type(obj).__name__ if type(obj) in (list, tuple, set, frozenset) else "tuple"
            items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
            if kind == "list":
                return [self.value(v) for v in items]
            return {"$": kind, "v": [self.value(v) for v in items]}
        if isinstance(obj, dict):
            return {"$": "dict", "k": [self.value(k) for k in obj],
                    "v": [self.value(v) for v in obj.values()]}
        if isinstance(obj, bytes):
            return {"$": "bytes", "v": base64.b64encode(obj).decode("ascii")}
        if isinstance(obj, torch.dtype):
            return {"$": "dtype", "v": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"$": "device", "v": str(obj)}
        if isinstance(obj, TreeSpec):
            return {"$": "treespec", "v": treespec_dumps(obj)}
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return {"$": "record", "type": _qualified(type(obj)), "fields": {
                f.name: self.value(getattr(obj, f.name))
                for f in dataclasses.fields(obj) if f.init
            }}
        raise TypeError(
            f"a {type(obj).__module__}.{type(obj).__qualname__} cannot be sent between "
            "processes (only plain values, tensors and hybridpipe's own records travel)"
        )


def _qualified(cls: type) -> str:
    name = f"{cls.__module__}:{cls.__qualname__}"
    if not cls.__module__.startswith(_OURS):
        raise TypeError(f"{name} is not one of hybridpipe's own types and cannot be sent")
    return name


def _our_type(name: str) -> type:
    module, _, qualname = name.partition(":")
    if not module.startswith(_OURS) or not qualname:
        raise WireError(f"a received message names the type {name!r}, which is not hybridpipe's")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        raise WireError(f"a received message names the unknown type {name!r}") from None
    if not isinstance(obj, type):
        raise WireError(f"a received message names {name!r}, which is not a type")
    return obj


class _Decoder:
    def __init__(self, data: memoryview) -> None:
        self.data = data

    def tensor(self, node: dict[str, Any]) -> Tensor:
        dtype, shape = _dtype(node["dtype"]), [int(s) for s in node["shape"]]
        if node["$"] == "meta":
            return torch.empty(shape, dtype=dtype, device="meta")
        at, n = int(node["at"]), int(node["n"])
        if at < 0 or at + n > len(self.data):
            raise WireError("a received message is damaged: a tensor points past its end")
        flat = torch.frombuffer(bytearray(self.data[at:at + n]), dtype=torch.uint8) if n else (
            torch.empty(0, dtype=torch.uint8))
        return flat.view(dtype).reshape(shape)

    def value(self, node: Any) -> Any:
        if isinstance(node, _SCALARS):
            return node
        if isinstance(node, list):
            return [self.value(v) for v in node]
        if not isinstance(node, dict) or not isinstance(node.get("$"), str):
            raise WireError(f"a received message holds an unknown value shape: {node!r:.80}")
        kind = node["$"]
        if kind in ("tensor", "meta"):
            return self.tensor(node)
        if kind in ("tuple", "set", "frozenset"):
            return {"tuple": tuple, "set": set, "frozenset": frozenset}[kind](
                self.value(v) for v in node["v"])
        if kind == "dict":
            return dict(zip((self.value(k) for k in node["k"]),
                            (self.value(v) for v in node["v"]), strict=True))
        simple: dict[str, Callable[[Any], Any]] = {
            "float": float, "size": lambda v: torch.Size(int(s) for s in v),
            "bytes": base64.b64decode, "dtype": _dtype, "device": torch.device,
            "treespec": treespec_loads,
        }
        if kind in simple:
            return simple[kind](node["v"])
        if kind == "enum":
            cls = _our_type(node["type"])
            if not issubclass(cls, enum.Enum):
                raise WireError(f"{node['type']!r} in a received message is not an enum")
            return cls(self.value(node["value"]))
        if kind == "record":
            cls = _our_type(node["type"])
            if not dataclasses.is_dataclass(cls):
                raise WireError(f"{node['type']!r} in a received message is not a record")
            return cls(**{k: self.value(v) for k, v in node["fields"].items()})
        raise WireError(f"a received message holds an unknown value kind {kind!r}")


def dumps(obj: Any) -> bytes:
    """`obj` as bytes: magic, JSON length, JSON, then the tensors' bytes."""
    enc = _Encoder()
    head = json.dumps(enc.value(obj), separators=(",", ":")).encode()
    return b"".join([_MAGIC, struct.pack("<Q", len(head)), head, *enc.blobs])


def loads(data: bytes | bytearray | memoryview) -> Any:
    """The value `dumps` encoded; a `WireError` for anything else (never runs code)."""
    view = memoryview(data)
    if len(view) < 12 or bytes(view[:4]) != _MAGIC:
        raise WireError(
            "a received message is not a hybridpipe value (no hybridpipe header): something "
            "other than this job wrote to its store or sent to its ranks; refused unread"
        )
    (length,) = struct.unpack("<Q", view[4:12])
    try:
        tree = json.loads(bytes(view[12:12 + length]))
        return _Decoder(view[12 + length:]).value(tree)
    except WireError:
        raise
    except (ValueError, TypeError, KeyError, RuntimeError) as err:
        raise WireError(f"a received hybridpipe message is damaged or of an unknown shape: "
                        f"{err}") from None


# -- tensor collectives carrying encoded values -------------------------------------------------


def _as_tensor(data: bytes) -> Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(
        0, dtype=torch.uint8)


def gather_bytes(data: bytes, dst: int = 0, group: Any = None) -> list[bytes] | None:
    """Every process's `data` on global rank `dst` (in group rank order), None elsewhere."""
    size = torch.tensor([len(data)], dtype=torch.int64)
    n = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = _as_tensor(data)
    is_dst = dist.get_rank() == dst
    bins = [torch.empty(longest, dtype=torch.uint8) for _ in range(n)] if is_dst else None
    dist.gather(mine, bins, dst=dst, group=group)
    if bins is None:
        return None
    return [b[: int(s)].numpy().tobytes() for b, s in zip(bins, sizes, strict=True)]


def broadcast_bytes(data: bytes | None, src: int = 0, group: Any = None) -> bytes:
    """Global rank `src`'s `data` on every process."""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buf = _as_tensor(data) if dist.get_rank() == src and data else torch.empty(
        int(size), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return buf.numpy().tobytes()


def gather_values(obj: Any, dst: int = 0, group: Any = None) -> list[Any] | None:
    """`torch.distributed.gather_object` without pickle: decoded values on `dst`."""
    got = gather_bytes(dumps(obj), dst=dst, group=group)
    return None if got is None else [loads(b) for b in got]


def broadcast_value(obj: Any, src: int = 0, group: Any = None) -> Any:
    """`torch.distributed.broadcast_object_list` of one value without pickle."""
    return loads(broadcast_bytes(dumps(obj) if dist.get_rank() == src else None, src, group))
