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


def pytest_collection_finish(session: pytest.Session) -> None:
    """When the selected tests launch processes (slow tests of a file that imports `launch`),
    the launches' fork server starts now, in the background: its imports (torch, hybridpipe,
    the Hugging Face modeling modules, its warm-up; seconds of one core) overlap the
    single-process tests that run first, on the core they leave free, instead of holding up
    the first launch. A run of -m "not slow" starts none."""
    from tests.support import distributed

    if any(item.get_closest_marker("slow") is not None  # every launching test is slow
           and getattr(getattr(item, "module", None), "launch", None) is distributed.launch
           for item in session.items):
        distributed.start_server()
