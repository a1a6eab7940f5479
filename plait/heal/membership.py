"""Who trains now: generations of members agreed through the rendezvous store.

A healing job has ``world`` slots (its full size, a power of two in reproducible mode).
A *generation* is a numbered set of live slots. Generation ``n + 1`` is agreed when
generation ``n`` fails (a collective raised because a member died, froze past the heartbeat
or raised) or when replacements ask to join at a step boundary:

1. each survivor checks in under ``plait/heal/gen<n+1>/in/<slot>`` with the number of steps
   it has completed;
2. it waits until every slot it expects (the old members and the admitted joiners) has
   either checked in or is dead: it left (``plait/heal/left/<slot>``, written by a rank whose
   own code raised) or its heartbeat (``plait/heartbeat/<slot>``, beaten every 0.5 s by
   the progress thread) is older than ``heartbeat_timeout``. A live but slow rank (still
   in its step) keeps beating, so it is waited for, not dropped;
3. it proposes the decision with ``compare_set`` on ``plait/heal/gen<n+1>/decided``: the
   first proposal wins, every rank reads the same one. The decision names the members, the
   steps completed by the state everyone continues from (the largest checked in: a rank
   that finished the interrupted step before the failure reached it is ahead by one), the
   slot that sends that state and the slots that must receive it.

A rank left out of a decision it did not take part in (it froze past the heartbeat and
woke up) raises :class:`Excluded` naming its slot and the generation.

With ``replica_size = P > 1`` (whole model-parallel replicas, :mod:`.replicas`) slots come
in replicas of ``P`` (slots ``rP .. rP+P-1``) and membership is decided per replica: a
replica one slot of which is dead is out whole (its other slots are not waited for, and
raise :class:`Excluded` if they check in), a replica whose slots all checked in is in.

Nothing here moves tensors: the store only carries these small decisions.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from plait.comm import progress

KEY = "plait/heal"
POLL_S = 0.05


class Excluded(RuntimeError):
    """This rank was judged dead by the others (it froze past the heartbeat timeout)."""


@dataclass(frozen=True)
class Generation:
    """One agreed membership: ``members`` (slots, sorted) train from the state after
    ``done`` steps, which ``source`` holds and sends to ``receivers``."""

    number: int
    members: tuple[int, ...]
    done: int
    source: int
    receivers: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps(
            {
                "number": self.number,
                "members": list(self.members),
                "done": self.done,
                "source": self.source,
                "receivers": list(self.receivers),
            }
        )

    @staticmethod
    def from_json(text: str | bytes) -> Generation:
        d = json.loads(text)
        return Generation(
            d["number"], tuple(d["members"]), d["done"], d["source"], tuple(d["receivers"])
        )


class Membership:
    """This slot's view of the job's membership, through ``store`` (a TCPStore client).

    ``heartbeat_timeout``: seconds without a beat after which a slot counts as dead;
    ``timeout``: the longest any agreement may take before it raises."""

    def __init__(
        self,
        store: Any,
        *,
        slot: int,
        world: int,
        heartbeat_timeout: float,
        timeout: float,
        replica_size: int = 1,
    ) -> None:
        if not 0 <= slot < world:
            raise ValueError(f"healing: slot {slot} is not in 0..{world - 1} (world={world})")
        self.store = store
        self.slot = slot
        self.world = world
        self.replica_size = replica_size
        self.heartbeat_timeout = heartbeat_timeout
        self.timeout = timeout
        self._joins_seen = 0
        # host and pid published now: a process killed before its progress thread's first
        # beat is still found dead by pid at once, not after the heartbeat timeout
        self.beat()

    # --- state of other slots ----------------------------------------------------------
    def beat(self) -> None:
        """Beat this slot's heartbeat now (while no progress thread runs yet); the first
        beat also publishes this process's host and pid."""
        progress.beat(self.slot)

    def dead(self, slot: int, since: float) -> bool:
        """``slot`` left, a replacement asks to take it (so the process that held it is
        gone; the replacement beats under the same key), or it has not beaten for
        ``heartbeat_timeout`` (a slot that never beat: for that long since ``since``)."""
        if self.store.check([f"{KEY}/join/{slot}"]) or self._left(slot):
            return True
        if self._gone_here(slot):
            return True
        key = progress.heartbeat_key(slot)
        now = time.time()
        if not self.store.check([key]):
            return now - since > self.heartbeat_timeout
        return now - float(self.store.get(key).decode()) > self.heartbeat_timeout

    def _left(self, slot: int) -> bool:
        """The process now holding ``slot`` said it stops (a ``left`` key written by an
        earlier process of the slot, one that froze and woke up after its replacement
        joined, does not count: the key names the pid that wrote it)."""
        key = f"{KEY}/left/{slot}"
        if not self.store.check([key]):
            return False
        where = progress.where_key(slot)
        if not self.store.check([where]):
            return True
        return self.store.get(key).decode() == self.store.get(where).decode().split(" ")[1]

    def _gone_here(self, slot: int) -> bool:
        """``slot``'s process ran on this host and has exited (no need to wait for its
        heartbeat to go stale): its pid is gone or a zombie."""
        key = progress.where_key(slot)
        if not self.store.check([key]):
            return False
        host, pid = self.store.get(key).decode().split(" ")[:2]
        if host != socket.gethostname() or pid == str(os.getpid()):
            return False
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, ValueError):
            return False
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except OSError:
            return False

    def leave(self) -> None:
        """Say that this slot stops (its own code raised): the others drop it at once."""
        try:
            self.store.set(f"{KEY}/left/{self.slot}", str(os.getpid()))
        except Exception:
            pass

    # --- agreement ---------------------------------------------------------------------
    def agree(
        self,
        number: int,
        expected: tuple[int, ...],
        done: int,
        *,
        wait_all: bool = False,
        propose: bool = True,
    ) -> Generation:
        """Check in for generation ``number`` with ``done`` completed steps and return the
        decision. ``expected``: the slots that may be members (old members and admitted
        joiners). Blocks until every expected slot checked in or is dead (at most
        ``timeout``); ``wait_all`` (the first generation: processes still starting do not
        beat yet) waits for every one. Raises :class:`Excluded` if the decision leaves this
        slot out. ``propose=False`` (a replacement, which cannot judge the others) only
        waits for the members' decision."""
        base = f"{KEY}/gen{number}"
        self.store.set(f"{base}/in/{self.slot}", str(done))
        start = time.time()
        decided = f"{base}/decided"
        while True:
            if self.store.check([decided]):
                return self._accept(Generation.from_json(self.store.get(decided)))
            present: dict[int, int] = {}
            undecided, dead = [], set()
            for s in expected:
                if self.store.check([f"{base}/in/{s}"]):
                    present[s] = int(self.store.get(f"{base}/in/{s}").decode())
                elif wait_all or not self.dead(s, start):
                    undecided.append(s)
                else:
                    dead.add(s)
            if self.replica_size > 1:  # a replica with a dead slot is out, whole
                lost = {s // self.replica_size for s in dead}
                undecided = [s for s in undecided if s // self.replica_size not in lost]
                present = {s: d for s, d in present.items() if s // self.replica_size not in lost}
            if propose and not undecided:
                if not present:
                    raise RuntimeError(
                        f"healing: slot {self.slot}: generation {number}: every replica lost "
                        f"a rank (dead: slots {sorted(dead)}); nothing is left to train"
                    )
                proposal = _decide(number, present)
                won = self.store.compare_set(decided, "", proposal.to_json())
                return self._accept(Generation.from_json(won))
            if time.time() - start > self.timeout:
                raise TimeoutError(
                    f"healing: slot {self.slot}: generation {number} was not agreed within "
                    f"{self.timeout:.0f} s: slots {undecided} neither checked in nor stopped "
                    f"beating (raise the healing timeout if they are only slow)"
                )
            self.beat()
            time.sleep(POLL_S)

    def _accept(self, gen: Generation) -> Generation:
        if self.slot not in gen.members and self.replica_size > 1:
            raise Excluded(
                f"healing: slot {self.slot} is not a member of generation {gen.number} "
                f"(members {list(gen.members)}): its replica (slots "
                f"{self._replica_slots()}) lost a rank, so the whole replica leaves; start "
                f"the replica again as a replacement"
            )
        if self.slot not in gen.members:
            raise Excluded(
                f"healing: slot {self.slot} is not a member of generation {gen.number} "
                f"(members {list(gen.members)}): the others judged it dead (it did not beat "
                f"for {self.heartbeat_timeout} s); start it again as a replacement"
            )
        self.store.set(f"{KEY}/current", gen.to_json())
        return gen

    def _replica_slots(self) -> list[int]:
        first = self.slot - self.slot % self.replica_size
        return list(range(first, first + self.replica_size))

    # --- growing back ------------------------------------------------------------------
    def request_join(self) -> None:
        """Ask to join at the next step boundary (a replacement's first call)."""
        self.beat()
        self.store.delete_key(f"{KEY}/left/{self.slot}")  # the process that left is gone
        self.store.set(f"{KEY}/join/{self.slot}", "1")
        self.store.add(f"{KEY}/join/count", 1)

    def pending_joins(self, members: tuple[int, ...]) -> int:
        """A bit mask of the slots that asked to join and are not members (the leader
        asks once per step: one store round trip while nobody asks)."""
        count = self.store.add(f"{KEY}/join/count", 0)
        if count == self._joins_seen:
            return 0
        mask = 0
        for s in range(self.world):
            if s not in members and self.store.check([f"{KEY}/join/{s}"]):
                mask |= 1 << s
        if mask == 0:
            self._joins_seen = count
        return mask

    def admit(self, joiners: tuple[int, ...], number: int) -> None:
        """Tell each joiner the generation it joins (the leader, after the step)."""
        for s in joiners:
            self.store.delete_key(f"{KEY}/join/{s}")
            self.store.set(f"{KEY}/admitted/{s}", str(number))  # kept: see wait_for_replacements
            self.store.set(f"{KEY}/admit/{s}", str(number))

    def wait_admitted(self) -> int:
        """A joiner's wait for its generation number (beating meanwhile)."""
        key = f"{KEY}/admit/{self.slot}"
        start = time.time()
        while not self.store.check([key]):
            if self.store.check([f"{KEY}/finished"]):
                raise RuntimeError(
                    f"healing: replacement slot {self.slot}: the job finished training before "
                    f"it could join"
                )
            if time.time() - start > self.timeout:
                raise TimeoutError(
                    f"healing: replacement slot {self.slot} was not admitted within "
                    f"{self.timeout:.0f} s: no live member reached a step boundary (is the "
                    f"job still training, and is this its store?)"
                )
            self.beat()
            time.sleep(POLL_S)
        number = int(self.store.get(key).decode())
        self.store.delete_key(key)
        return number

    def wait_for_replacements(self, members: tuple[int, ...], timeout: float) -> None:
        """Block until every slot not in ``members`` has a replacement asking to join, or
        had one admitted since it was lost (it died on arrival), at most ``timeout`` s
        (raises naming the missing slots). Reads the store only."""
        missing = [s for s in range(self.world) if s not in members]
        start = time.monotonic()

        def number(key: str) -> int:
            return int(self.store.get(key).decode()) if self.store.check([key]) else -1

        def tried(s: int) -> bool:  # asking now, or one was admitted since s was lost
            if self.store.check([f"{KEY}/join/{s}"]):
                return True
            return number(f"{KEY}/admitted/{s}") > number(f"{KEY}/lost/{s}")

        while not all(tried(s) for s in missing):
            if time.monotonic() - start > timeout:
                raise TimeoutError(
                    f"healing: slot {self.slot}: no replacement asked to join for slots "
                    f"{missing} within {timeout:.0f} s (start one with PLAIT_HEAL_JOIN=1, "
                    f"docs/healing.md)"
                )
            time.sleep(POLL_S)

    def finish(self) -> None:
        """Say that training is over (a member that finished): replacements stop waiting."""
        self.store.set(f"{KEY}/finished", "1")

    def current(self) -> Generation | None:
        key = f"{KEY}/current"
        return Generation.from_json(self.store.get(key)) if self.store.check([key]) else None


def _decide(number: int, present: dict[int, int]) -> Generation:
    """The decision from the check-ins: every present slot is a member; the state is the
    most advanced one, sent by the lowest slot holding it to every slot behind it."""
    done = max(present.values())
    members = tuple(sorted(present))
    source = min(s for s in members if present[s] == done)
    receivers = tuple(s for s in members if present[s] < done)
    return Generation(number, members, done, source, receivers)


def heal_record(
    kind: str, old: Generation, new: Generation, *, at_step: int, start: float,
    cause: BaseException | None,
) -> dict[str, Any]:  # fmt: skip
    """One entry of a trainer's ``heals``: ``kind`` ("shrink" or "grow") from ``old`` to
    ``new`` at ``at_step``, ``seconds`` since ``start`` (``time.perf_counter``), the wall
    time it ``ended`` and its ``cause`` (the first line of the error, "" for a grow)."""
    text = "" if cause is None else str(cause)
    return {
        "kind": kind,
        "from": list(old.members),
        "to": list(new.members),
        "seconds": time.perf_counter() - start,
        "at_step": at_step,
        "ended": time.time(),
        "cause": ""
        if cause is None
        else f"{type(cause).__name__}: {text.splitlines()[0] if text else ''}",
    }


def mark_lost(store: Any, old: Generation | None, new: Generation) -> None:
    """Record, for each slot of ``old`` missing from ``new``, the generation that lost it
    (``plait/heal/lost/<slot>``: what ``wait_for_replacements`` compares with)."""
    if old is None:
        return
    for s in old.members:
        if s not in new.members:
            store.set(f"{KEY}/lost/{s}", str(new.number))
