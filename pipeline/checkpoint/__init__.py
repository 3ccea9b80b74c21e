"""Model and optimizer state of a pipeline under the original model's keys, for any layout:
gather the full state dict, load a full state dict into whichever stages this process holds,
and save/load sharded checkpoints with torch.distributed.checkpoint (DCP), atomically.

A process holds some stages (`stage_modules`: stage index -> module); their state_dict keys
are the original model's. `spec` (from `model_spec`) is the whole model's key -> (shape,
dtype), taken before other stages' parameters were freed, so every process can check a state
dict against the whole model.

Checkpoint directory (`save_checkpoint`): ``PATH/current`` names the live version directory
``PATH/v-000007``, which holds DCP's files and ``hybridpipe.pt``. Every process writes its own
stages' tensors (`dcp.save`; data-parallel replicas hold the same keys and DCP writes each key
once) under ``model.<key>``, and its optimizer's tensors under the keys of
``get_optimizer_state_dict(model, optimizer, flatten_optimizer_state_dict=True)`` prefixed
``optim.`` (``optim.state.<param name>.<state key>``): keys are the model's own names, so any
(stages, data_parallel) layout, or one process, loads any other's checkpoint by reading exactly
its own keys. ``hybridpipe.pt`` (global rank 0; read with ``weights_only=True``) holds the
format tag, the model's key -> shape spec, the saved layout, the optimizer's type, group count,
each parameter's group and its non-tensor values (hyper-parameters), and ``extra``.

Atomic: a save writes a new version directory (files fsynced by DCP), then replaces
``current`` (temp file, fsync, os.replace, directory fsync), then deletes older versions. A
writer killed at any moment leaves ``current`` naming the previous, complete version; the next
save removes what the dead writer left. The directory must be on storage every process can
read and write.

Retention and asynchronous saves: ``keep=k`` keeps the k newest versions (older ones are
deleted once a new one is live; a version newer than the live one is a failed or killed
writer's and is removed by the next save). With an `AsyncWriter` (``background``) a save
returns once this process's tensors are copied; DCP writes them from a background thread and
global rank 0 makes the version live when every process's files are written.

Loads are all-or-nothing: `load_checkpoint` checks the format, the model's keys and shapes,
the optimizer's type, param groups and per-parameter state, reads this process's tensors into
fresh buffers, and only then changes the optimizer and the stages. A missing, truncated or
unreadable data file (or DCP index) is a ValueError naming the file.

Large models without materialising them whole: build the model on the meta device (``with
torch.device("meta"): model = Model()``); the Pipeline captures it on meta and balances it by
a FLOP + bytes estimate (partitioner.estimate)::

    pipe = Pipeline(model, stages=4, example_input=x, ...)
    pipe.load_state_dict(torch.load("weights.pt", mmap=True))   # or pipe.load_checkpoint(dir)
    optimizer = torch.optim.AdamW(pipe.parameters())

Each process captures and splits the model without allocating it, then takes only its own
stages' tensors from the memory-mapped file (the meta parameters are replaced by them; other
stages' bytes are never read); what the file lacks (non-persistent buffers such as a rotary
``inv_freq``) comes from the modules' own init (pipeline.execution.materialize). Build the
optimizer after loading. ``Pipeline(..., init_fn=...)`` initialises from scratch instead.

Modules, one job each: `state` (spec, checks, gather, load into the held stages), `files`
(atomic writes, versions and retention, a full disk), `extra` (what ``extra`` may hold),
`optim` (the optimizer state plan), `background` (asynchronous saves) and `saveload` (the
save/load entry points).
"""

from pipeline.checkpoint.extra import check_extra
from pipeline.checkpoint.files import atomic_save
from pipeline.checkpoint.saveload import (
    FORMAT,
    VERSION,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from pipeline.checkpoint.state_dict import (
    TensorSpec,
    check_state_dict,
    gather_named,
    gather_state_dict,
    load_state_dict,
    local_state,
    model_spec,
)

__all__ = [
    "FORMAT",
    "VERSION",
    "TensorSpec",
    "atomic_save",
    "check_extra",
    "check_state_dict",
    "gather_named",
    "gather_state_dict",
    "load_checkpoint",
    "load_state_dict",
    "local_state",
    "model_spec",
    "read_checkpoint",
    "save_checkpoint",
]
