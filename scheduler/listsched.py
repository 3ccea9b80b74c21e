"""Memory-capped list scheduling of split-backward pipelines: build each rank's action order by
running the step forward in time and, whenever a rank is free, starting the ready action its
`Policy` ranks first, without ever holding more in-flight microbatches than the cap allows.

The time model is `scheduler.simulate`'s (an action starts when its rank is free and its inputs
have arrived, a cross-rank input `comm` after its producer ends), so the simulated step of the
order returned equals the makespan computed here. Each (stage, op) runs its microbatches in
increasing order (first in, first out), as every hand-written generator does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.ir import Action, Op

_F, _B, _W = 0, 1, 2
_OPS = (Op.F, Op.B, Op.W)


@dataclass(frozen=True)
class Policy:
    """How a free rank picks among its ready actions.

    `order`: op kinds (0=F, 1=B, 2=W) by priority, e.g. (1, 0, 2) = B first, then F, W last
    (W only fills idle time). `caps[r]`: the most (stage, microbatch) activations rank r may
    hold. `hold_for_b`: do not start an F or W that would still be running when an already
    scheduled B input arrives (keep the backward path, the critical one, clear)."""

    order: tuple[int, int, int]
    caps: tuple[int, ...]
    hold_for_b: bool


_Candidate = tuple[float, int, int, int]  # (available at, op, stage, microbatch)


def list_schedule(
    placement: Sequence[int],
    num_ranks: int,
    microbatches: int,
    cost: Sequence[tuple[float, float, float]],
    comm: float,
    policy: Policy,
) -> list[list[Action]] | None:
    """Each rank's action order under `policy`, or None when the policy paints itself into a
    corner (every rank waiting on memory another rank will never free).

    `cost[s]` = (F, B, W) seconds of stage s. An F of stage s on rank r is started only if the
    rank keeps room for the rest of that microbatch's stages on r: held + 1 + (stages of r
    after s) <= cap, so a microbatch once started on a rank can always finish there.
    """
    state = _Step(placement, num_ranks, microbatches, cost, comm, policy)
    choice = [state.choose(r) for r in range(num_ranks)]
    while any(state.remaining):
        best: tuple[float, int, _Candidate] | None = None
        for r in range(num_ranks):
            c = choice[r]
            if c is not None and (best is None or c[0] < best[0]):
                best = (c[0], r, c[1])
        if best is None:
            return None
        start, r, (_, op, s, k) = best
        state.run(start, r, op, s, k)
        # Only this rank and the ranks of the neighbouring stages see new inputs or memory.
        n = len(placement)
        for t in {r, placement[max(s - 1, 0)], placement[min(s + 1, n - 1)]}:
            choice[t] = state.choose(t) if state.remaining[t] else None
    return state.out


class _Step:
    """The step as scheduled so far: when each action ended, what each rank holds and has left,
    and each rank's action order."""

    def __init__(
        self,
        placement: Sequence[int],
        num_ranks: int,
        microbatches: int,
        cost: Sequence[tuple[float, float, float]],
        comm: float,
        policy: Policy,
    ) -> None:
        n, m = len(placement), microbatches
        self.placement = placement
        self.m = m
        self.cost = cost
        self.comm = comm
        self.policy = policy
        self.stages_of = [[s for s in range(n) if placement[s] == r] for r in range(num_ranks)]
        self.later = [sum(1 for t in self.stages_of[placement[s]] if t > s) for s in range(n)]
        self.end = [[[-1.0] * m for _ in range(3)] for _ in range(n)]  # [s][op][k]; -1 = not yet
        self.next_k = [[0, 0] for _ in range(n)]  # next F and B microbatch of each stage
        self.pending_w: list[list[int]] = [[] for _ in range(n)]
        self.free = [0.0] * num_ranks
        self.held = [0] * num_ranks
        self.remaining = [3 * m * len(self.stages_of[r]) for r in range(num_ranks)]
        self.out: list[list[Action]] = [[] for _ in range(num_ranks)]
        self.rank_of_priority = {op: i for i, op in enumerate(policy.order)}

    def arrival(self, s_from: int, op: int, k: int, s_to: int) -> float:
        """When stage s_from's `op` output for microbatch k reaches s_to (-1: not made yet)."""
        t = self.end[s_from][op][k]
        if t < 0:
            return -1.0
        return t + self.comm if self.placement[s_from] != self.placement[s_to] else t

    def candidates(self, r: int) -> list[_Candidate]:
        """Rank r's actions whose inputs are made."""
        n, m = len(self.placement), self.m
        found = []
        for s in self.stages_of[r]:
            kf, kb = self.next_k[s]
            if kf < m and self.held[r] + 1 + self.later[s] <= self.policy.caps[r]:
                t = 0.0 if s == 0 else self.arrival(s - 1, _F, kf, s)
                if t >= 0:
                    found.append((t, _F, s, kf))
            if kb < kf:
                own = self.end[s][_F][kb]
                t = own if s == n - 1 else self.arrival(s + 1, _B, kb, s)
                if own >= 0 and t >= 0:
                    found.append((max(t, own), _B, s, kb))
            if self.pending_w[s]:
                k = self.pending_w[s][0]
                found.append((self.end[s][_B][k], _W, s, k))
        return found

    def choose(self, r: int) -> tuple[float, _Candidate] | None:
        """(start, action) rank r would run next, or None while it has nothing to start."""
        found = self.candidates(r)
        if not found:
            return None
        ready_at = max(self.free[r], min(c[0] for c in found))
        ready = [c for c in found if c[0] <= ready_at]
        # Same kind: earliest available, then oldest microbatch, then the later stage
        # (it finishes a microbatch and frees the ranks after it sooner).
        pick = min(ready, key=lambda c: (self.rank_of_priority[c[1]], c[0], c[3], -c[2]))
        if self.policy.hold_for_b and pick[1] != _B:
            waiting_b = [c for c in found if c[1] == _B and c[0] > ready_at]
            if waiting_b:
                first_b = min(waiting_b, key=lambda c: (c[0], c[3], -c[2]))
                if ready_at + self.cost[pick[2]][pick[1]] > first_b[0]:
                    pick = first_b
        return max(self.free[r], pick[0]), pick

    def run(self, start: float, r: int, op: int, s: int, k: int) -> None:
        """Schedule `op` of stage s on microbatch k on rank r at `start`."""
        finish = start + self.cost[s][op]
        self.end[s][op][k] = finish
        self.free[r] = finish
        self.remaining[r] -= 1
        self.out[r].append(Action(s, _OPS[op], k))
        if op == _F:
            self.next_k[s][0] += 1
            self.held[r] += 1
        elif op == _B:
            self.next_k[s][1] += 1
            self.pending_w[s].append(k)
        else:
            self.pending_w[s].pop(0)
            self.held[r] -= 1
