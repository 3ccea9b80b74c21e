"""The torch release this code is tested with, checked when `partitioner` (and so `pipeline`)
is imported: both use private APIs of that release (``torch._inductor.standalone_compile``,
``torch._subclasses`` fake tensors, ``torch._functorch`` and ``torch.export`` internals,
``torch.distributed.fsdp``'s state, ...), which change between releases, so another torch
fails here, naming itself and the fix, rather than somewhere inside a step."""

from __future__ import annotations

import os
import re

import torch

TESTED = (2, 14)  # torch 2.14.x (pyproject.toml states the same range)
TORCHVISION = "0.29"  # the torchvision of that release
ALLOW_UNTESTED = "HYBRIDPIPE_ALLOW_UNTESTED_TORCH"


def check_torch(version: str | None = None) -> None:
    """An ImportError unless torch `version` (default: the running one) is the tested
    release, or $HYBRIDPIPE_ALLOW_UNTESTED_TORCH is "1"."""
    found = str(torch.__version__ if version is None else version)
    match = re.match(r"(\d+)\.(\d+)", found)
    release = (int(match[1]), int(match[2])) if match else None
    if release == TESTED or os.environ.get(ALLOW_UNTESTED) == "1":
        return
    tested = f"{TESTED[0]}.{TESTED[1]}"
    raise ImportError(
        f"hybridpipe needs torch {tested}.x (the release it is tested with: it uses private "
        f"torch APIs that change between releases), but torch {found} is installed; install "
        f"it with pip install 'torch=={tested}.*' 'torchvision=={TORCHVISION}.*', or set "
        f"{ALLOW_UNTESTED}=1 to import hybridpipe with this torch untested"
    )


check_torch()  # at import: before the private APIs are imported
