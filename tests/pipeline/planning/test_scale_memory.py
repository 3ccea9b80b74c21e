"""The working sets the memory model prices on meta tensors are the runtime's: a unit's
split-backward B keeps, until W, what pipeline.execution.split_backward keeps on CPU for the
same module; the head's forward and backward temporaries are its logits and their
gradients; and the walk of a schedule frees each microbatch's activations at its B."""

from __future__ import annotations

import pytest
import torch

from pipeline.execution.split_backward import backward_input
from pipeline.planning.hardware import TARGETS
from pipeline.planning.scale.layout import Job, parse_layout
from pipeline.planning.scale.predict import predict
from pipeline.planning.scale.pricing import price
from pipeline.planning.scale.transformer import Head, block, parse_spec

# Slow set: pricing on meta and the runs on CPU take 3-13 s a case on the shared machine.
pytestmark = pytest.mark.slow

A100 = TARGETS["a100-sxm4-80gb"]
SPEC = parse_spec("llama:layers=4,hidden=32,heads=4,kv_heads=2,vocab=96,seq=16")
MB = 2


def _meta_price(make, *, head: bool = False):
    with torch.device("meta"):
        m = make()
        x = torch.empty(MB, SPEC.seq, SPEC.hidden, requires_grad=True)
        ids = torch.zeros(MB, SPEC.seq, dtype=torch.long)
    return price(m, (x, ids) if head else (x,), A100, SPEC.seq)


def _kept_by_the_runtime(make, *, head: bool = False) -> int:
    torch.manual_seed(0)
    m = make()
    x = torch.randn(MB, SPEC.seq, SPEC.hidden, requires_grad=True)
    ids = torch.randint(0, SPEC.vocab, (MB, SPEC.seq))
    out = m(x, ids) if head else m(x)
    grad = None if out.dim() == 0 else torch.ones_like(out)
    _, work = backward_input([out], [grad], [x], list(m.parameters()))
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for group in work.groups for grads in group.grads for t in grads if t is not None}
    return sum(kept.values())


def test_a_split_b_keeps_what_the_runtime_keeps_for_w() -> None:
    for make, head in ((lambda: block(SPEC), False), (lambda: Head(SPEC), True)):
        meta, runtime = _meta_price(make, head=head), _kept_by_the_runtime(make, head=head)
        # The meta count also sees what else B leaves alive (here at most one hidden-sized
        # activation and a few bytes per token), so it may only be a little above.
        hidden = MB * SPEC.seq * SPEC.hidden * 4
        assert runtime <= meta.kept_for_weight <= runtime + 1.1 * hidden


def test_the_heads_temporaries_are_its_logits_and_their_gradients() -> None:
    logits = MB * SPEC.seq * SPEC.vocab * 4
    head = _meta_price(lambda: Head(SPEC), head=True)
    assert head.forward_extra == logits  # the logits, freed once the log-softmax holds its own
    assert head.backward_extra >= 2 * logits  # the loss's gradient and the logits'


def test_1f1b_peaks_when_its_first_rank_holds_p_microbatches() -> None:
    job = Job(SPEC, A100, 4, 32, "fp32")
    gpipe = predict(job, parse_layout("pp=4,microbatches=8,schedule=gpipe"))
    one = predict(job, parse_layout("pp=4,microbatches=8,schedule=1f1b"))
    # GPipe holds all 8 microbatches before its first backward, 1F1B at most p = 4.
    assert one.memory.activations < gpipe.memory.activations
    first = one.peak_memory[0] - one.memory.weights - one.memory.optimizer
    assert first > 0 and one.peak_memory[0] == max(one.peak_memory)
