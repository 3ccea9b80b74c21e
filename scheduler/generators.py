"""Schedule generators: pure functions of (ranks, microbatches, virtual stages) that return each
rank's ordered Actions, and the `SCHEDULES` registry behind `build_schedule`.

Generators write compute order only; communication is derived by `scheduler.lowering`.
Drawings below use the text form: rows are ranks, "1B0" is stage 1's backward of microbatch 0.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from scheduler.ir import Action, Op, Schedule

F, B, W = Op.F, Op.B, Op.W
Generator = Callable[[int, int, int], Schedule]


def _schedule(
    name: str,
    num_ranks: int,
    num_stages: int,
    num_mb: int,
    placement: list[int],
    actions: list[list[Action]],
    splits_backward: bool,
) -> Schedule:
    return Schedule(
        num_ranks=num_ranks,
        num_stages=num_stages,
        num_microbatches=num_mb,
        placement=tuple(placement),
        actions=tuple(tuple(acts) for acts in actions),
        splits_backward=splits_backward,
        name=name,
    )


def _one_virtual_stage(name: str, virtual_stages: int) -> None:
    if virtual_stages != 1:
        raise ValueError(
            f"{name} runs one stage per rank; got virtual_stages={virtual_stages}. Use "
            "virtual_stages=1, or 'interleaved-1f1b' (v >= 2) / 'zbv' (always 2) for more"
        )


def _fb_order(rank_warmup: int, m: int) -> list[tuple[Op, int]]:
    """One rank's 1F1B order: `rank_warmup` forwards, then F/B pairs, then the remaining Bs."""
    warm = min(rank_warmup, m)
    order: list[tuple[Op, int]] = [(F, k) for k in range(warm)]
    for k in range(m):
        if warm + k < m:
            order.append((F, warm + k))
        order.append((B, k))
    return order


def gpipe(ranks: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """GPipe (fill-drain): every forward, then every backward, in microbatch order.

    p=2, m=3::

        0F0 0F1 0F2 0B0 0B1 0B2
        1F0 1F1 1F2 1B0 1B1 1B2

    Unit costs (F=1, B=2): step 3(m+p-1), bubble (p-1)/(m+p-1), m activations held per rank.
    """
    _one_virtual_stage("gpipe", virtual_stages)
    acts = [
        [Action(r, F, k) for k in range(microbatches)]
        + [Action(r, B, k) for k in range(microbatches)]
        for r in range(ranks)
    ]
    return _schedule("gpipe", ranks, ranks, microbatches, list(range(ranks)), acts, False)


def one_f_one_b(ranks: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """1F1B (PipeDream-Flush): rank i runs p-i-1 warm-up forwards, then alternates F and B,
    then drains its Bs. Peak held activations on rank i: min(p-i, m).

    p=2, m=3::

        0F0 0F1 0B0 0F2 0B1 0B2
        1F0 1B0 1F1 1B1 1F2 1B2

    Unit costs: same step time and bubble as GPipe for m >= p, with far less memory.
    """
    return _flush_1f1b("1f1b", ranks, microbatches, virtual_stages, lambda r: ranks - r - 1)


def _flush_1f1b(
    name: str, ranks: int, microbatches: int, virtual_stages: int, warmup: Callable[[int], int]
) -> Schedule:
    """A one-stage-per-rank 1F1B whose rank r runs `warmup(r)` warm-up forwards."""
    _one_virtual_stage(name, virtual_stages)
    acts = [
        [Action(r, op, k) for op, k in _fb_order(warmup(r), microbatches)] for r in range(ranks)
    ]
    return _schedule(name, ranks, ranks, microbatches, list(range(ranks)), acts, False)


def eager_1f1b(ranks: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """1F1B with one more warm-up forward on every rank but the last (p-i on rank i < p-1;
    the last rank's backward needs nobody): each activation leaves one slot before the next
    rank needs it, so a transfer's latency L is hidden where 1F1B pays about L per
    microbatch in its steady state (its next forward is sent only after the backward that
    waits on the next rank). Peak held activations on rank i < p-1: min(p-i+1, m), one more
    than 1F1B.

    p=2, m=4::

        0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
        1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3

    Unit costs without latency: the same step time as 1F1B.
    """
    return _flush_1f1b(
        "1f1b-eager", ranks, microbatches, virtual_stages,
        lambda r: ranks - r if r < ranks - 1 else 0,
    )


def interleaved_1f1b(ranks: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. SC21): v chunks per rank, stage s on
    rank s % p. Microbatches go in groups of p; within a group each chunk runs the whole group
    before the next chunk. Rank i warms up with 2(p-i-1) + (v-1)p chunk-forwards, then
    alternates F and B, then drains. Needs m a multiple of p (Megatron's constraint; the
    grouping assumes full groups).

    p=2, m=2, v=2 (stages 0,2 on rank 0; 1,3 on rank 1)::

        0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1
        1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1

    Unit costs per chunk: bubble (p-1)/(v*m+p-1).
    """
    p, m, v = ranks, microbatches, virtual_stages
    if v < 2:
        raise ValueError(
            f"interleaved-1f1b needs virtual_stages >= 2, got {v}; use '1f1b' for one stage "
            "per rank"
        )
    if m % p != 0:
        raise ValueError(
            f"interleaved-1f1b needs microbatches a multiple of ranks (got microbatches={m}, "
            f"ranks={p}); use microbatches={max(p, m - m % p)} or {m + p - m % p}"
        )
    total = v * m

    def fwd(r: int, k: int) -> Action:
        chunk = (k // p) % v
        return Action(chunk * p + r, F, (k // (p * v)) * p + k % p)

    def bwd(r: int, k: int) -> Action:
        chunk = v - 1 - (k // p) % v
        return Action(chunk * p + r, B, (k // (p * v)) * p + k % p)

    acts = []
    for r in range(p):
        warm = min(2 * (p - r - 1) + (v - 1) * p, total)
        order = [fwd(r, k) for k in range(warm)]
        for k in range(total):
            if warm + k < total:
                order.append(fwd(r, warm + k))
            order.append(bwd(r, k))
        acts.append(order)
    placement = [s % p for s in range(v * p)]
    return _schedule("interleaved-1f1b", p, v * p, m, placement, acts, False)


def _with_lagging_weights(order: list[tuple[Op, int]], stage: int, lag: int) -> list[Action]:
    """Insert W(k) right after the B that is `lag` backwards later than B(k); the last `lag`
    Ws go to the tail, where they fill the drain bubble."""
    out: list[Action] = []
    done_b = done_w = 0
    for op, k in order:
        out.append(Action(stage, op, k))
        if op is B:
            done_b += 1
            if done_b - done_w > lag:
                out.append(Action(stage, W, done_w))
                done_w += 1
    last = max((k for _, k in order), default=-1)
    out.extend(Action(stage, W, k) for k in range(done_w, last + 1))
    return out


def zb_h1(ranks: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """ZB-H1 (Zero Bubble, Qi et al. ICLR 2024): backward split into B (input grad) and W
    (weight grad). Rank i keeps 1F1B's F/B order (p-i forwards before its first B) and lets
    its Ws lag i backwards behind its Bs, leaving its last i Ws for the drain: the last rank,
    whose Bs are on the critical path, defers the most.

    p=2, m=3::

        0F0 0F1 0B0 0W0 0F2 0B1 0W1 0B2 0W2
        1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1W2

    With F=1, B=2, W=1 and m >= p the step is m(F+B+W) + (p-1)(F+B-W) = 4m + 2(p-1)
    (checked by simulation in the tests). With m < p one microbatch's dependency chain sets
    the step instead: 4m + 2(p-1) + (p-m). Peak held activations: min(p, m) on every rank
    (rank i's p-i forwards in flight plus the i it keeps until their lagging Ws).
    """
    _one_virtual_stage("zb-h1", virtual_stages)
    acts = [
        _with_lagging_weights(_fb_order(ranks - r - 1, microbatches), r, r) for r in range(ranks)
    ]
    return _schedule("zb-h1", ranks, ranks, microbatches, list(range(ranks)), acts, True)


def zb_h2(ranks: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """ZB-H2 (Qi et al.): rank i fills the warm-up bubble with forwards, 2(p-i-1) warm-up
    forwards where 1F1B runs p-i-1, then alternates F and B with its Ws lagging 2i backwards
    behind its Bs (the rest fill the drain).

    p=2, m=3::

        0F0 0F1 0F2 0B0 0W0 0B1 0W1 0B2 0W2
        1F0 1B0 1F1 1B1 1F2 1B2 1W0 1W1 1W2

    With F=1, B=2, W=1 and m >= 2p-1 the step is m(F+B+W) + (p-1)(F+B-2W) = 4m + (p-1), the
    lower bound (the last rank cannot start before (p-1)F and then has m(F+B+W) of work).
    With m < 2p-1 the warm-up cannot fill and the step is 4m + (p-1) + (2p-1-m). Peak held
    activations: min(2p-1, m) on every rank.
    """
    _one_virtual_stage("zb-h2", virtual_stages)
    acts = [
        _with_lagging_weights(_fb_order(2 * (ranks - r - 1), microbatches), r, 2 * r)
        for r in range(ranks)
    ]
    return _schedule("zb-h2", ranks, ranks, microbatches, list(range(ranks)), acts, True)


def _zbv_rank(p: int, m: int, r: int) -> list[Action]:
    """Rank r's ZB-V order (phases as in `zbv`'s docstring); each stage's F, B and W each run
    their microbatches in increasing order, so only the (stage, op) sequence is chosen here."""
    c0, c1 = r, 2 * p - 1 - r
    out: list[Action] = []
    count = {(c, op): 0 for c in (c0, c1) for op in (F, B, W)}

    def emit(stage: int, op: Op) -> None:
        out.append(Action(stage, op, count[(stage, op)]))
        count[(stage, op)] += 1

    for _ in range(2 * (p - r) - 1):
        emit(c0, F)
    for _ in range(r):
        emit(c1, F)
        emit(c0, F)
    for _ in range(p - r):
        emit(c1, F)
        emit(c1, B)
        emit(c1, W)
    while count[(c1, F)] < count[(c0, F)] or count[(c0, F)] < m:
        if count[(c0, F)] < m:
            emit(c0, F)
        for stage in (c0, c1):
            if stage == c1:
                emit(c1, F)
            emit(stage, B)
            emit(stage, W)
    for _ in range(r):
        emit(c0, B)
        emit(c1, B)
    for _ in range(p - r):
        emit(c0, B)
        emit(c0, W)
    for stage in (c1, c0):
        while count[(stage, W)] < m:
            emit(stage, W)
    return out


def zbv(ranks: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """ZB-V (Qi et al.): two chunks per rank in a V, rank r holds stages r and 2p-1-r, so the
    forward runs down the ranks and back up, and the loss stage sits on rank 0 next to stage 0.
    Per rank: 2(p-r)-1 chunk-0 forwards; r pairs (chunk-1 F, chunk-0 F); p-r triples
    (chunk-1 F, B, W); then the steady pattern (chunk-0 F, B, W, chunk-1 F, B, W); then r
    pairs of Bs (chunk 0, chunk 1) and p-r (chunk-0 B, W); then the deferred Ws. Needs
    m >= 2p-1 microbatches so the warm-up can fill.

    p=2, m=3 (stages 0,3 on rank 0; 1,2 on rank 1)::

        0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0B0 0W0 3F2 3B2 3W2 0B1 0W1 0B2 0W2
        1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1B1 2B2 1B2 1W1 2W2 1W2

    Unit costs, each chunk half a stage (F=B=W=0.5):

    * Lower bound: rank p-1 cannot start before the first microbatch's forward has crossed
      p-1 chunks, (p-1)/2, and it then has m x 2 chunks x (F+B+W) = 3m of work, so any
      schedule needs step >= 3m + (p-1)/2.
    * This order reaches it: step_time == 3m + (p-1)/2 exactly (asserted for p in 2..8 and
      m in 2p-1..32), i.e. bubble (p-1) / (6m + p - 1).
    * Memory: after warm-up rank r holds (2p-r-1) chunk-0 + r chunk-1 activations; each
      chunk-1 F in the third phase adds one before its W frees one, so the peak is 2p chunk
      activations on every rank, the same as 1F1B's rank 0 in bytes (each chunk is half a
      stage), and balanced across ranks.
    """
    if virtual_stages != 2:
        raise ValueError(
            f"zbv always places 2 chunks per rank; got virtual_stages={virtual_stages}, "
            "use virtual_stages=2"
        )
    p, m = ranks, microbatches
    if m < 2 * p - 1:
        raise ValueError(
            f"zbv needs microbatches >= 2*ranks-1 = {2 * p - 1} (got {m}) to fill its "
            f"warm-up; use microbatches >= {2 * p - 1} or a schedule such as 'zb-h1'"
        )
    acts = [_zbv_rank(p, m, r) for r in range(p)]
    return _schedule("zbv", p, 2 * p, m, _v_placement(p), acts, True)


def _v_placement(ranks: int) -> list[int]:
    """The V: stage s on rank s for the first half, on rank 2p-1-s for the second."""
    return [s if s < ranks else 2 * ranks - 1 - s for s in range(2 * ranks)]


def _dualpipev_rank(p: int, m: int, r: int) -> list[Action]:
    """Rank r's DualPipeV order (phases as in `dualpipev`'s docstring). A "full" backward is B
    with its W right after it; an input-only B leaves its W in a queue that later phases drain
    oldest first."""
    c0, c1 = r, 2 * p - 1 - r
    out: list[Action] = []
    done = {(c, op): 0 for c in (c0, c1) for op in (F, B)}
    deferred: deque[Action] = deque()

    def forward(stage: int) -> None:
        out.append(Action(stage, F, done[(stage, F)]))
        done[(stage, F)] += 1

    def backward(stage: int, full: bool) -> None:
        k = done[(stage, B)]
        done[(stage, B)] += 1
        out.append(Action(stage, B, k))
        if full:
            out.append(Action(stage, W, k))
        else:
            deferred.append(Action(stage, W, k))

    def weight() -> None:
        if deferred:
            out.append(deferred.popleft())

    for _ in range(2 * (p - r - 1)):
        forward(c0)
    for _ in range(r + 1):
        forward(c0)
        forward(c1)
    for _ in range(p - r - 1):
        backward(c1, full=False)
        weight()
        forward(c1)
    for _ in range(m - 2 * p + r + 1):
        # Overlapped pairs (forward of one chunk with the full backward of the other).
        forward(c0)
        backward(c1, full=True)
        forward(c1)
        backward(c0, full=True)
    for _ in range(p - r - 1):
        backward(c1, full=True)
        forward(c1)
        backward(c0, full=True)
    half = (r + 1) // 2
    for i in range(r + 1):
        # The second half of the cool-down defers its Ws (zero bubble); odd ranks switch
        # one backward earlier than even ones, so neighbours' deferred Ws interleave.
        backward(c1, full=i < half or (i == half and r % 2 == 0))
        backward(c0, full=i < half)
    for _ in range(p - r - 1):
        weight()
        backward(c0, full=False)
    while deferred:
        weight()
    return out


def dualpipev(ranks: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe folded onto the V placement of ZB-V, as
    torch.distributed.pipelining's ScheduleDualPipeV): rank r holds stages r and 2p-1-r.
    Per rank (chunk 0 = its descending stage, chunk 1 = its ascending one):

    1. 2(p-r-1) chunk-0 forwards, then r+1 pairs (chunk-0 F, chunk-1 F);
    2. p-r-1 times: chunk-1 B (input grad), its W, chunk-1 F (zero-bubble warm-up);
    3. steady state, m-2p+r+1 times: chunk-0 F + chunk-1 full backward, then chunk-1 F +
       chunk-0 full backward. DualPipe overlaps each F with the other chunk's backward (one
       hides the other's communication); here each pair is written as adjacent actions
       F, B, W, and a full backward is a B with its W right after it;
    4. p-r-1 times: chunk-1 full backward, chunk-1 F, chunk-0 full backward;
    5. r+1 pairs of backwards (chunk 1, chunk 0), the second half input-only with their Ws
       deferred; then p-r-1 times (one deferred W, chunk-0 B), then the remaining Ws.

    Needs m >= 2p microbatches (one per stage, as torch's).

    p=2, m=4 (stages 0,3 on rank 0; 1,2 on rank 1)::

        0F0 0F1 0F2 3F0 3B0 3W0 3F1 0F3 3B1 3W1 3F2 0B0 0W0 3B2 3W2 3F3 0B1 0W1 3B3 3W3 0B2 0W2 0B3 0W3
        1F0 2F0 1F1 2F1 1F2 2B0 2W0 2F2 1B0 1W0 1F3 2B1 2W1 2F3 1B1 1W1 2B2 2W2 1B2 1W2 2B3 1B3 2W3 1W3

    Unit costs, each chunk half a stage (F=B=W=0.5): step_time == 3m + (p-1)/2, ZB-V's lower
    bound (asserted for p in 2..6, m in 2p..4p); peak 2p+1 chunk activations per rank, one
    more than ZB-V. Its edge over ZB-V on real hardware is the F/B overlap of phase 3, which
    a sequential rank does not model: simulated, the two tie at uniform costs.
    """  # noqa: E501 - the drawing is one line per rank
    if virtual_stages != 2:
        raise ValueError(
            f"dualpipev always places 2 chunks per rank; got virtual_stages={virtual_stages}, "
            "use virtual_stages=2"
        )
    p, m = ranks, microbatches
    if m < 2 * p:
        raise ValueError(
            f"dualpipev needs microbatches >= 2*ranks = {2 * p} (got {m}), one per stage; use "
            f"microbatches >= {2 * p} or 'zbv' (>= {2 * p - 1})"
        )
    acts = [_dualpipev_rank(p, m, r) for r in range(p)]
    return _schedule("dualpipev", p, 2 * p, m, _v_placement(p), acts, True)


SCHEDULES: dict[str, Generator] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "1f1b-eager": eager_1f1b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
    "zbv": zbv,
    "dualpipev": dualpipev,
}

_DEFAULT_VIRTUAL = {"interleaved-1f1b": 2, "zbv": 2, "dualpipev": 2}


def build_schedule(
    name: str, ranks: int, microbatches: int, virtual_stages: int | None = None
) -> Schedule:
    """Build the named schedule for `ranks` pipeline ranks and `microbatches` microbatches.

    `virtual_stages` (stages per rank) defaults to 1, or to 2 for 'interleaved-1f1b' and 'zbv'.
    Unknown names and impossible sizes raise ValueError saying what is allowed.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    for what, value in (("ranks", ranks), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{what} must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"{what} must be >= 1, got {value}")
    v = _DEFAULT_VIRTUAL.get(name, 1) if virtual_stages is None else virtual_stages
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"virtual_stages must be an int, got {v!r}")
    return SCHEDULES[name](ranks, microbatches, v)
