"""Checkpoints under torch.distributed exchange nothing by pickle: 2 gloo processes (launched
as torchrun does) run with torch's object collectives (gather_object, all_gather_object,
broadcast_object_list, scatter_object_list, send/recv_object_list) replaced by functions that
raise, so DCP's own save planning (which gathers and scatters pickled plans) would fail them.
They save (blocking and in the background) and load at pp=2, and at dp=2 with ZeRO-1 and
with FSDP2 (DTensor shards); each process writes its own files (``__<rank>_<n>.distcp``),
global rank 0 merges the index parts into one ``.metadata``; a resumed run's next loss equals
the uninterrupted one's, and one process loads the pp=2 checkpoint at another layout. A
process whose background write fails is named at once on global rank 0 (which waits for
every process's files). A `Checkpointer` save at pp=1 x dp=2 resumed at pp=2 is re-planned
from the unit costs it kept (the elastic re-plan, agreed without pickling) and trains on with
the uninterrupted run's loss.

This file is also the worker: ``python <this file> WORKER OUT_DIR``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.distributed import all_ok, init_worker, launch, replica_slice
from tests.support.models import global_batch, lm_loss, make_model

ROWS = 4  # per replica
OBJECT_COLLECTIVES = ("gather_object", "all_gather_object", "broadcast_object_list",
                      "scatter_object_list", "send_object_list", "recv_object_list")


def _forbid_object_collectives() -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    def refusing(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> None:
            raise AssertionError(f"torch.distributed.{name} was called: it unpickles what "
                                 "other processes send")
        return call

    for name in OBJECT_COLLECTIVES:
        setattr(dist, name, refusing(name))
        setattr(distributed_c10d, name, refusing(name))


def _pipe(seed: int, stages: int, dp: int, shard: str | None) -> Any:
    from pipeline import Pipeline

    x, _ = global_batch(0, ROWS)
    return Pipeline(make_model(seed), stages=stages, data_parallel=dp, microbatches=2,
                    loss_fn=lm_loss, balance="parameters", capture_method="fx", shard=shard,
                    example_input=x)


def _step(pipe: Any, opt: torch.optim.Optimizer, step: int) -> float:
    layout = pipe.distributed.layout
    x, y = global_batch(step, ROWS * layout.data_parallel)
    pipe.zero_grad()
    loss = pipe.step(replica_slice(x, layout.dp_rank, layout.data_parallel),
                     replica_slice(y, layout.dp_rank, layout.data_parallel))
    opt.step()
    return float(loss)


def _check_files(version: Path) -> None:
    names = {p.name for p in version.iterdir()}
    assert ".metadata" in names and not {n for n in names if n.endswith(".metadata")
                                         and n != ".metadata"}, names


def _save_and_resume(out: Path, stages: int, dp: int, shard: str | None, *,
                     async_save: bool) -> None:
    """Train 2 steps, save, resume a fresh pipeline from it: its next loss is the same."""
    import torch.distributed as dist

    a = _pipe(0, stages, dp, shard)
    opt_a = a.optimizer(torch.optim.Adam, lr=0.01)
    for step in range(2):
        _step(a, opt_a, step)
    path = out / f"pp{stages}-dp{dp}-{shard}"
    a.save_checkpoint(path, optimizer=opt_a, extra={"step": 2}, async_save=async_save)
    a.wait_checkpoint()
    _check_files(next(path.glob("v-*")))
    if stages == 2:
        state = a.state_dict()
        if state is not None:
            torch.save(state, out / "pp2-state.pt")
    b = _pipe(7, stages, dp, shard)
    opt_b = b.optimizer(torch.optim.Adam, lr=0.5)  # its lr comes from the checkpoint
    assert b.load_checkpoint(path, optimizer=opt_b) == {"step": 2}
    resumed, uninterrupted = _step(b, opt_b, 2), _step(a, opt_a, 2)
    assert abs(resumed - uninterrupted) < 1e-12, (stages, dp, resumed, uninterrupted)
    dist.barrier()


def _failed_background_write(out: Path) -> None:
    """Process 1's background write fails: global rank 0, waiting for every process's files,
    learns it at once (not at the timeout) and both raise; the next save succeeds."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    from pipeline.checkpoint.checksums import ChecksummingWriter

    a = _pipe(0, 2, 1, None)
    opt = a.optimizer(torch.optim.SGD, lr=0.1)
    _step(a, opt, 0)
    real = ChecksummingWriter.write_data

    def broken(self: Any, plan: Any, planner: Any) -> Any:
        raise OSError("injected write failure")

    if dist.get_rank() == 1:
        ChecksummingWriter.write_data = broken  # type: ignore[method-assign]
    a.save_checkpoint(out / "failing", optimizer=opt, async_save=True)
    want = (CheckpointException, "injected") if dist.get_rank() == 1 else (
        RuntimeError, r"failed on another process \(process 1: OSError: injected")
    with pytest.raises(want[0], match=want[1]):
        a.wait_checkpoint()
    ChecksummingWriter.write_data = real  # type: ignore[method-assign]
    a.save_checkpoint(out / "failing", optimizer=opt, async_save=True)
    a.wait_checkpoint()
    assert a.load_checkpoint(out / "failing", optimizer=opt) is None


def _elastic_resume(out: Path) -> None:
    """A `Checkpointer` save at pp=1 x dp=2 (balanced on global rank 0's profile) resumed at
    pp=2 x dp=1 split uniformly (one block on stage 0, three on stage 1): the elastic re-plan
    from the unit costs the checkpoint kept moves a block, carrying the plain optimizer built
    before it, and the next loss is the uninterrupted run's (the same global batch)."""
    from pipeline import Checkpointer, Pipeline

    def run(stages: int, seed: int, balance: str) -> Any:
        dp = 2 // stages
        x, _ = global_batch(0, 8)
        return Pipeline(make_model(seed), stages=stages, data_parallel=dp, microbatches=4 // dp,
                        loss_fn=lm_loss, balance=balance, capture_method="fx",
                        example_input=replica_slice(x, torch.distributed.get_rank() // stages, dp))

    def step(pipe: Any, opt: torch.optim.Optimizer, i: int) -> float:
        layout = pipe.distributed.layout
        x, y = global_batch(i, 8)
        pipe.zero_grad()
        loss = pipe.step(replica_slice(x, layout.dp_rank, layout.data_parallel),
                         replica_slice(y, layout.dp_rank, layout.data_parallel))
        opt.step()
        return float(loss)

    a = run(1, 0, "profile")
    opt_a = torch.optim.Adam(a.parameters(), lr=0.01)
    for i in range(2):
        step(a, opt_a, i)
    Checkpointer(a, out / "elastic", opt_a).save(2)
    b = run(2, 7, "uniform")
    opt_b = torch.optim.Adam(b.parameters(), lr=0.5)  # not known to the executor: carried
    uniform = b.plan.sizes
    resumed = Checkpointer(b, out / "elastic", opt_b).resume()
    assert resumed is not None and resumed.replanned is not None, resumed
    assert resumed.replanned.applied and b.plan.sizes != uniform, resumed
    again, uninterrupted = step(b, opt_b, 2), step(a, opt_a, 2)
    assert abs(again - uninterrupted) < 1e-9, (again, uninterrupted)


def worker_nopickle(out: Path) -> None:
    init_worker()
    _forbid_object_collectives()
    _elastic_resume(out)
    _save_and_resume(out, stages=2, dp=1, shard=None, async_save=False)
    _save_and_resume(out, stages=1, dp=2, shard="optimizer", async_save=True)
    _save_and_resume(out, stages=1, dp=2, shard="full", async_save=False)
    _failed_background_write(out)
    torch.distributed.destroy_process_group()
    print("worker nopickle: every check ran")


WORKERS = {"nopickle": worker_nopickle}


@pytest.mark.slow
def test_checkpoints_use_no_object_collectives(tmp_path: Path) -> None:
    from pipeline import Pipeline

    all_ok(launch("nopickle", 2, tmp_path, script=__file__), "nopickle")
    version = next((tmp_path / "pp2-dp1-None").glob("v-*"))
    assert {p.name for p in version.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    # One process (another layout) reads the merged index of the two processes' files.
    x, _ = global_batch(0, ROWS)
    pipe = Pipeline(make_model(3), stages=1, microbatches=2, loss_fn=lm_loss,
                    capture_method="fx", example_input=x)
    pipe.load_checkpoint(tmp_path / "pp2-dp1-None")
    want = torch.load(tmp_path / "pp2-state.pt", weights_only=True)
    got = pipe.state_dict()
    assert got is not None and sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def _part(rank: int, chunks: list[tuple[int, int]], size: int = 4) -> Any:
    """One process's index part holding rows [start, start + rows) of a (size, 2) tensor."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    entry = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size([size, 2]),
        [ChunkStorageMetadata(torch.Size([s, 0]), torch.Size([n, 2])) for s, n in chunks])
    storage = {MetadataIndex("w", [s, 0]): _StorageInfo(f"__{rank}_0.distcp", 0, 8 * n)
               for s, n in chunks}
    return Metadata({"w": entry}, planner_data={"w": ("w",)}, storage_data=storage)


def test_index_parts_merge_into_one_tensor_once_each() -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from pipeline.checkpoint.parts import merge

    # Two shards of one tensor, and a replica's copy of the first (kept from process 0).
    merged = merge([_part(0, [(0, 2)]), _part(1, [(2, 2)]), _part(2, [(0, 2)])])
    chunks = merged.state_dict_metadata["w"].chunks
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in chunks] == [((0, 0), (2, 2)),
                                                                     ((2, 0), (2, 2))]
    assert merged.storage_data[MetadataIndex("w", [0, 0])].relative_path == "__0_0.distcp"
    assert merged.storage_data[MetadataIndex("w", [2, 0])].relative_path == "__1_0.distcp"
    with pytest.raises(ValueError, match="cover 4 of its 8 elements"):
        merge([_part(0, [(0, 2)])])
    with pytest.raises(ValueError, match="different shapes"):
        merge([_part(0, [(0, 4)]), _part(1, [(0, 2)], size=2)])


if __name__ == "__main__":
    WORKERS[sys.argv[1]](Path(sys.argv[2]))
