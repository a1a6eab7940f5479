"""The shared-memory transport: point-to-point messages between ranks of one host.

Each rank of a group that has peers on its host maps one file of ``/dev/shm`` (its
*segment*, made by ``transport.py`` at group creation) and the segments of those peers.
A segment holds:

* a header: magic, a random token, the owner's pid, an abort word (set when this rank's
  collective on the group failed), a doorbell (a 32-bit futex word peers bump when they
  gave this rank something to do), a "sleeping" word, and one signal counter per group
  rank (``signal``/``wait_signals`` below, used by ``shm_collectives.py``);
* one ring buffer per local peer, for the messages *that peer sends to this rank*: a head
  (bytes the sender wrote, written only by the sender), a tail (bytes the receiver
  consumed, written only by the receiver), each on its own cache line, and ``ring_bytes``
  of data;
* two windows of scratch for the shared-memory collectives (``shm_collectives.py``).

Every byte of a segment is reserved (``posix_fallocate``) when it is made, so a
directory without room fails at group creation naming it and its free bytes, never with
a SIGBUS at the first touch of a page later.

A message is a 64-byte header (tag, byte count) followed by its bytes, padded to 64. The
sender copies as much as fits, publishes the new head, and rings the receiver's bell;
the receiver copies out what arrived, publishes the new tail, and rings the sender's
bell (the space it freed). Both copies are torch ``copy_`` calls on tensors viewing the
mapping. A receive matches the next message from that peer whose tag it expects; a
message whose receive is not posted yet waits in the ring (and the messages behind it
with it: messages between two ranks are delivered in order, as a collective sends them).
Counters are 8-byte aligned stores, which x86-64 performs atomically and in program
order (total store order): a receiver that sees a head also sees the bytes before it.
``transport.py`` only turns this transport on for x86-64.

Progress is cooperative: ``isend``/``irecv`` queue the operation and move what they can
at once; every wait moves every queued operation of the group (so two ranks that each
wait on a send never deadlock on full rings). A wait spins for ``SPIN_S``, then sleeps on
its doorbell with ``futex`` (one syscall through ctypes), in slices of at most
``SLICE_S``; every ``CHECK_S`` it checks the group timeout, the watchdog's verdict
(``group.failure``), the peers' abort words and whether the awaited peers' processes
still exist, and raises ``RuntimeError`` with the reason (``Channel.failure`` turns that
into the named error).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from plait.comm.group import Group

MAGIC = 0x31736D7469616C70  # b"plaitsm1"
MSG_HEADER = 64
RING_CTRL = 128  # head at +0, tail at +64
ALIGN = 64
SPIN_S = 50e-6  # spin this long, then sleep (PLAIT_SHM_SPIN_US, set by plait.init)
SLICE_S = 0.01
CHECK_S = 0.05

# header layout (byte offsets)
_Q_MAGIC, _Q_TOKEN, _Q_PID, _Q_ABORT = 0, 1, 2, 3
_I_BELL, _I_SLEEPING = 16, 32  # int32 indices: bytes 64 and 128
# signals to group rank p at _SIGNALS + 128 * p: the count (int64), then the tags of the
# last TAGS signals (signal m's tag at slot m % TAGS; a sender is never more than three
# signals ahead of what its peer checks)
_SIGNALS = 256
TAGS = 8


def _up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def header_bytes(size: int) -> int:
    return _up(_SIGNALS + 128 * size, 4096)


def layout(size: int, peers: int, ring_bytes: int, window_bytes: int) -> tuple[int, int, int]:
    """(first ring offset, ring stride, scratch offset) and, implied, the segment size
    ``scratch offset + 2 * window_bytes`` (window_bytes 0: no scratch)."""
    first = header_bytes(size)
    stride = RING_CTRL + ring_bytes
    return first, stride, first + peers * stride


# --- futex --------------------------------------------------------------------------------
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # not the _PRIVATE forms: the word is shared between processes


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True) if _SYS_FUTEX is not None else None


def futex_wait(addr: int, expected: int, seconds: float) -> None:
    """Sleep while the 32-bit word at ``addr`` holds ``expected`` (at most ``seconds``);
    the GIL is released meanwhile. Spurious returns are fine: callers re-check."""
    if _libc is None:
        time.sleep(min(seconds, 0.001))
        return
    ts = _Timespec(int(seconds), int((seconds % 1) * 1e9))
    _libc.syscall(
        _SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_int(expected), ctypes.byref(ts)
    )


def futex_wake(addr: int) -> None:
    if _libc is not None:
        _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, ctypes.c_int(1 << 30))


# --- segments -----------------------------------------------------------------------------
class Segment:
    """One mapped segment file: ``data`` (uint8 tensor) and ``q``/``i`` (int64/int32 views)."""

    def __init__(self, path: str, size: int, *, create: bool) -> None:
        self.path = path
        self.size = size
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                # every byte is reserved now, scratch windows included: a directory too
                # small (several ranks, several groups) fails here, naming it, and one
                # that another process fills later cannot take the pages back, where a
                # sparse file would end in SIGBUS at the first touch of a missing page
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    raise OSError(exc.errno, no_room(path, size, exc)) from exc
            elif os.fstat(fd).st_size < size:
                raise RuntimeError(f"{path}: {os.fstat(fd).st_size} bytes, expected {size}")
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.data = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.q = memoryview(self.mm).cast("q")
        self.i = memoryview(self.mm).cast("i")
        self.addr = self.data.data_ptr()

    def bell_addr(self) -> int:
        return self.addr + 4 * _I_BELL

    def ring(self) -> None:
        """Tell this segment's owner it has something to do (wake it if it sleeps)."""
        self.i[_I_BELL] = (self.i[_I_BELL] + 1) & 0x7FFFFFFF
        if self.i[_I_SLEEPING]:
            futex_wake(self.bell_addr())

    def close(self) -> None:
        self.q.release()
        self.i.release()
        del self.data
        try:
            self.mm.close()
        except BufferError:  # a tensor view is still alive somewhere: the GC unmaps it
            pass


def no_room(path: str, size: int, exc: OSError) -> str:
    """Why a segment of ``size`` bytes could not be reserved in ``path``'s directory, with
    the directory's free and total bytes."""
    directory = os.path.dirname(path)
    try:
        st = os.statvfs(directory)
        room = f"{st.f_bavail * st.f_frsize:,} bytes free of {st.f_blocks * st.f_frsize:,}"
    except OSError:
        room = "free space unknown"
    return (
        f"{directory}: could not reserve {size:,} bytes for a shared-memory segment "
        f"({room}; {exc.strerror or exc}); enlarge {directory} (docker: --shm-size), point "
        f"PLAIT_SHM_DIR elsewhere, shrink PLAIT_SHM_WINDOW_BYTES/PLAIT_SHM_RING_BYTES, or use "
        f"PLAIT_TRANSPORT=gloo"
    )


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed child its parent did not reap)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


# --- operations ---------------------------------------------------------------------------
class ShmOp:
    """One queued send or receive of ``nbytes`` bytes under ``tag``."""

    __slots__ = ("buf", "nbytes", "padded", "tag", "done", "started", "finished", "end")

    def __init__(self, tensor: torch.Tensor, tag: int) -> None:
        self.buf = tensor.view(-1).view(torch.uint8)
        self.nbytes = self.buf.numel()
        self.padded = _up(self.nbytes, ALIGN)
        self.tag = tag
        self.done = 0
        self.started = False
        self.finished = False
        self.end = 0  # a send's ring position after its last byte, once written


class _Out:
    """This rank's sending side of the ring in a peer's segment."""

    __slots__ = ("seg", "hq", "tq", "base", "cap", "head", "queue")

    def __init__(self, seg: Segment, offset: int, cap: int) -> None:
        self.seg, self.cap = seg, cap
        self.hq, self.tq, self.base = offset // 8, (offset + 64) // 8, offset + RING_CTRL
        self.head = seg.q[self.hq]
        self.queue: deque[ShmOp] = deque()


class _In:
    """This rank's receiving side of the ring a peer writes into (in this rank's segment)."""

    __slots__ = ("seg", "hq", "tq", "base", "cap", "tail", "posted", "current")

    def __init__(self, seg: Segment, offset: int, cap: int) -> None:
        self.seg, self.cap = seg, cap
        self.hq, self.tq, self.base = offset // 8, (offset + 64) // 8, offset + RING_CTRL
        self.tail = seg.q[self.tq]
        self.posted: list[ShmOp] = []
        self.current: ShmOp | None = None


class ShmLink:
    """A group's shared-memory endpoint on this rank: its segment and its local peers'.

    ``peers`` maps group rank -> (segment, pid, ring offset of this rank's ring in it)
    and ``inbound`` group rank -> ring offset in this rank's segment. Built by
    ``transport.attach``.
    """

    def __init__(
        self,
        group: Group,
        mine: Segment,
        peers: dict[int, tuple[Segment, int, int]],
        inbound: dict[int, int],
        ring_bytes: dict[int, int],
        scratch: dict[int, tuple[int, int]],
    ) -> None:
        self.group = group
        self.mine = mine
        self.segments = {r: s for r, (s, _, _) in peers.items()}
        self.segments[group.rank] = mine
        self.pids = {r: pid for r, (_, pid, _) in peers.items()}
        self.outs = {r: _Out(s, off, ring_bytes[r]) for r, (s, _, off) in peers.items()}
        self.ins = {r: _In(mine, off, ring_bytes[group.rank]) for r, off in inbound.items()}
        self.scratch = scratch  # group rank -> (offset, window bytes), local ranks only
        self.expected = {r: 0 for r in peers}  # signals counted from each peer so far
        # per scratch window: the signal counts that mean "every peer released it"
        self.released: list[dict[int, int]] = [{}, {}]
        self.lock = threading.Lock()
        self.closed = False

    # --- who is reached -------------------------------------------------------------------
    def reaches(self, group_rank: int) -> bool:
        return group_rank in self.outs

    def covers(self, members: Sequence[int]) -> bool:
        """Every rank of ``members`` (group ranks) is on this host, with scratch windows."""
        return all(m in self.scratch for m in members)

    # --- point to point -------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> ShmOp:
        op = ShmOp(tensor, tag)
        self.outs[peer].queue.append(op)
        self.progress()
        return op

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> ShmOp:
        op = ShmOp(tensor, tag)
        self.ins[peer].posted.append(op)
        self.progress()
        return op

    def busy(self) -> bool:
        """Some queued operation still needs this rank to move it."""
        return any(o.queue for o in self.outs.values()) or any(
            i.posted or i.current for i in self.ins.values()
        )

    def progress(self) -> bool:
        """Move every queued operation as far as the rings allow; True if anything moved."""
        moved = False
        with self.lock:
            for peer, out in self.outs.items():
                if out.queue and self._push(out):
                    moved = True
                    self.segments[peer].ring()
            for peer, inbound in self.ins.items():
                if (inbound.posted or inbound.current) and self._pull(inbound):
                    moved = True
                    self.segments[peer].ring()  # space freed: the sender may wait for it
        return moved

    def _push(self, out: _Out) -> bool:
        seg, cap, q = out.seg, out.cap, out.seg.q
        head = out.head
        free = cap - (head - q[out.tq])
        while out.queue and free > 0:
            op = out.queue[0]
            if not op.started:
                if free < MSG_HEADER:
                    break
                at = (out.base + head % cap) // 8
                q[at], q[at + 1] = op.tag, op.nbytes
                head += MSG_HEADER
                free -= MSG_HEADER
                op.started = True
            while op.done < op.padded and free > 0:
                pos = head % cap
                k = min(free, op.padded - op.done, cap - pos)
                real = min(k, op.nbytes - op.done)
                if real > 0:
                    start = out.base + pos
                    seg.data[start : start + real].copy_(op.buf[op.done : op.done + real])
                head += k
                op.done += k
                free -= k
            if op.done < op.padded:
                break
            op.finished = True
            op.end = head
            out.queue.popleft()
        if head == out.head:
            return False
        out.head = head
        q[out.hq] = head  # publish after the bytes (x86-64 keeps store order)
        return True

    def _pull(self, inbound: _In) -> bool:
        seg, cap, q = inbound.seg, inbound.cap, inbound.seg.q
        tail = inbound.tail
        avail = q[inbound.hq] - tail
        while avail > 0:
            op = inbound.current
            if op is None:
                if avail < MSG_HEADER:
                    break
                at = (inbound.base + tail % cap) // 8
                tag, nbytes = q[at], q[at + 1]
                op = next((o for o in inbound.posted if o.tag == tag), None)
                if op is None:  # its receive is not posted (yet): leave it in the ring
                    break
                if nbytes != op.nbytes:
                    raise RuntimeError(
                        f"message size mismatch: the peer sent {nbytes} bytes under tag "
                        f"{tag}, this rank expected {op.nbytes}"
                    )
                inbound.posted.remove(op)
                inbound.current = op
                tail += MSG_HEADER
                avail -= MSG_HEADER
            while op.done < op.padded and avail > 0:
                pos = tail % cap
                k = min(avail, op.padded - op.done, cap - pos)
                real = min(k, op.nbytes - op.done)
                if real > 0:
                    start = inbound.base + pos
                    op.buf[op.done : op.done + real].copy_(seg.data[start : start + real])
                tail += k
                op.done += k
                avail -= k
            if op.done < op.padded:
                break
            op.finished = True
            inbound.current = None
        if tail == inbound.tail:
            return False
        inbound.tail = tail
        q[inbound.tq] = tail
        return True

    def wait(self, op: ShmOp, peer: int) -> None:
        """Block until ``op`` is done, moving every queued operation meanwhile."""

        def ready() -> bool:
            if op.finished:
                return True
            self.progress()
            return op.finished

        self.block(ready, [peer])

    def wait_taken(self, op: ShmOp, peer: int) -> None:
        """Block until ``peer`` has read a finished send ``op`` out of the ring (a user's
        ``send`` returns when it is received, as over gloo, not when it is buffered)."""
        out = self.outs[peer]

        def ready() -> bool:
            self.progress()
            return bool(out.seg.q[out.tq] >= op.end)

        self.block(ready, [peer])

    def poll_until(self, done: Callable[[], bool], peer: int | None) -> None:
        """Block until ``done()`` (a backend operation), moving queued shm operations."""

        def ready() -> bool:
            self.progress()
            return done()

        self.block(ready, [] if peer is None else [peer], sleep=True)

    # --- signals (shm_collectives.py) ----------------------------------------------------
    def signal(self, members: Sequence[int], tag: int = 0) -> None:
        """Add one to this rank's signal counter for each of ``members`` (group ranks),
        recording ``tag`` (the collective's) with it."""
        q = self.mine.q
        for p in members:
            if p != self.group.rank:
                at = (_SIGNALS + 128 * p) // 8
                count = q[at] + 1
                q[at + 1 + count % TAGS] = tag
                q[at] = count
        for p in members:
            if p != self.group.rank:
                self.segments[p].ring()

    def expect(self, members: Sequence[int]) -> dict[int, int]:
        """Count one more signal to come from each of ``members``; returns the counts
        to wait for (peer -> count)."""
        for p in members:
            if p != self.group.rank:
                self.expected[p] += 1
        return {p: self.expected[p] for p in members if p != self.group.rank}

    def late(self, targets: dict[int, int], tag: int | None = None) -> list[int]:
        """The peers whose signal counter for this rank is below its target, or whose
        target signal carries another tag than ``tag`` (another collective: it never
        counts, and the watchdog names the disagreement)."""
        at = (_SIGNALS + 128 * self.group.rank) // 8
        out = []
        for p, want in targets.items():
            q = self.segments[p].q
            if q[at] < want or (tag is not None and q[at + 1 + want % TAGS] != tag):
                out.append(p)
        return out

    def wait_for(self, targets: dict[int, int], tag: int | None = None) -> None:
        """Block until every peer's signal counter for this rank reaches its target."""
        if not self.late(targets, tag):
            return
        self.block(lambda: not self.late(targets, tag), [], targets=targets)

    # --- waiting --------------------------------------------------------------------------
    def block(
        self,
        ready: Callable[[], bool],
        peers: Sequence[int],
        *,
        sleep: bool = False,
        targets: dict[int, int] | None = None,
    ) -> None:
        """Spin, then sleep on this rank's doorbell, until ``ready()``.

        Raises ``RuntimeError`` when the group's timeout passes (the text says "timed
        out"), when the watchdog ended the collective, when a peer aborted, or when an
        awaited peer's process (``peers``, or the first late one of ``targets``) is gone.
        """
        if ready():
            return
        group, mine = self.group, self.mine
        start = time.monotonic()
        deadline, next_check = start + group.timeout, start + CHECK_S
        spin_until = time.perf_counter() + SPIN_S
        nap = 1e-4
        while True:
            if ready():
                return
            if time.perf_counter() < spin_until:
                os.sched_yield()  # a peer runnable on this core runs now, not after the spin
                continue
            bell = mine.i[_I_BELL]
            mine.i[_I_SLEEPING] = 1
            if ready():
                mine.i[_I_SLEEPING] = 0
                return
            if sleep:  # a backend operation rings no bell: poll it
                time.sleep(nap)
                nap = min(nap * 2, 2e-3)
            else:
                futex_wait(mine.bell_addr(), bell, SLICE_S)
            mine.i[_I_SLEEPING] = 0
            spin_until = time.perf_counter() + SPIN_S
            now = time.monotonic()
            if now >= next_check:
                next_check = now + CHECK_S
                watched = list(peers) if targets is None else self.late(targets)[:1]
                self.check(watched, now >= deadline)

    def check(self, peers: Sequence[int], expired: bool) -> None:
        group = self.group
        if group.failure is not None:
            raise RuntimeError(f"ended by the watchdog: {group.failure}")
        for r, seg in self.segments.items():
            culprit = seg.q[_Q_ABORT]
            if r != group.rank and culprit:
                raise RuntimeError(
                    f"rank {group.ranks[r]} aborted its collectives on this group (it "
                    f"failed waiting on rank {culprit - 1}); no more data will come from it"
                )
        for p in peers:
            if p in self.pids and not pid_alive(self.pids[p]):
                raise RuntimeError(
                    f"the process of rank {group.ranks[p]} (pid {self.pids[p]}) exited"
                )
        if expired:
            raise RuntimeError(f"timed out after {group.timeout:g}s (shared memory)")

    def abort(self, culprit: int | None) -> None:
        """Mark this group failed on this rank, so that every peer's wait ends now."""
        if self.closed or self.mine.q[_Q_ABORT]:
            return
        self.mine.q[_Q_ABORT] = (self.group.global_rank if culprit is None else culprit) + 1
        for r, seg in self.segments.items():
            if r != self.group.rank:
                seg.ring()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.outs.clear()
        self.ins.clear()
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()
