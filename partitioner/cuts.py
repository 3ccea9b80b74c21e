"""What crosses each cut of a captured graph: the live range of every value along the graph's
topological order, and from it the bytes and tensor-ness of each possible cut."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from partitioner.captured import Captured


@dataclass(frozen=True)
class Span:
    """A value defined at position `start` (-1 for a model input) and last used at position
    `end` (n for the model's output). It crosses cut c (between positions c-1 and c) when
    start < c <= end."""

    name: str
    start: int
    end: int
    bytes: int
    tensor: bool


def spans(captured: Captured) -> list[Span]:
    """Live ranges, over the graph's units, of every value that would have to be sent across
    a cut, in definition order. get_attr values (parameters, constants) are re-read and
    symbolic sizes re-derived by each stage that uses them, so they never cross; values used
    only inside their own unit never cross either."""
    n = len(captured.order)
    unit_of = captured.unit_of
    result: list[Span] = []
    for node in captured.graph_module.graph.nodes:
        if node.op in ("output", "get_attr") or node.name in captured.recompute:
            continue
        start = -1 if node.op == "placeholder" else unit_of[node.name]
        uses = [
            n if u.op == "output" else unit_of[u.name] for u in node.users if u.name in unit_of
            or u.op == "output"
        ]
        value = captured.values[node.name]
        result.append(Span(node.name, start, max(uses, default=start), value.bytes, value.tensor))
    return result


def live_at(all_spans: list[Span], cut: int) -> list[Span]:
    """Values crossing cut `cut`, in definition order (the order stages pass them on)."""
    return [s for s in all_spans if s.start < cut <= s.end]


def cut_arrays(all_spans: list[Span], n: int) -> tuple[np.ndarray, np.ndarray]:
    """For every cut 0..n: the bytes crossing it, and whether everything crossing is a tensor
    (cuts are only allowed there). Difference arrays over the live ranges: O(n + values)."""
    size = np.zeros(n + 2)
    bad = np.zeros(n + 2, dtype=np.int64)
    for s in all_spans:
        if s.end > s.start:
            size[s.start + 1] += s.bytes
            size[s.end + 1] -= s.bytes
            if not s.tensor:
                bad[s.start + 1] += 1
                bad[s.end + 1] -= 1
    return np.cumsum(size)[: n + 1], np.cumsum(bad)[: n + 1] == 0
