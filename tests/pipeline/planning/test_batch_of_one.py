"""A batch of one row plans without torch.export's warnings reaching the user (once its batch
dim was captured from a size-1 sample: "specialized; Dim.AUTO was specified along with a sample
input with hint = 1", and a later batch of another size was captured again): the batch dim is
captured from that row twice, so it stays dynamic. The step equals the unsplit model; a later
batch of three rows runs on the same capture."""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from torch.nn import functional as F

from pipeline import Pipeline
from pipeline.app.models import GPT


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("given", ["first batch", "example_input"])
def test_a_batch_of_one_plans_without_export_warnings(
        given: str, capfd: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    model = GPT(vocab=32, dim=16, layers=2, heads=2, max_seq=8).double()
    ref = copy.deepcopy(model)
    x = torch.randint(0, 32, (1, 8))
    handler = _Records()
    torch_log = logging.getLogger("torch")
    torch_log.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe = Pipeline(model, 2, loss_fn=_loss,
                            example_input=x if given == "example_input" else None)
            loss = pipe.step(x, x)
    finally:
        torch_log.removeHandler(handler)
    err = capfd.readouterr().err
    assert "specialized" not in err and "Dim.AUTO" not in err, err
    assert [str(w.message) for w in caught] == []
    assert [r.getMessage() for r in handler.records] == []
    want = _loss(ref(x), x)
    torch.testing.assert_close(loss, want, atol=1e-12, rtol=0)
    captured = pipe.captured
    x3 = torch.randint(0, 32, (3, 8))
    torch.testing.assert_close(
        pipe.step(x3, x3),
        sum(_loss(ref(xm), xm) * len(xm) / 3 for xm in x3.tensor_split(pipe.microbatches)),
        atol=1e-12, rtol=0)
    assert pipe.captured is captured  # the batch dim stayed dynamic: no second capture
