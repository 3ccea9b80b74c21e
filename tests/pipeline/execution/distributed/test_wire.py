"""What crosses between processes travels as data, never as pickle
(pipeline.execution.distributed.wire): values round-trip exactly, and a foreign or damaged
message is refused without running anything."""

from __future__ import annotations

import json
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_flatten

from partitioner import Plan
from pipeline.execution.distributed import wire
from pipeline.planning.costs import StageCosts
from pipeline.planning.settings import Setting
from scheduler import Op, build_schedule


def test_values_round_trip() -> None:
    _, spec = tree_flatten(((torch.ones(2),), {"mask": torch.zeros(1)}))
    value = {
        "none": None, "flags": (True, False), "n": 3, "x": 1.5, "inf": float("inf"),
        "text": "é", "raw": b"\x00\xff", "set": frozenset({1, 2}), 7: [1, (2, 3)],
        "t64": torch.arange(6, dtype=torch.float64).reshape(2, 3),
        "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "scalar": torch.tensor(3, dtype=torch.int64), "empty": torch.empty(0, 4),
        "meta": torch.empty(5, 2, device="meta"), "bool": torch.tensor([True, False]),
        "dtype": torch.float16, "device": torch.device("cpu"), "size": torch.Size([2, 3]),
        "spec": spec, "op": Op.W, "setting": Setting("a", ("b", "c")),
        "schedule": build_schedule("zb-h1", 2, 4),
        "costs": StageCosts([1.0], [2.0], [0.5], [10.0], [4.0]),
        "plan": Plan([["a"], ["b"]], [1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [0.0, 0.0], [1, 1],
                     [8], 1.0, 1.2, 2.5, "profile", ["x[0]"], {"b": "a"}),
    }
    back = wire.loads(wire.dumps(value))
    assert back.keys() == value.keys()
    for key, want in value.items():
        got = back[key]
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.device == want.device
            if not want.is_meta:
                assert torch.equal(got, want)
        else:
            assert got == want and type(got) is type(want), key


def _message(tree: object) -> bytes:
    head = json.dumps(tree).encode()
    return b"HPW1" + struct.pack("<Q", len(head)) + head


def test_foreign_and_damaged_messages_are_refused_unrun(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Exploit:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (marker.touch, ())  # type: ignore[return-value]

    with pytest.raises(wire.WireError, match="not a hybridpipe value"):
        wire.loads(pickle.dumps(Exploit()))
    assert not marker.exists()
    good = wire.dumps({"a": torch.ones(3)})
    with pytest.raises(wire.WireError, match="damaged"):
        wire.loads(good[:-4])  # a tensor cut short
    with pytest.raises(wire.WireError, match="unknown value kind"):
        wire.loads(_message({"$": "eval", "v": "__import__('os')"}))
    with pytest.raises(wire.WireError, match="not hybridpipe's"):
        wire.loads(_message({"$": "record", "type": "os:system", "fields": {"command": "x"}}))
    with pytest.raises(wire.WireError, match="not a type"):
        wire.loads(_message({"$": "record", "type": "pipeline.execution.distributed.wire:dumps",
                             "fields": {}}))
    with pytest.raises(wire.WireError, match="not a record"):
        wire.loads(_message({"$": "record", "type": "pipeline.execution.distributed.wire:"
                             "WireError", "fields": {}}))


@dataclass
class _Foreign:
    x: int


def test_only_our_types_are_sent() -> None:
    with pytest.raises(TypeError, match="cannot be sent"):
        wire.dumps({"f": lambda: 1})
    with pytest.raises(TypeError, match="not one of hybridpipe's own types"):
        wire.dumps(_Foreign(1))


def test_a_value_planted_in_the_store_is_refused_not_run(tmp_path: Path) -> None:
    """A foreign client that can reach the job's c10d store writes a pickle (that would create
    a file when unpickled) as rank 1's arrival: rank 0 refuses it with a clear error."""
    from datetime import timedelta

    import torch.distributed as dist

    from pipeline.execution.distributed.agreement import Agreement

    marker = tmp_path / "ran"

    class Exploit:
        def __reduce__(self) -> tuple[object, tuple[()]]:
            return (marker.touch, ())

    wait = timedelta(seconds=10)
    host = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=wait, wait_for_workers=False)
    leader = Agreement(dist.TCPStore("127.0.0.1", host.port, 3, False, timeout=wait), 0, 2, 2.0)
    foreign = dist.TCPStore("127.0.0.1", host.port, 3, False, timeout=wait)
    foreign.set(f"hybridpipe/setup/{leader.pipeline}/0/arrive/1", pickle.dumps(("ok", Exploit())))
    with pytest.raises(wire.WireError, match="not a hybridpipe value"):
        leader.sync("the settings check", {"plan": 1})
    assert not marker.exists()
