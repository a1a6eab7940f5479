"""Pipeline schedules as plain data: an :class:`Action` per step, a list of actions per rank.

A schedule cuts the model into ``S = p * v`` stages (``v`` chunks per rank) and says, for
each of the ``p`` ranks, the order in which it runs:

* ``F``: forward of micro-batch ``mb`` through stage ``stage``;
* ``B``: its whole backward (input and weight gradients);
* ``I`` and ``W``: the backward split in two, as zero-bubble schedules do: ``I`` computes
  the gradient of the stage's *input* (what the previous stage waits for), ``W`` the
  gradients of the stage's *weights* (which nobody waits for, so it can fill a bubble);
* ``SEND_F`` / ``RECV_F``: the activation of ``mb`` leaving stage ``stage`` for ``stage + 1``
  (``SEND_F`` names the sending stage, ``RECV_F`` the receiving one, as in
  ``torch.distributed.pipelining``);
* ``SEND_B`` / ``RECV_B``: the gradient of stage ``stage``'s input going back to
  ``stage - 1`` (again: the sender's stage on ``SEND_B``, the receiver's on ``RECV_B``).

Printed as ``"2F0"`` (stage 2, forward, micro-batch 0) or ``"1SEND_B3"``. A receive only
*posts* a buffer; the compute action that reads it waits for the data. Sends never block
the sender. :mod:`.validate` checks a schedule, :mod:`.simulate` times it, :mod:`.draw`
prints and plots it, :mod:`.runtime` runs it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class Kind(str, enum.Enum):
    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the name the zero-bubble literature uses
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        return self in (Kind.F, Kind.B, Kind.I, Kind.W)

    @property
    def is_comm(self) -> bool:
        return not self.is_compute


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` for micro-batch ``mb`` on stage ``stage``."""

    kind: Kind
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.mb}"

    __repr__ = __str__

    @staticmethod
    def parse(text: str) -> Action:
        """``Action.parse("2F0")``, ``Action.parse("1SEND_B3")``."""
        i = 0
        while i < len(text) and text[i].isdigit():
            i += 1
        j = len(text)
        while j > i and text[j - 1].isdigit():
            j -= 1
        if i == 0 or j == len(text):
            raise ValueError(f"action {text!r}: write <stage><kind><microbatch>, e.g. '2F0'")
        return Action(Kind(text[i:j]), int(text[:i]), int(text[j:]))


def F(stage: int, mb: int) -> Action:
    return Action(Kind.F, stage, mb)


def B(stage: int, mb: int) -> Action:
    return Action(Kind.B, stage, mb)


def I(stage: int, mb: int) -> Action:  # noqa: E741, E743
    return Action(Kind.I, stage, mb)


def W(stage: int, mb: int) -> Action:
    return Action(Kind.W, stage, mb)


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message names the rank, the action and the rule."""


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists for ``p`` ranks, ``m`` micro-batches, ``v`` chunks per rank.

    ``placement[s]`` is the rank that holds stage ``s``; ``ranks[r]`` is rank ``r``'s list.
    ``pairs[r]`` (DualPipe's F&B pairs; empty for other schedules) lists the positions, among
    rank ``r``'s compute actions, of each forward that forms an overlapped pair with the
    backward right after it: the runtime runs the two one after the other, the simulator
    can time them as one unit (``Costs(pair=...)``).
    """

    name: str
    p: int
    m: int
    v: int
    placement: tuple[int, ...]
    ranks: tuple[tuple[Action, ...], ...]
    pairs: tuple[tuple[int, ...], ...] = ()

    @property
    def stages(self) -> int:
        return self.p * self.v

    def stages_of(self, rank: int) -> list[int]:
        """The stages rank ``rank`` holds, in stage order."""
        return [s for s, r in enumerate(self.placement) if r == rank]

    def compute(self, rank: int) -> list[Action]:
        """Rank ``rank``'s compute actions only (no sends/receives)."""
        return [a for a in self.ranks[rank] if a.kind.is_compute]

    @property
    def split_backward(self) -> bool:
        """True when the backward is split into I and W."""
        return any(a.kind in (Kind.I, Kind.W) for acts in self.ranks for a in acts)

    def with_ranks(self, ranks: Sequence[Sequence[Action]]) -> Schedule:
        """The same schedule with other action lists (the compute order, which ``pairs``
        indexes, kept: :func:`~.schedules.add_comms` only inserts messages)."""
        return Schedule(
            self.name,
            self.p,
            self.m,
            self.v,
            self.placement,
            tuple(tuple(a) for a in ranks),
            self.pairs,
        )

    def paired(self, rank: int) -> set[int]:
        """Positions, in rank ``rank``'s compute actions, of forwards that open an F&B pair."""
        return set(self.pairs[rank]) if self.pairs else set()

    def __str__(self) -> str:
        """One line per rank; the forward opening an F&B pair prints with a trailing ``&``
        (``"0F3& 3B1"``)."""
        lines = []
        for r, acts in enumerate(self.ranks):
            opens, k, words = self.paired(r), 0, []
            for a in acts:
                words.append(str(a) + ("&" if a.kind.is_compute and k in opens else ""))
                k += a.kind.is_compute
            lines.append(f"rank {r}: " + " ".join(words))
        return "\n".join(lines)
