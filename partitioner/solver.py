"""Balancing algorithms: exact contiguous min-max partitions of a sequence of costs.

Pure functions over numbers (numpy, no torch, no networkx): the graph layer (`plan.py`) turns a
captured graph into per-position arrays and calls these."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

# A vectorised stage cost: cost(stage, end, starts) -> the cost of stage `stage` holding
# positions [start, end) for every start in `starts` (an int array); inf marks "not allowed".
StageCost = Callable[[int, int, np.ndarray], np.ndarray]


def check_stages(stages: object, nodes: int) -> int:
    """Validate a stage count against the number of nodes to split; return it as an int."""
    if isinstance(stages, bool) or not isinstance(stages, int | np.integer):
        raise TypeError(f"stages must be an int, got {stages!r} ({type(stages).__name__})")
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}; pass stages=1 or more")
    if stages > nodes:
        raise ValueError(
            f"cannot split {nodes} nodes into {stages} stages (every stage needs at least one "
            f"node); pass stages <= {nodes}, or capture with fewer leaf modules for more nodes"
        )
    return int(stages)


def min_max_partition(n: int, stages: int, cost: StageCost) -> tuple[list[int], float]:
    """Exact min-max contiguous partition of positions 0..n-1 into `stages` non-empty segments.

    Algorithm: dynamic programming over prefixes, best[k][j] = min over i < j of
    max(best[k-1][i], cost(k, j, i)), vectorised over i: O(n^2 p) work in O(n p) numpy calls.
    Returns (stage sizes, bottleneck); the bottleneck is inf when no partition has all stage
    costs finite (the caller explains why).
    """
    stages = check_stages(stages, n)
    inf = np.inf
    best = np.full((stages + 1, n + 1), inf)
    arg = np.zeros((stages + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for k in range(1, stages + 1):
        # Stage k-1 (0-based) ends at j; the k-1 stages before it need >= k-1 positions and the
        # stages after it need >= stages-k positions.
        for j in range(k, n - (stages - k) + 1):
            starts = np.arange(k - 1, j)
            value = np.maximum(best[k - 1, starts], cost(k - 1, j, starts))
            pick = int(np.argmin(value))
            best[k, j] = value[pick]
            arg[k, j] = starts[pick]
    sizes: list[int] = []
    j = n
    for k in range(stages, 0, -1):
        i = int(arg[k, j])
        sizes.append(j - i)
        j = i
    sizes.reverse()
    return sizes, float(best[stages, n])


def partition_chain(costs: Sequence[float], stages: int) -> list[int]:
    """Split a chain of per-layer `costs` into `stages` contiguous, non-empty stages minimising
    the most expensive stage (exact min-max; dynamic programming over prefix sums, see
    `min_max_partition`). Returns the stage sizes, which sum to len(costs).

    >>> partition_chain([1, 1, 1, 1, 4], 2)
    [4, 1]
    """
    values = np.asarray(costs, dtype=np.float64)
    if values.ndim != 1:
        raise ValueError(f"costs must be a flat sequence of numbers, got shape {values.shape}")
    if not np.all(np.isfinite(values)) or np.any(values < 0):
        raise ValueError(f"costs must be finite and >= 0, got {list(costs)}")
    prefix = np.concatenate(([0.0], np.cumsum(values)))

    def cost(_stage: int, end: int, starts: np.ndarray) -> np.ndarray:
        return prefix[end] - prefix[starts]

    sizes, _ = min_max_partition(len(values), stages, cost)
    return sizes


def evenly(n: int, stages: int) -> list[int]:
    """Equal node counts, the remainder spread over the first stages."""
    stages = check_stages(stages, n)
    base, extra = divmod(n, stages)
    return [base + (1 if k < extra else 0) for k in range(stages)]


def block_partition(costs: Sequence[float], stages: int) -> list[int]:
    """The block-partition heuristic torchgpipe's balance_by_time uses (Barany and Grinberg,
    "Block partitions of sequences"), re-implemented as a benchmark baseline: costs are
    normalised to [0, 1] by min-max scaling, the split starts from equal node counts, and one
    element at a time moves into a smallest block (the one closest to a largest block) from its
    neighbour on the largest block's side, until largest <= smallest + 1 in normalised units.
    Not min-max optimal: the stopping rule tolerates a whole heaviest-node of imbalance."""
    n = len(costs)
    stages = check_stages(stages, n)
    low, span = min(costs), max(costs) - min(costs)
    weights = [(c - low) / span if span > 0 else 0.0 for c in costs]
    prefix = np.concatenate(([0.0], np.cumsum(weights)))
    bounds = [0, *(n // stages * (k + 1) for k in range(stages - 1)), n]

    def sums() -> list[float]:
        return [float(prefix[bounds[k + 1]] - prefix[bounds[k]]) for k in range(stages)]

    largest = int(np.argmax(sums()))
    for _ in range(n * n * stages):  # the paper's procedure terminates; this only bounds it
        block = sums()
        smallest = min(block)
        if max(block) <= smallest + 1:
            break
        q = min((k for k in range(stages) if block[k] == smallest), key=lambda k: abs(k - largest))
        if largest < q:  # move the last element of block h = q-1 into block q
            h = q - 1
            if bounds[q] - 1 <= bounds[h]:
                break  # would empty a stage, which a pipeline cannot have
            bounds[q] -= 1
        else:  # move the first element of block h = q+1 into block q
            h = q + 1
            if bounds[q + 1] + 1 >= bounds[h + 1]:
                break
            bounds[q + 1] += 1
        if h == largest:  # the largest block shrank: pick the largest afresh
            largest = int(np.argmax(sums()))
    return [bounds[k + 1] - bounds[k] for k in range(stages)]
