"""`DistContext`: one process's view of the job: the default process group (initialised from
the torchrun environment if needed), the (dp, pp, tp) DeviceMesh and its groups, this process's
`Layout`, its device, the timeout, the failure protocol and the setup `agreement`. Also
`agree`, a one-off "global rank 0 decides" broadcast for collective work after setup
(checkpoints)."""

from __future__ import annotations

import atexit
import gc
import os
from contextlib import AbstractContextManager
from datetime import timedelta
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipeline.execution.distributed import wire
from pipeline.execution.distributed.agreement import Agreement
from pipeline.execution.distributed.failure import Failures
from pipeline.execution.distributed.topology import DIMS, make_layout
from pipeline.execution.timeouts import resolve_timeout


@atexit.register
def _collect_while_whole() -> None:
    """Free unreachable Pipelines (executor, transport and groups hold each other in cycles)
    while the interpreter is whole: a gloo process group left for the interpreter's teardown
    could end a process that had finished its work in std::terminate (exit -6, which torchrun
    counts as a failed worker); seen 1 run in 6 of the meta-init test, 0 in 24 with this."""
    gc.collect()


def job_agreement(timeout: float) -> Agreement:
    """The setup agreement of a new Pipeline of this job (the process group initialised first
    if it is not), over the job's c10d store."""
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    # torch has no public getter of the default group's store (whatever init method made
    # it); rebuilding one from MASTER_ADDR would only cover env:// jobs.
    store = dist.distributed_c10d._get_default_store()
    return Agreement(store, dist.get_rank(), dist.get_world_size(), timeout)


def process_device() -> torch.device:
    """This process's device: cuda:LOCAL_RANK under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


class DistContext:
    """The process groups of this job as seen by this process.

    `layout`: where it sits in the (dp, pp) mesh; `dp_group` its gradient group (the replicas
    of its pipeline rank), `pp_group` its pipeline; `device` cuda:LOCAL_RANK under NCCL, else
    CPU; `guard` / `wait_work` the failure protocol (pipeline.execution.distributed.failure);
    `agreement` the setup's sync points (pipeline.execution.distributed.agreement). The process
    groups are made on first use (the executor makes them once every process has checked in), so
    that a peer that is gone is named by the setup checks, not by a hang in group creation."""

    def __init__(
        self,
        stages: int,
        data_parallel: int | None = None,
        *,
        timeout: float | None = None,
        device: torch.device | str | None = None,
        agreement: Agreement | None = None,
        tensor_parallel: int = 1,
    ) -> None:
        self.timeout = resolve_timeout(timeout)
        # The Pipeline's agreement, made already when it chose its layout (stages="auto").
        self.agreement = agreement if agreement is not None else job_agreement(self.timeout)
        store = self.agreement.store
        with self.agreement.phase("construction of Pipeline(...)"):
            self.layout = make_layout(
                stages, data_parallel, world_size=dist.get_world_size(), rank=dist.get_rank(),
                tensor_parallel=tensor_parallel,
            )
        self.agreement.describe = self.layout.describe
        self.device = torch.device(device) if device is not None else process_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL and object collectives use the current one
        self.failures = Failures(store, self.layout, self.timeout, self.agreement.fail)

    @cached_property
    def mesh(self) -> DeviceMesh:
        """The (dp, pp, tp) DeviceMesh with its process groups (the same cube as `layout`)."""
        layout = self.layout
        return init_device_mesh(
            self.device.type, (layout.data_parallel, layout.stages, layout.tensor_parallel),
            mesh_dim_names=DIMS,
        )

    @cached_property
    def tp_mesh(self) -> DeviceMesh:
        """This process's tensor-parallel group as a 1-d mesh (the held stages' DTensors)."""
        return self.mesh["tp"]

    @cached_property  # DeviceMesh.get_group costs ~0.1 ms a call; the mesh never changes
    def dp_group(self) -> dist.ProcessGroup:
        """This process's gradient group: the replicas of its pipeline rank."""
        return self.mesh.get_group("dp")

    @cached_property
    def pp_group(self) -> dist.ProcessGroup:
        """This process's pipeline: the ranks of its replica."""
        return self.mesh.get_group("pp")

    @property
    def wait(self) -> timedelta:
        return self.failures.wait

    def guard(self, what: str) -> AbstractContextManager[None]:
        """See `Failures.guard`: run collective work, turning failures into clear errors."""
        return self.failures.guard(what)

    def wait_work(self, work: Any, peer: int | None, what: object) -> None:
        """See `Failures.wait_work`: wait for a Work under the timeout."""
        self.failures.wait_work(work, peer, what)


def agree(obj: Any) -> Any:
    """Global rank 0's `obj` on every rank; tensors arrive on CPU. Bounded by the process
    group's own timeout (setup uses `DistContext.agreement` instead, which names failures)."""
    if not dist.is_initialized():
        return obj
    return wire.broadcast_value(obj, src=0)
