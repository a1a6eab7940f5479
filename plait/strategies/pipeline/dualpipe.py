"""DualPipeV: DeepSeek's DualPipe cut in half, on ``p`` ranks with two chunks each in a V.

DualPipe (DeepSeek-V3 report, arXiv 2412.19437) feeds micro-batches into a pipeline from
both ends at once and, in its steady state, runs the forward of one micro-batch together
with the backward of another (an "F&B" pair), so that one's communication hides behind
the other's compute. DualPipeV folds that bidirectional pipeline onto half the ranks:
the model is cut into ``2p`` chunk-stages placed as ZBV places them (rank ``r`` holds
stage ``r`` on the way down and stage ``2p - 1 - r`` on the way up, so rank 0 holds the
first and the last stage) and every rank keeps one copy of its parameters.

Rank ``r`` with ``d = r`` (its down chunk) and ``u = 2p - 1 - r`` (its up chunk) runs
eight phases; ``F d`` is a forward of the next micro-batch on ``d``, and so on:

=====  =====================  ==============  ===============================================
phase  actions                times           why
=====  =====================  ==============  ===============================================
1      F d                    2 (p - r - 1)   fill the way down
2      F d, F u               r + 1           the first micro-batches turn at the tip
3      I u, W u, F u          p - r - 1       backward of the up chunk starts (split: the
                                              input gradient goes out before W)
4      F d & B u, F u & B d   m - 2p + r + 1  steady state: two F&B pairs
5      B u, F u & B d         p - r - 1       no new micro-batch on the way down
6      B u, B d               r + 1           the drain; the last r + 1 of these 2 (r + 1)
                                              backwards run as I (their W deferred)
7      W, I d                 p - r - 1       deferred weight gradients fill the gaps
8      W                      r + 1           the rest of them
=====  =====================  ==============  ===============================================

``W`` without a stage runs the oldest deferred weight gradient of the rank. Every phase
count is at least zero when ``m >= 2p - 1``; DualPipeV as published asks ``m >= 2p``,
and plait refuses fewer than ``2p`` micro-batches naming that constraint.

What is and is not reproduced. The order of every rank's actions is DualPipeV's, and so
is its memory: every rank holds at most ``2p + 1`` chunk-micro-batches of activations
(``PP + 1`` with ``PP = 2p`` chunk-stages, as the DualPipe README states; 1F1B's first rank
holds ``p`` whole stages = ``2p`` chunks). The overlap is not: plait runs on one CPU stream,
so an F&B pair (``Schedule.pairs``) is two consecutive actions, the forward then the
backward, costing ``F + B``; the communication of one is not hidden behind the compute of
the other beyond what every plait schedule gets (sends start at once and are waited on at
the end of the step), and the pair's all-to-alls (DeepSeek's MoE) do not exist here.

Bubble. The README gives, per rank, ``(PP/2 - 1)(F&B + B - 3W)`` with ``F``, ``B`` (full
backward), ``W`` the times of one chunk and ``F&B`` that of an overlapped pair. The
simulator reproduces it exactly with ``Costs(pair=1)`` (a pair is one unit that starts when
both of its inputs are there, nothing saved by overlap: ``F&B = F + B``) whenever the
input gradient costs a forward (``I = F``, ``W <= F``; the unit costs are one case):
``(p - 1)(F&B + B - 3W)`` idle on every rank, for any ``m``. As plait's runtime runs a
pair (halves apart, the forward starting as soon as its own input is there) every rank
idles one forward less per ``p - 1``: ``(p - 1)(F&B + B - 3W - F) = (p - 1)(2B - 3W)``;
with unit chunk costs that is ``(p - 1) F``, ZBV's fill. For other cost ratios the
simulator is the reference (the README's expression is then not exact either way).
"""

from __future__ import annotations

from collections import deque

from plait.strategies.pipeline.actions import Action, B, F, I, Schedule, ScheduleError, W
from plait.strategies.pipeline.schedules import _check, v_placement


def dualpipev(p: int, m: int, v: int = 2) -> Schedule:
    """DualPipeV for ``p`` ranks and ``m >= 2p`` micro-batches, two chunks per rank in a V
    (module docstring: phases, bubble, memory, what the overlap reduces to on one stream)."""

    _check("dualpipev", p, m, v)
    if v != 2:
        raise ScheduleError(
            f"dualpipev: chunks={v}; DualPipeV places exactly 2 chunks per rank in a V (chunks=2)"
        )
    if m < 2 * p:
        raise ScheduleError(
            f"dualpipev: microbatches={m} < 2p = {2 * p} chunk-stages; DualPipeV fills the "
            f"way down with 2p micro-batches before its steady state, so use at least "
            f"{2 * p} (or 'zbv', which takes any m)"
        )
    built = [_rank(p, m, r) for r in range(p)]
    return Schedule(
        "dualpipev",
        p,
        m,
        2,
        v_placement(p),
        tuple(acts for acts, _ in built),
        tuple(pairs for _, pairs in built),
    )


def _rank(p: int, m: int, r: int) -> tuple[tuple[Action, ...], tuple[int, ...]]:
    """Rank ``r``'s actions, phase by phase (module docstring's table), and the positions
    of the forwards that open an F&B pair."""
    d, u = r, 2 * p - 1 - r
    acts: list[Action] = []
    pairs: list[int] = []
    nxt_f = {d: 0, u: 0}  # next micro-batch to forward, per chunk
    nxt_b = {d: 0, u: 0}  # next micro-batch to backward
    deferred: deque[Action] = deque()  # W of micro-batches whose I ran, oldest first

    def fwd(s: int) -> None:
        acts.append(F(s, nxt_f[s]))
        nxt_f[s] += 1

    def bwd(s: int, *, split: bool = False) -> None:
        mb = nxt_b[s]
        nxt_b[s] += 1
        if split:
            acts.append(I(s, mb))
            deferred.append(W(s, mb))
        else:
            acts.append(B(s, mb))

    def weight() -> None:
        acts.append(deferred.popleft())

    def pair(f: int, b: int, *, overlapped: bool = True) -> None:
        """F on ``f`` then B on ``b``; an F&B pair unless ``overlapped`` is False."""
        if overlapped:
            pairs.append(len(acts))
        fwd(f)
        bwd(b)

    for _ in range(2 * (p - r - 1)):  # 1
        fwd(d)
    for _ in range(r + 1):  # 2
        fwd(d)
        fwd(u)
    for _ in range(p - r - 1):  # 3
        bwd(u, split=True)
        weight()
        fwd(u)
    for k in range(m - 2 * p + r + 1):  # 4
        # the tip's first F d and B u are no pair, as in DualPipe: apart, the forward need
        # not wait for the backward's gradient, which shortens the fill
        pair(d, u, overlapped=not (k == 0 and r == p - 1))
        pair(u, d)
    for _ in range(p - r - 1):  # 5
        bwd(u)
        pair(u, d)
    for k in range(2 * (r + 1)):  # 6: alternately u, d; the second half split
        bwd(u if k % 2 == 0 else d, split=k >= r + 1)
    for _ in range(p - r - 1):  # 7
        weight()
        bwd(d, split=True)
    for _ in range(r + 1):  # 8
        weight()
    assert not deferred and all(n == m for n in (*nxt_f.values(), *nxt_b.values()))
    return tuple(acts), tuple(pairs)
