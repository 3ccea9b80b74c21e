"""Suite-wide test settings."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread() -> Iterator[None]:
    # Pipeline worker threads (and test processes) already use the cores in parallel; torch's
    # own intra-op pool on top oversubscribes the small shared CPU (a 10x slowdown when busy).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
