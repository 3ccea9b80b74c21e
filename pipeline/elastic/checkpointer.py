"""`Checkpointer`: resume and periodic checkpoints as a training-loop helper. `resume` finds
the latest complete version of a checkpoint directory (the live one, or, if a process cannot
read it, the newest older one retained by `keep`), loads the model, the optimizer, the data
position and the RNG states at whatever layout this run has, and reports what it resumed
(`Resumed`); at another layout the plan is first re-planned from the unit costs the saving run
measured (the elastic re-plan, `Pipeline.rebalance_from`), so the restarted run balances on
them without profiling again; `maybe_save` saves every `every` steps, keeping the last `keep`
versions, and asynchronously if asked (the step stalls only while the tensors are copied).

What a save holds besides model and optimizer (its ``extra``): the steps done, the caller's
data position (plain data, e.g. a sampler's state) and the RNG states of every process (torch's
CPU generator, the CUDA one where present, Python's `random`, NumPy's global generator, which
data pipelines often use for augmentation), keyed by (replica, pipeline rank, tp rank). On resume a
process takes the states saved at its own coordinate, else those of global rank 0
(a layout that did not exist before)."""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from partitioner.unit_costs import costs_from_data
from pipeline.checkpoint import read_checkpoint
from pipeline.checkpoint.files import versions
from pipeline.planning.calibration import Rebalance

if TYPE_CHECKING:
    from pipeline.api import Pipeline

log = logging.getLogger("hybridpipe")
_TAG = "hybridpipe.resume"


def rng_state() -> dict[str, Any]:
    """This process's RNG states as plain data (loads back with weights_only=True)."""
    version, state, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": [version, list(state), gauss],
        "numpy": _numpy_state(),
    }


def _numpy_state() -> dict[str, Any]:
    """NumPy's global (legacy MT19937) generator as plain data."""
    state = cast(dict[str, Any], np.random.get_state(legacy=False))  # the dict form
    return {"key": [int(k) for k in state["state"]["key"]], "pos": int(state["state"]["pos"]),
            "has_gauss": int(state["has_gauss"]), "gauss": float(state["gauss"])}


def set_rng_state(saved: dict[str, Any]) -> None:
    """Restore states from `rng_state` (CUDA ones only for the devices both runs have)."""
    torch.set_rng_state(saved["torch"])
    if torch.cuda.is_available() and saved["cuda"]:
        count = min(len(saved["cuda"]), torch.cuda.device_count())
        torch.cuda.set_rng_state_all(saved["cuda"][:count])
    version, state, gauss = saved["python"]
    random.setstate((version, tuple(state), gauss))
    if "numpy" in saved:  # checkpoints written before NumPy's state was saved lack it
        np_state = saved["numpy"]
        np.random.set_state({
            "bit_generator": "MT19937",
            "state": {"key": np.array(np_state["key"], dtype=np.uint32), "pos": np_state["pos"]},
            "has_gauss": np_state["has_gauss"], "gauss": np_state["gauss"],
        })


@dataclass(frozen=True)
class Resumed:
    """What `Checkpointer.resume` loaded: the version directory, the steps done before it
    was saved, the caller's data position, the layout it was saved at and the one it was
    loaded into ({"stages": ..., "data_parallel": ...}), the seconds the load took, and
    `replanned`: at another layout, the report of the elastic re-plan from the unit costs the
    checkpoint kept (None when there was none: see `Checkpointer.resume`)."""

    version: Path
    step: int
    data: Any
    saved_layout: dict[str, int]
    layout: dict[str, int]
    seconds: float
    replanned: Rebalance | None = None

    def __str__(self) -> str:
        def text(layout: dict[str, int]) -> str:
            return f"stages={layout['stages']} x data_parallel={layout['data_parallel']}"

        replanned = self.replanned
        return (
            f"resumed after step {self.step} from {str(self.version)!r} (saved at "
            f"{text(self.saved_layout)}, loaded at {text(self.layout)}) in {self.seconds:.2f} s"
        ) + ("" if replanned is None else (
            f"; re-planned from the unit costs it kept: stages {replanned.before} -> "
            f"{replanned.after}, " + ("applied" if replanned.applied else "plan kept")))


def _coordinate(pipe: Pipeline) -> tuple[int, int, int]:
    processes = pipe.processes
    return processes.dp_rank, processes.pp_rank, processes.tp_rank


def _saved_rng(states: dict[tuple[int, ...], dict[str, Any]], at: tuple[int, int, int]
               ) -> dict[str, Any]:
    """The RNG states saved at coordinate `at` (replica, pipeline rank, tp rank), else at its
    (replica, pipeline rank) (a checkpoint written before tp ranks were keyed), else global
    rank 0's."""
    for key in (at, at[:2], (0, 0, 0), (0, 0)):
        if key in states:
            return states[key]
    raise ValueError(f"the checkpoint's RNG states have no entry for {at} nor for rank 0")


def _layout(pipe: Pipeline) -> dict[str, int]:
    processes = pipe.processes
    return {"stages": processes.stages, "data_parallel": processes.data_parallel}


class Checkpointer:
    """Resume and periodic checkpoints of `pipe` and `optimizer` in directory `path`::

        ckpt = Checkpointer(pipe, "ckpt", optimizer, every=100, keep=2, async_save=True)
        resumed = ckpt.resume()                 # None when there is no checkpoint yet
        start = resumed.step if resumed else 0
        for step in range(start, steps):
            pipe.zero_grad(); pipe.step(*batch(step)); optimizer.step()
            ckpt.maybe_save(step + 1, data=...)  # saves after every `every`-th step
        ckpt.close()                            # the last save is live

    Under torch.distributed every process makes the same calls. `data`: the caller's data
    position (plain data); with a global batch drawn by step number it is not needed."""

    def __init__(
        self, pipe: Pipeline, path: str | os.PathLike[str],
        optimizer: torch.optim.Optimizer | None = None, *, every: int = 100, keep: int = 2,
        async_save: bool = False,
    ) -> None:
        for name, value in (("every", every), ("keep", keep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.pipe, self.path, self.optimizer = pipe, Path(path), optimizer
        self.every, self.keep, self.async_save = every, keep, async_save

    def resume(self) -> Resumed | None:
        """Load the newest version of `path` that every process can read (the live one, else
        an older one kept by `keep`; see the module docstring), or return None when there is
        none yet. Saved at another layout, with the unit costs of the run that saved it (a
        run planned on profiled or measured costs keeps them), the version is loaded into
        the plan re-planned from them (`_replan`; `Resumed.replanned`). Logged on the
        "hybridpipe" logger; a version skipped as damaged is logged as a warning. ValueError
        (the newest version's) when none loads."""
        started = time.perf_counter()
        if not (self.path / "current").is_file():
            return None
        first: ValueError | None = None
        for name in reversed(versions(self.path)):
            replanned = self._replan(name)
            try:
                extra = self.pipe.load_checkpoint(self.path, self.optimizer, version=name)
                failed = None
            except ValueError as err:  # all or nothing: this process is as it was
                failed, first = err, first or err
            if self._everywhere(failed is None):
                return self._resumed(name, extra, started, replanned)
            log.warning("hybridpipe: checkpoint version %s of %s not loaded (%s); trying an "
                        "older one", name, self.path, failed or "on another process")
        raise first or ValueError(
            f"no version of checkpoint {str(self.path)!r} loaded on every process"
        )

    def _replan(self, name: str) -> Rebalance | None:
        """Before version `name` is loaded, when it was saved at another layout with its run's
        unit costs: the elastic re-plan of this Pipeline's plan from them
        (`Pipeline.rebalance_from`: `Planner.replan`, then `Executor.adopt`, the units'
        state in the optimizer moving with them), so the state loads into the stages it
        balances. Not before the plan is made (the first batch plans; pass example_input=),
        nor with tensor_parallel (the moves do not carry shards) or stage sizes given as
        ``balance=[...]``. Every process decides alike (an all-reduce)."""
        costs: dict[str, Any] = {}
        try:
            _, meta = read_checkpoint(self.path, name)
            costs = meta.get("unit_costs") or {}
            usable = (bool(costs) and meta["layout"] != _layout(self.pipe)
                      and self._planned_on(costs))
        except ValueError:  # the load says what is wrong with this version
            usable = False
        if not self._everywhere(usable):
            return None
        return self.pipe.rebalance_from(costs_from_data(costs), optimizer=self.optimizer)

    def _planned_on(self, units: dict[str, Any]) -> bool:
        """Whether this Pipeline is planned, on these units, in a way a re-plan may change."""
        pipe = self.pipe
        if pipe.settings.tp_degree > 1 or not isinstance(pipe.balance, str):
            return False
        try:
            order = pipe.captured.order
        except RuntimeError:  # no plan yet: it is made from the first batch
            return False
        return set(order) == set(units)

    def _everywhere(self, ok: bool) -> bool:
        """Whether `ok` holds on every process (under torch.distributed; an all-reduce)."""
        return bool(self.pipe.processes.minimum(torch.tensor([1 if ok else 0])).item())

    def _resumed(self, name: str, extra: Any, started: float,
                 replanned: Rebalance | None) -> Resumed:
        version, meta = read_checkpoint(self.path, name)
        if not isinstance(extra, dict) or _TAG not in extra:
            raise ValueError(
                f"checkpoint {str(self.path)!r} was not written by a Checkpointer (its extra "
                "has no step and RNG states); load it with pipe.load_checkpoint"
            )
        saved = extra[_TAG]
        states: dict[tuple[int, ...], dict[str, Any]] = dict(saved["rng"])
        set_rng_state(_saved_rng(states, _coordinate(self.pipe)))
        resumed = Resumed(
            version=version, step=saved["step"], data=saved["data"],
            saved_layout=meta["layout"], layout=_layout(self.pipe),
            seconds=time.perf_counter() - started, replanned=replanned,
        )
        self.pipe.steps_done = resumed.step  # metrics number the steps on from here
        log.info("hybridpipe: %s", resumed)
        return resumed

    def maybe_save(self, step: int, data: Any = None) -> bool:
        """Save if `step` (steps done) is a multiple of `every`; whether it saved."""
        if step % self.every:
            return False
        self.save(step, data)
        return True

    def save(self, step: int, data: Any = None) -> None:
        """Save now, as after `step` steps, with the data position `data`."""
        mine = (_coordinate(self.pipe), rng_state())
        gathered = self.pipe.processes.gather_all(mine)
        extra = {_TAG: {"step": step, "data": data, "rng": gathered}}
        self.pipe.save_checkpoint(
            self.path, self.optimizer, extra, keep=self.keep, async_save=self.async_save
        )

    def close(self) -> None:
        """Wait until the save in flight (if any) is live; raise its error."""
        self.pipe.wait_checkpoint()
