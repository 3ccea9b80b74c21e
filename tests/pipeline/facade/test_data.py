"""Each replica's share of the data (pipe.replica_sampler, pipeline.facade.data): torch's
DistributedSampler's indices when nothing is skipped, disjoint shares covering the epoch,
an epoch resumed under another replica count, a sampler's share, and the bad inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DistributedSampler, SequentialSampler, TensorDataset

from pipeline.api import Pipeline
from pipeline.facade.data import ReplicaSampler, replica_sampler

DATA = TensorDataset(torch.arange(23))


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_same_indices_as_torch(shuffle: bool, drop_last: bool) -> None:
    for rank in range(3):
        ours = ReplicaSampler(DATA, 3, rank, shuffle=shuffle, seed=5, drop_last=drop_last)
        torch_s = DistributedSampler(DATA, 3, rank, shuffle=shuffle, seed=5, drop_last=drop_last)
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            torch_s.set_epoch(epoch)
            assert list(ours) == list(torch_s) and len(ours) == len(torch_s)


def test_resume_under_another_layout() -> None:
    """Two replicas take 3 steps of 2 samples each; the job restarts with 3 replicas: the rest
    of the epoch is dealt among them, nothing seen twice or skipped (the last shares padded)."""
    epoch = 4
    order = list(ReplicaSampler(DATA, 1, 0, seed=1, epoch=epoch))
    before = [list(ReplicaSampler(DATA, 2, r, seed=1, epoch=epoch))[:6] for r in range(2)]
    seen = {i for share in before for i in share}
    assert seen == set(order[:12])
    after = [ReplicaSampler(DATA, 3, r, seed=1, epoch=epoch, start=12) for r in range(3)]
    rest = [i for share in after for i in share]
    assert set(rest) == set(order[12:]) and len(rest) == 12  # 11 left, padded to 3 x 4
    assert [len(s) for s in after] == [4, 4, 4]
    for s in after:  # the next epoch starts from its beginning
        s.set_epoch(epoch + 1)
    whole = [i for s in after for i in s]
    assert set(whole) == set(range(23)) and len(whole) == 24


def test_share_of_a_sampler() -> None:
    shares = [list(replica_sampler(SequentialSampler(range(10)), 3, r, shuffle=True, seed=0,
                                   drop_last=False, epoch=0, start=0)) for r in range(3)]
    assert shares == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]


def test_one_process_pipeline_gets_everything() -> None:
    pipe = Pipeline(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), stages=2)
    sampler = pipe.replica_sampler(DATA, shuffle=False)
    assert list(sampler) == list(range(23))


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="start=30"):
        ReplicaSampler(DATA, 2, 0, start=30)
    with pytest.raises(ValueError, match="a sampler keeps its own order"):
        replica_sampler(SequentialSampler(range(4)), 2, 0, shuffle=True, seed=0,
                        drop_last=False, epoch=0, start=4)
    with pytest.raises(TypeError, match="no len"):
        replica_sampler(iter([1]), 2, 0, shuffle=True, seed=0,  # type: ignore[arg-type]
                        drop_last=False, epoch=0, start=0)
