"""`DistContext`: one process's view of the job: the default process group (initialised from
the torchrun environment if needed), the (dp, pp) DeviceMesh and its groups, this process's
`Layout`, its device, the timeout and the failure protocol. Also `agree`, the one-off
"global rank 0 decides" broadcast used while setting up."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipeline.distributed.failure import Failures
from pipeline.distributed.topology import DIMS, Layout, check_world
from pipeline.timeouts import resolve_timeout


class DistContext:
    """The process groups of this job as seen by this process.

    `layout`: where it sits in the (dp, pp) mesh; `dp_group` its gradient group (the replicas
    of its pipeline rank), `pp_group` its pipeline; `device` cuda:LOCAL_RANK under NCCL, else
    CPU; `guard` / `wait_work` the failure protocol (pipeline.distributed.failure)."""

    def __init__(
        self,
        stages: int,
        data_parallel: int | None = None,
        *,
        timeout: float | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.timeout = resolve_timeout(timeout)
        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, timeout=timedelta(seconds=self.timeout))
        dp = check_world(stages, data_parallel, dist.get_world_size())
        if device is None:
            if dist.get_backend() == "nccl":
                device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            else:
                device = torch.device("cpu")
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL and object collectives use the current one
        self.mesh: DeviceMesh = init_device_mesh(
            self.device.type, (dp, stages), mesh_dim_names=DIMS
        )
        self.layout = Layout.of(self.mesh)
        self.dp_group = self.mesh.get_group("dp")
        self.pp_group = self.mesh.get_group("pp")
        store = dist.distributed_c10d._get_default_store()
        self.failures = Failures(store, self.layout, self.timeout)

    @property
    def wait(self) -> timedelta:
        return self.failures.wait

    def guard(self, what: str) -> AbstractContextManager[None]:
        """See `Failures.guard`: run collective work, turning failures into clear errors."""
        return self.failures.guard(what)

    def wait_work(self, work: Any, peer: int | None, what: object) -> None:
        """See `Failures.wait_work`: wait for a Work under the timeout."""
        self.failures.wait_work(work, peer, what)


def _portable(obj: Any) -> Any:
    """Tensors moved to CPU (meta ones kept) so they pickle on every backend."""
    return pytree.tree_map_only(
        Tensor, lambda t: t if t.is_meta else t.detach().to("cpu"), obj
    )


def agree(obj: Any) -> Any:
    """Global rank 0's `obj` on every rank (e.g. a Plan made from profiling, so that every
    process splits the model the same way); tensors arrive on CPU. Bounded by the process
    group's own timeout."""
    if not dist.is_initialized():
        return obj
    box = [_portable(obj) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
