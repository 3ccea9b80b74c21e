"""Each data-parallel replica's share of the data (``pipe.replica_sampler``): torch's
DistributedSampler over the replicas of the Pipeline's layout, so a torchrun script needs no
rank arithmetic. Every process of one replica (each pipeline rank) draws the same indices, so
the first stage's inputs and the last stage's targets match; the replica count and index come
from the layout the Pipeline runs (also one chosen by ``stages="auto"``, and the new one after
an elastic restart), and `start` skips the samples the job already consumed this epoch under
any earlier layout."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any, TypeVar

import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler

_T = TypeVar("_T")


class ReplicaSampler(DistributedSampler[_T]):
    """torch's DistributedSampler, resumable: the epoch's global order (a permutation seeded
    by ``seed + epoch``, or 0..n-1) without its first `start` positions, padded (or, with
    `drop_last`, cut) to a multiple of the replicas and dealt round-robin, as
    DistributedSampler deals it. Replicas that each took b samples a step for s steps under
    any layout consumed exactly the first ``s x b x replicas`` positions, so
    ``start=s * b * replicas`` continues the epoch where it stopped. `start` applies to the
    epoch given here; `set_epoch` to another epoch starts it from its beginning."""

    def __init__(
        self, dataset: Dataset[_T], num_replicas: int, rank: int, *, shuffle: bool = True,
        seed: int = 0, drop_last: bool = False, epoch: int = 0, start: int = 0,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=drop_last)
        size = len(dataset)  # type: ignore[arg-type]
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= size:
            raise ValueError(
                f"start={start!r}: give the number of samples the job already consumed this "
                f"epoch, from 0 to the dataset's {size} (steps x batch size x replicas)"
            )
        self.epoch = epoch
        self.start_epoch, self.start = epoch, start
        self._resize()

    def _resize(self) -> None:
        left = len(self.dataset) - self._skipped()  # type: ignore[arg-type]
        if self.drop_last:
            self.num_samples = left // self.num_replicas
        else:
            self.num_samples = -(-left // self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def _skipped(self) -> int:
        return self.start if self.epoch == self.start_epoch else 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._resize()

    def __iter__(self) -> Iterator[_T]:
        size = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order: list[Any] = torch.randperm(size, generator=g).tolist()
        else:
            order = list(range(size))
        order = order[self._skipped():]
        if len(order) < self.total_size:  # pad by repeating, as DistributedSampler does
            order += (order * (self.total_size // max(len(order), 1) + 1))[
                : self.total_size - len(order)]
        order = order[: self.total_size]
        return iter(order[self.rank : self.total_size : self.num_replicas])


class ReplicaShare(Sampler[_T]):
    """A replica's share of another sampler's indices: every `num_replicas`-th, from `rank`,
    cut to the same count on every replica (a replica with one more batch would wait for
    the others at its last step)."""

    def __init__(self, sampler: Sampler[_T], num_replicas: int, rank: int) -> None:
        if not isinstance(sampler, Sized):
            raise TypeError(
                f"{type(sampler).__name__} has no len(); every replica must take the same "
                "number of samples: give a sized sampler or the dataset"
            )
        self.sampler, self.num_replicas, self.rank = sampler, num_replicas, rank

    def __len__(self) -> int:
        return len(self.sampler) // self.num_replicas

    def __iter__(self) -> Iterator[_T]:
        for i, index in enumerate(self.sampler):
            if i >= len(self) * self.num_replicas:
                return
            if i % self.num_replicas == self.rank:
                yield index


def replica_sampler(
    data: Dataset[Any] | Sampler[Any], num_replicas: int, rank: int, *, shuffle: bool,
    seed: int, drop_last: bool, epoch: int, start: int,
) -> Sampler[Any]:
    """A `ReplicaSampler` of a dataset, or a `ReplicaShare` of a sampler (whose own order
    then decides; shuffle, seed, epoch and start are the dataset's options)."""
    if isinstance(data, Sampler):
        if start or epoch or shuffle is not True or seed or drop_last:
            raise ValueError(
                "shuffle, seed, drop_last, epoch and start order a dataset; a sampler keeps "
                "its own order: pass the dataset, or drop them"
            )
        return ReplicaShare(data, num_replicas, rank)
    if not isinstance(data, Sized):
        raise TypeError(
            f"{type(data).__name__} has no len(): give a map-style dataset or a sized sampler "
            "(an IterableDataset shards itself: read torch.utils.data.get_worker_info and the "
            "replica index from pipe.distributed.layout)"
        )
    return ReplicaSampler(data, num_replicas, rank, shuffle=shuffle, seed=seed,
                          drop_last=drop_last, epoch=epoch, start=start)
