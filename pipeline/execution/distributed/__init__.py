"""The distributed executor: one process per pipeline rank over torch.distributed (launched by
torchrun), with data-parallel replicas of the whole pipeline on top. Modules by job: `topology`
(the (dp, pp) DeviceMesh and this process's place in it), `failure` (timeouts, failure reports,
`RankFailure`), `agreement` (setup over the c10d store: settings checked before any tensor
moves, setup failures named; `SettingsMismatch`), `context` (process groups + failure protocol +
agreement = `DistContext`, the job's `Processes` for checkpoints), `p2p` (wire format and the
point-to-point `Transport`), `gradsync` (replica gradient averaging), `ties` (parameters tied
across pipeline ranks), `step_agreement` (each step's batch-shape key and call, agreed within a
pipeline), `step_end` (the loss on every rank, the trace on global rank 0), `shard` (ZeRO-1 /
FSDP2 sharding of the replicas' state, ``Pipeline(shard=...)``), `optimizers` (the optimizer
each shard mode needs, and the check of one built otherwise), `dtensors` (DTensor helpers; a
leaf), `adoption` (a new decision adopted: the units that change rank move, with `moves`,
`zero_moves`, `fsdp_moves`) and `executor` (`DistributedExecutor`, which runs the shared
`RankRuntime`).

Naming: a *rank* is a process; its *pipeline rank* is its "pp" coordinate (which stages it
holds), its *replica* its "dp" coordinate. A *stage* is one contiguous piece of the model;
with `virtual_stages` > 1 a pipeline rank holds several stages (chunks).

Rank layout. world_size = data_parallel x stages, the DeviceMesh
``init_device_mesh(device, (data_parallel, stages), mesh_dim_names=("dp", "pp"))``: a row of
the mesh is one replica's pipeline, a column the replicas of one pipeline rank (they average
their gradients). On one 8-process node with stages=4: ranks 0-3 and 4-7 are two pipelines;
{0, 4}, {1, 5}, {2, 6}, {3, 7} are the gradient groups. Keep a pipeline inside one node (its
traffic is per microbatch) by giving each node a multiple of `stages` processes.

Timeout. Every wait (a receive, a send's completion, a gradient all-reduce, the loss
reduction) is bounded by ``timeout`` seconds: ``Pipeline(..., timeout=...)``, else the
environment variable ``HYBRIDPIPE_TIMEOUT``, else 120 s. A rank that raises records the error
in the c10d store and tears its process group down, so its peers' waits fail at once and every
other rank raises `RankFailure` naming it (and exits non-zero). A rank killed outright (SIGKILL,
lost node) is named by whichever peer first sees its connection close; a rank that hangs is
named by the peers whose waits on it time out. After a failure the process group is gone:
restart the job (``torchrun --max-restarts``) from the last checkpoint. With ``compile=``, a
step in which a process may be compiling is bounded by the compile allowance instead
(``compile_timeout=``, else HYBRIDPIPE_COMPILE_TIMEOUT, else 1800 s; see executor.py).

Setup moves no tensor until every process has checked in through the c10d store with the same
settings: stages, data_parallel, schedule and its text, microbatches, virtual stages, loss
weighting, the model's parameter names and shapes, its first batch's structure and dtypes. A
mismatch ends every process with one `SettingsMismatch` (a ValueError) naming each differing
setting, its value on each rank and the fix; a process that raises, dies or hangs while
building the Pipeline, capturing, profiling, partitioning or building its executor is named,
with what it was doing, by every other process within the timeout (`RankFailure`). The one-off
object collectives of checkpoints (gathers of state) are bounded by the process group's
timeout: ``dist.init_process_group(..., timeout=timedelta(...))``.

Launch. One node: ``torchrun --nproc-per-node 4 train.py``. Several nodes: run on every node
``torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500
--rdzv-id job1 train.py`` where HOST:29500 is reachable from all nodes (any one of them). The
script calls ``dist.init_process_group("gloo")`` (CPU) or ``("nccl")`` (one GPU per process,
cuda:LOCAL_RANK), then builds ``Pipeline(model, stages=...)`` exactly as in one process; the
same call in every process. Data follows the DDP convention: every process of a replica calls
``step`` with that replica's batch (processes holding neither the first nor the last stage may
pass None). Global rank 0 makes the plan (profiling, if asked) and the others follow it; as
with DDP, replicas start from replica 0's weights.
"""

from pipeline.execution.distributed.agreement import SettingsMismatch
from pipeline.execution.distributed.context import DistContext
from pipeline.execution.distributed.executor import DistributedExecutor
from pipeline.execution.distributed.failure import RankFailure
from pipeline.execution.distributed.gradsync import GradSync
from pipeline.execution.distributed.p2p import P2PTransport
from pipeline.execution.distributed.topology import Layout, make_layout
from pipeline.execution.timeouts import DEFAULT_TIMEOUT, ENV_TIMEOUT, resolve_timeout

__all__ = [
    "DEFAULT_TIMEOUT",
    "ENV_TIMEOUT",
    "DistContext",
    "DistributedExecutor",
    "GradSync",
    "Layout",
    "P2PTransport",
    "RankFailure",
    "SettingsMismatch",
    "make_layout",
    "resolve_timeout",
]
