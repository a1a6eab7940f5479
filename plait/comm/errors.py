"""Errors raised by plait's communication layer.

Each message names the group, the collective, its sequence number on that group, the
ranks involved and what to change.
"""

from __future__ import annotations


class CollectiveError(RuntimeError):
    """A collective could not complete (a peer died, the transport failed)."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective waited past its timeout for ranks that did not arrive.

    ``missing`` holds the global ranks that had not reached this collective.
    """

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


class PeerUnresponsive(CollectiveError):
    """A collective waited on a rank whose heartbeat stopped (a frozen or stopped process,
    an unreachable host) for longer than the heartbeat timeout.

    ``ranks`` holds the global ranks that stopped beating.
    """

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


class CollectiveMismatch(CollectiveError, ValueError):
    """Ranks of a group called different collectives, ops, sizes or dtypes, or one skipped
    a collective the others called (checked by default; in more detail in debug mode).

    ``disagreeing`` holds the global ranks whose signature differs from the majority.
    """

    def __init__(self, message: str, disagreeing: list[int]) -> None:
        super().__init__(message)
        self.disagreeing = disagreeing
