"""Shared-memory collectives (algorithm ``"shm"``): every rank reads its peers' buffers.

For a group whose ranks are all on one host (``group.shm.covers``), each rank has two
scratch windows of ``W`` bytes in its segment (``PLAIT_SHM_WINDOW_BYTES``, 2 MiB by
default) that every other rank of the group has mapped. A buffer is processed in windows
of ``W`` bytes, alternating between the two, so one window's copies overlap the peers'
work on the other:

* **all-reduce** (above ``SMALL_BYTES``; below, see :func:`all_reduce`): each rank copies
  its window in; once all have (a signal round), rank k reduces slice k of the window
  (even split) straight from every rank's scratch, in rank order, into its own scratch;
  once all have (a second round), each rank copies every slice out from its owner's
  scratch. One copy in, one reduction, one copy out, no message; every slice is reduced
  by one rank and copied by all, so all ranks end with bitwise the same result.
* **reduce-scatter**: copy in; after the round, rank k reduces the part of its block that
  lies in the window straight into its output.
* **all-gather**: each rank copies its block's part of the window in; after the round,
  every rank copies every other rank's part out.

Signals are per-pair counters in the segment headers (``ShmLink.signal``/``wait_for``):
rank r adds one to its counter for p, p waits until it reaches the number it expects
and, for the rounds above, carries this collective's tag (with the default check the
tag hashes the signature, so ranks that disagree on the collective, size or dtype never
pass a round: no window is read, and the watchdog names the disagreement).
After its copies out a rank signals "released"; before it writes its scratch again it
waits for every peer's release, so no rank overwrites a window another is still reading
(the release is waited for lazily, at the next write, usually long since there).

Bytes counted per rank (``plait.comm.stats()``): ``sent`` is what it copies into its own
window, ``received`` what it reads from the peers' windows. All-reduce of S bytes: sends
S, receives 2(n-1)/n S (the reduction's reads of its slice, the copy out of the others'
slices), as the ring's traffic. Reduce-scatter of S: sends S, receives n-1 times its own
block. All-gather of blocks b_i: sends b_rank, receives the sum of the other blocks.
Blocks on the other ranks for at most the group's timeout; a dead peer is named within
about ``shm.CHECK_S``, a stopped one through the watchdog's heartbeat check.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from plait.comm.chunks import even_counts
from plait.comm.group import Channel
from plait.comm.reduce_op import ReduceOp, combine_
from plait.comm.shm import ShmLink

SMALL_BYTES = 64 << 10


def _link(ch: Channel) -> ShmLink:
    link = ch.group.shm
    if link is None or not link.covers(ch.members):
        raise ValueError(
            f"algorithm 'shm' on group {ch.group.name!r} needs every rank of it on this host "
            f"with the shared-memory transport (PLAIT_TRANSPORT=auto or shm); use 'auto'"
        )
    return link


class _Windows:
    """The scratch windows of the channel's ranks, typed as ``dtype``."""

    def __init__(self, ch: Channel, link: ShmLink, dtype: torch.dtype) -> None:
        self.ch, self.link = ch, link
        self.members = list(ch.members)
        size = torch.empty((), dtype=dtype).element_size()
        offset, window = link.scratch[ch.members[0]]
        self.elems = window // size
        self.views: list[list[torch.Tensor]] = []
        for m in ch.members:
            offset, window = link.scratch[m]
            data = link.segments[m].data
            self.views.append(
                [data[offset + i * window : offset + (i + 1) * window].view(dtype) for i in (0, 1)]
            )
        self.turn = 0

    def mine(self) -> torch.Tensor:
        return self.views[self.ch.rank][self.turn]

    def of(self, rank: int) -> torch.Tensor:
        return self.views[rank][self.turn]

    def acquire(self) -> None:
        """Wait until no peer still reads this rank's current window (their releases of
        its previous use, usually long arrived)."""
        self._wait(self.link.released[self.turn])

    def arrive(self) -> None:
        """Signal every peer and wait for all of them: one round. Signals carry the
        call's tag (its signature under the default check): a peer in another collective
        never counts as arrived, so no rank reads a window meant for something else."""
        tag = self.ch.call.tag
        self.link.signal(self.members, tag)
        self._wait(self.link.expect(self.members), tag)

    def release(self) -> None:
        """Done reading the peers' current windows: they may write them again."""
        self.link.signal(self.members)
        self.link.released[self.turn].update(self.link.expect(self.members))
        self.turn ^= 1

    def _wait(self, targets: dict[int, int], tag: int | None = None) -> None:
        late = self.link.late(targets, tag)
        if not late:
            return
        group = self.ch.group
        # whom this rank waits on, for the watchdog (a stopped or disagreeing peer)
        group.waiting = (group.ranks[late[0]], self.ch.call, time.monotonic())
        try:
            self.link.wait_for(targets, tag)
        except RuntimeError as exc:
            late = self.link.late(targets, tag)
            peer = self.members.index(late[0]) if late and late[0] in self.members else None
            raise self.ch.failure(peer, "wait for", exc) from exc
        finally:
            group.waiting = None


def _spans(total: int, window: int) -> list[tuple[int, int]]:
    return [(o, min(window, total - o)) for o in range(0, total, window)]


def all_reduce(ch: Channel, flat: torch.Tensor, op: ReduceOp) -> None:
    """In-place all-reduce through the scratch windows (see the module docstring).

    Up to ``SMALL_BYTES`` one round suffices: every rank reduces the whole buffer from all
    windows in rank order, the same operations on the same bytes everywhere, so the
    results are bitwise equal without the second round and the copy out (receives
    (n-1) S instead of 2(n-1)/n S: cheap at this size, and half the wake-ups)."""
    link = _link(ch)
    w = _Windows(ch, link, flat.dtype)
    n, r = ch.size, ch.rank
    size = flat.element_size()
    if flat.numel() * size <= SMALL_BYTES and flat.numel() <= w.elems:
        w.acquire()
        w.mine()[: flat.numel()].copy_(flat)
        ch.call.sent += flat.numel() * size
        w.arrive()
        flat.copy_(w.of(0)[: flat.numel()])
        for k in range(1, n):
            combine_(flat, w.of(k)[: flat.numel()], op)
        ch.call.received += (n - 1) * flat.numel() * size
        w.release()
        return
    for start, length in _spans(flat.numel(), w.elems):
        w.acquire()
        w.mine()[:length].copy_(flat[start : start + length])
        ch.call.sent += length * size
        w.arrive()
        counts = even_counts(length, n)
        offsets = [sum(counts[:k]) for k in range(n)]
        lo, hi = offsets[r], offsets[r] + counts[r]
        acc = w.mine()[lo:hi]
        for k in range(n):
            if k != r:
                combine_(acc, w.of(k)[lo:hi], op)
        ch.call.received += (n - 1) * counts[r] * size
        w.arrive()
        for k in range(n):
            lo, hi = offsets[k], offsets[k] + counts[k]
            flat[start + lo : start + hi].copy_(w.of(k)[lo:hi])
            if k != r:
                ch.call.received += counts[k] * size
        w.release()


def reduce_scatter(
    ch: Channel, inputs: list[torch.Tensor], output: torch.Tensor, op: ReduceOp
) -> None:
    """``output = op over ranks of inputs[ch.rank]``, each rank reading its block's part
    of every window straight from the peers' scratch."""
    link = _link(ch)
    w = _Windows(ch, link, output.dtype)
    n, r = ch.size, ch.rank
    size = output.element_size()
    sizes = [t.numel() for t in inputs]
    offsets = [sum(sizes[:k]) for k in range(n)]
    mine_lo, mine_hi = offsets[r], offsets[r] + sizes[r]
    for start, length in _spans(sum(sizes), w.elems):
        w.acquire()
        _copy_in(w.mine(), inputs, offsets, start, length)
        ch.call.sent += length * size
        w.arrive()
        lo, hi = max(start, mine_lo), min(start + length, mine_hi)
        if lo < hi:
            out = output[lo - mine_lo : hi - mine_lo]
            out.copy_(w.mine()[lo - start : hi - start])
            for k in range(n):
                if k != r:
                    combine_(out, w.of(k)[lo - start : hi - start], op)
            ch.call.received += (n - 1) * (hi - lo) * size
        w.release()


def _copy_in(
    scratch: torch.Tensor,
    blocks: Sequence[torch.Tensor],
    offsets: list[int],
    start: int,
    length: int,
) -> None:
    """Copy elements [start, start+length) of the concatenation of ``blocks``."""
    for block, off in zip(blocks, offsets, strict=True):
        lo, hi = max(start, off), min(start + length, off + block.numel())
        if lo < hi:
            scratch[lo - start : hi - start].copy_(block[lo - off : hi - off])


def all_gather(ch: Channel, chunks: list[torch.Tensor]) -> None:
    """Fill every ``chunks[i]`` with rank i's chunk, window by window of the largest."""
    link = _link(ch)
    dtype = chunks[ch.rank].dtype
    w = _Windows(ch, link, dtype)
    n, r = ch.size, ch.rank
    size = chunks[r].element_size()
    longest = max(c.numel() for c in chunks)
    for start, _ in _spans(longest, w.elems):
        w.acquire()
        part = chunks[r][start : start + w.elems]
        w.mine()[: part.numel()].copy_(part)
        ch.call.sent += part.numel() * size
        w.arrive()
        for k in range(n):
            if k != r:
                theirs = chunks[k][start : start + w.elems]
                theirs.copy_(w.of(k)[: theirs.numel()])
                ch.call.received += theirs.numel() * size
        w.release()
