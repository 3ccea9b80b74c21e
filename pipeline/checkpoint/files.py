"""Checkpoint directories on disk: atomic file writes (temp file, fsync, os.replace,
directory fsync), the numbered version directories and the ``current`` pointer that names the
live one, and a full disk reported as such."""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException

_POINTER = "current"  # names the live version directory
_META = "hybridpipe.pt"
_VERSION = re.compile(r"v-(\d{6,})")


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process when torch.distributed is not initialised: here
    that is meant (one process, or a load where each process reads its own keys)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save `obj` to `path` so that a crash at any moment leaves either the old file or
    the new one: a temp file in the same directory, fsync, os.replace, directory fsync."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _checkpoint_root(path: str | os.PathLike[str]) -> Path:
    root = Path(path).absolute()
    if root.exists() and not root.is_dir():
        raise ValueError(
            f"checkpoint path {os.fspath(path)!r} is a file; a checkpoint is a directory "
            "(sharded, one set of files per process): give a directory path"
        )
    return root


def _live_version(root: Path) -> str | None:
    pointer = root / _POINTER
    if not pointer.is_file():
        return None
    return pointer.read_text().strip() or None


def _number(name: str) -> int | None:
    match = _VERSION.fullmatch(name)
    return int(match.group(1)) if match else None


def versions(root: Path) -> list[str]:
    """The complete version directories of checkpoint `root`, oldest first: the live one and
    the older ones kept by retention (a version newer than the live one is what a failed or
    killed writer left)."""
    live = _live_version(root)
    live_number = None if live is None else _number(live)
    if live_number is None or not root.is_dir():
        return []
    found = [(n, e.name) for e in root.iterdir() if (n := _number(e.name)) is not None]
    return [name for n, name in sorted(found) if n <= live_number]


def _prepare_version(root: Path) -> str:
    """(Global rank 0) remove what a failed or killed writer left (versions newer than the
    live one, or every version when none is live, and temp pointers), create the next
    version directory."""
    root.mkdir(parents=True, exist_ok=True)
    keep = set(versions(root))
    numbers = [0]
    for entry in root.iterdir():
        number = _number(entry.name)
        if number is not None:
            numbers.append(number)
            if entry.name not in keep:
                shutil.rmtree(entry)
        elif entry.name.startswith(f".{_POINTER}.") and entry.name.endswith(".tmp"):
            entry.unlink()
    name = f"v-{max(numbers) + 1:06d}"
    (root / name).mkdir()
    return name


def _commit(root: Path, name: str, keep: int = 1) -> None:
    """(Global rank 0) make `name` the live version, then delete all but the `keep` newest
    versions (the live one included)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{_POINTER}.", suffix=".tmp", dir=root)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / _POINTER)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(root)
    for old in versions(root)[:-keep]:
        shutil.rmtree(root / old, ignore_errors=True)


def _nbytes(tensors: Mapping[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _no_space(err: BaseException, seen: set[int] | None = None) -> bool:
    """Whether `err` (or what caused it, or a DCP rank failure inside it) is a full disk."""
    seen = set() if seen is None else seen
    if id(err) in seen:
        return False
    seen.add(id(err))
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if "No space left on device" in str(err) or "unexpected pos" in str(err):
        return True  # torch's writers report a short write as "enforce fail ... unexpected pos"
    inner = [e for e in (err.__cause__, err.__context__) if e is not None]
    if isinstance(err, CheckpointException):
        inner += [exc for exc, _ in err.failures.values()]
    return any(_no_space(e, seen) for e in inner)


def _disk_full(root: Path, need: int) -> OSError:
    free = shutil.disk_usage(root).free
    return OSError(
        errno.ENOSPC,
        f"no space left on the device of checkpoint {os.fspath(root)!r}: this process writes "
        f"{need / 2**20:.1f} MiB and {free / 2**20:.1f} MiB are free. Free space or save "
        "elsewhere; the previous checkpoint is untouched",
    )


def as_disk_full(err: BaseException, root: Path, need: int) -> BaseException:
    """`err` itself, or, when it is a full disk, the OSError(ENOSPC) saying so (caused by it)."""
    if not _no_space(err):
        return err
    full = _disk_full(root, need)
    full.__cause__ = err
    return full


def failure_reason(err: BaseException) -> str:
    """The innermost reason of a DCP failure (not its traceback text)."""
    if isinstance(err, CheckpointException) and err.failures:
        err = next(iter(err.failures.values()))[0]
    while err.__cause__ is not None:
        err = err.__cause__
    lines = str(err).strip().splitlines()
    text = lines[0].split(". This is an internal")[0][:160] if lines else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
