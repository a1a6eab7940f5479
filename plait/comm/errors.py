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


class CollectiveMismatch(CollectiveError, ValueError):
    """Ranks of a group called different collectives, shapes or dtypes (debug mode).

    ``disagreeing`` holds the global ranks whose signature differs from the majority.
    """

    def __init__(self, message: str, disagreeing: list[int]) -> None:
        super().__init__(message)
        self.disagreeing = disagreeing
