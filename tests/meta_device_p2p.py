"""Would a pipeline schedule's messages deadlock on NCCL? A simulation on plain data.

gloo matches a pair's messages by tag and moves each direction independently; NCCL does
not. PyTorch's ProcessGroupNCCL runs every send and receive between two ranks on one
stream per pair, in issue order: a receive posted early occupies that stream until its
data arrives, and every later operation with the same peer (a send included) waits
behind it. Megatron and ``torch.distributed.pipelining`` therefore batch the sends and
receives of one step (``batch_isend_irecv``). This module runs a schedule's action lists
(:func:`plait.strategies.pipeline.schedules.build`) under that rule, with every message
a rendezvous (the worst case: a large activation cannot sit in NCCL's buffers), and
reports whether every action completes.

Two host models: ``blocking`` (each wait a host wait: ``Work.wait(timeout)`` on NCCL) and
``streams`` (waits only order the compute stream: ``Work.wait()`` without a timeout, what
plait's waits do on a device backend). Deadlock on the pair streams is the same in both;
``blocking`` only stops the host issuing while it waits. Streams are keyed by plait's own
rule (:func:`plait.strategies.pipeline.messages.direction`): with ``per_direction`` (what
the pipeline does on device backends) each direction of a pair has its process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.strategies.pipeline.actions import Action, Kind, Schedule
from plait.strategies.pipeline.messages import direction


@dataclass
class _Op:
    rank: int
    action: Action
    deps: list[_Op] = field(default_factory=list)
    done: bool = False


def _peer(schedule: Schedule, a: Action) -> int:
    if a.kind is Kind.SEND_F:
        return schedule.placement[a.stage + 1]
    if a.kind is Kind.SEND_B:
        return schedule.placement[a.stage - 1]
    if a.kind is Kind.RECV_F:
        return schedule.placement[a.stage - 1]
    return schedule.placement[a.stage + 1]  # RECV_B


def _key(a: Action) -> tuple[str, int, int]:
    """A message's identity, the same on the sending and the receiving side."""
    if a.kind is Kind.SEND_F:
        return ("act", a.stage + 1, a.mb)
    if a.kind is Kind.RECV_F:
        return ("act", a.stage, a.mb)
    if a.kind is Kind.SEND_B:
        return ("grad", a.stage - 1, a.mb)
    return ("grad", a.stage, a.mb)  # RECV_B


def stuck(schedule: Schedule, *, blocking: bool = True, per_direction: bool = False) -> list[str]:
    """The actions left unfinished when no operation can progress (empty: none).

    Rank ``r`` issues its actions in order. A send or receive joins the stream of its
    pair (after the compute issued before it); a compute action joins the compute stream
    after the receives it reads (with ``blocking``, the host issues nothing further until
    those receives completed). A send completes together with its matching receive, when
    both are at the head of their pair streams. ``per_direction``: each direction of a
    pair has its own stream (a process group per direction), not one for both."""
    p = schedule.p
    compute: list[list[_Op]] = [[] for _ in range(p)]
    pair: list[dict[tuple[int, int], list[_Op]]] = [{} for _ in range(p)]
    posted: list[dict[tuple[str, int, int], _Op]] = [{} for _ in range(p)]
    issued = [0] * p
    last_compute: list[_Op | None] = [None] * p

    def _stream(r: int, a: Action) -> tuple[int, int]:
        """The stream of rank ``r``'s message: its peer and the process group it takes
        (plait's rule, ``messages.direction``: with ``per_direction`` one group per
        direction of a pair, as the pipeline does on NCCL; else the pair's one group)."""
        peer = _peer(schedule, a)
        sends = a.kind in (Kind.SEND_F, Kind.SEND_B)
        sender, receiver = (r, peer) if sends else (peer, r)
        return (peer, direction(sender, receiver, per_direction=per_direction))

    def reads(r: int, a: Action) -> tuple[str, int, int] | None:
        s = a.stage
        if a.kind is Kind.F and s > 0 and schedule.placement[s - 1] != r:
            return ("act", s, a.mb)
        if a.kind in (Kind.B, Kind.I) and s < schedule.stages - 1:
            if schedule.placement[s + 1] != r:
                return ("grad", s, a.mb)
        return None

    def issue(r: int) -> bool:
        """Issue rank r's next action if the host may; True if it did."""
        acts = schedule.ranks[r]
        if issued[r] >= len(acts):
            return False
        a = acts[issued[r]]
        op = _Op(r, a)
        if last_compute[r] is not None:
            op.deps.append(last_compute[r])  # type: ignore[arg-type]
        if a.kind.is_comm:
            pair[r].setdefault(_stream(r, a), []).append(op)
            if a.kind in (Kind.RECV_F, Kind.RECV_B):
                posted[r][_key(a)] = op
        else:
            need = reads(r, a)
            if need is not None:
                recv = posted[r][need]
                if blocking and not recv.done:
                    return False
                op.deps.append(recv)
            compute[r].append(op)
            last_compute[r] = op
        issued[r] += 1
        return True

    def progress() -> bool:
        moved = False
        for r in range(p):
            q = compute[r]
            while q and all(d.done for d in q[0].deps):
                q.pop(0).done = True
                moved = True
        for r in range(p):
            for (peer, way), q in pair[r].items():
                if not q or q[0].action.kind not in (Kind.SEND_F, Kind.SEND_B):
                    continue
                other = pair[peer].get((r, way), [])  # the receive takes the same group
                s, rv = q[0], (other[0] if other else None)
                if rv is None or _key(rv.action) != _key(s.action):
                    continue
                if all(d.done for d in s.deps) and all(d.done for d in rv.deps):
                    q.pop(0).done = True
                    other.pop(0).done = True
                    moved = True
        return moved

    while True:
        moved = any([issue(r) for r in range(p)])
        moved = progress() or moved
        if not moved:
            break
    left = [f"rank {r}: {a}" for r in range(p) for a in schedule.ranks[r][issued[r] :]]
    left += [f"rank {r}: {op.action}" for r in range(p) for op in compute[r]]
    left += [f"rank {r}: {op.action}" for r in range(p) for q in pair[r].values() for op in q]
    return left
