"""`DistContext`: one process's view of the job: the default process group (initialised from
the torchrun environment if needed), the (dp, pp, tp) DeviceMesh and its groups, this process's
`Layout`, its device, the timeout, the failure protocol and the setup `agreement`; and, as the
job's `Processes` (pipeline.execution.processes), the collective steps checkpoints and elastic
training take after setup (a "global rank 0 decides" broadcast, gathers to rank 0, barriers,
a side channel for background saves)."""

from __future__ import annotations

import atexit
import gc
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipeline.execution.distributed import wire
from pipeline.execution.distributed.agreement import Agreement
from pipeline.execution.distributed.failure import Failures
from pipeline.execution.distributed.topology import DIMS, make_layout
from pipeline.execution.processes import Processes
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


class DistContext(Processes):
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
            mesh_dim_names=DIMS, backend_override=self._tp_backend(),
        )

    def _tp_backend(self) -> dict[int | str, Any] | None:
        """The tp groups' backend with the job's timeout: their collectives run inside the
        stages' ops (no Work to wait on), so the group's own timeout is what bounds them."""
        if self.layout.tensor_parallel == 1:
            return None
        backend = dist.get_backend()
        options: Any = (dist.ProcessGroupNCCL.Options() if backend == "nccl"
                        else dist.ProcessGroupGloo._Options())  # type: ignore[attr-defined]
        options._timeout = timedelta(seconds=self.timeout)
        return {"tp": (backend, options)}

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

    # -- the job's processes, as checkpoints and elastic training see them ------------------

    @property
    def stages(self) -> int:
        return self.layout.stages

    @property
    def data_parallel(self) -> int:
        return self.layout.data_parallel

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank

    @property
    def pp_rank(self) -> int:
        return self.layout.pp_rank

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def agree(self, value: Any) -> Any:
        """Global rank 0's `value` on every process (wire-encoded; tensors arrive on CPU).
        Bounded by the process group's own timeout (setup uses `agreement`, which names
        failures)."""
        return wire.broadcast_value(value, src=0)

    def barrier(self, what: str) -> None:
        done = torch.zeros(1, device=self.device)
        self.wait_work(dist.all_reduce(done, async_op=True), None, what)

    def gather(self, part: dict[str, Any], *, replicas: bool = False
               ) -> list[dict[str, Any]] | None:
        layout = self.layout
        if replicas and layout.data_parallel > 1:
            with self.guard("state gather"):
                return wire.gather_values(part, dst=0)
        if layout.dp_rank != 0 or layout.tp_rank != 0:  # tp ranks hold whole copies then
            return None
        if layout.stages == 1:
            return [part] if layout.rank == 0 else None
        with self.guard("state gather"):
            return wire.gather_values(part, dst=0, group=self.pp_group)

    def gather_all(self, value: Any) -> list[Any] | None:
        with self.guard("gathering of every process's values"):
            return wire.gather_values(value, dst=0)

    def minimum(self, value: Tensor) -> Tensor:
        reduced = value.to(self.device, copy=True)
        work = dist.all_reduce(reduced, op=dist.ReduceOp.MIN, async_op=True)
        self.wait_work(work, None, "the minimum over every process")
        return reduced.to(value.device)

    def side_channel(self, timeout: float) -> Callable[[bool, float], bool]:
        """A gloo group of its own (a background thread's collective must not interleave
        with the executor's) whose all-reduce tells whether any process passed True."""
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        if not isinstance(group, dist.ProcessGroup):
            raise RuntimeError("this process is not in the side channel's process group")

        def any_true(flag: bool, seconds: float) -> bool:
            value = torch.tensor([1.0 if flag else 0.0])
            work = dist.all_reduce(value, group=group, async_op=True)
            work.wait(timeout=timedelta(seconds=seconds))
            return bool(value.item() > 0)

        return any_true
