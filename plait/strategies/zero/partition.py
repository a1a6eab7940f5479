"""The ZeRO partition as plain data: which rank owns which elements of which parameter.

The trainable parameters are laid end to end in one flat index space of S elements, in
param-group order and, within a group, in the group's order. Rank r owns the contiguous
range ``[lo_r, hi_r)``; range sizes differ by at most one element, and a large tensor is
split across ranks rather than assigned whole. Parameter groups are contiguous stretches
of the flat space, so a rank's range is cut at group boundaries into one sub-range per
group (possibly empty): that is the local optimizer's parameter for the group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from plait.comm.chunks import even_counts
from plait.strategies.data_parallel.buckets import FIRST_BUCKET_BYTES


class Piece(NamedTuple):
    """Elements ``[start, stop)`` of parameter number ``param`` (flattened)."""

    param: int
    start: int
    stop: int


def shard_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """``[lo_r, hi_r)`` of every rank in a flat index space of ``numel`` elements; the
    first ``numel % world_size`` ranks hold one element more."""
    bounds, lo = [], 0
    for count in even_counts(numel, world_size):
        bounds.append((lo, lo + count))
        lo += count
    return bounds


def offsets_of(numels: Sequence[int]) -> list[int]:
    """``[0, n0, n0 + n1, ...]``: where each parameter starts in the flat space."""
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    return offsets


def partition(numels: Sequence[int], world_size: int) -> list[list[Piece]]:
    """The pieces of parameters each rank owns, rank by rank.

    The parameters (``numels`` elements each) are concatenated; rank r owns the flat
    range ``shard_bounds(sum(numels), world_size)[r]``, cut at parameter boundaries into
    pieces. E.g. ``partition([6, 3], 2)`` is
    ``[[Piece(0, 0, 5)], [Piece(0, 5, 6), Piece(1, 0, 3)]]``.
    """
    offsets = offsets_of(numels)
    result = []
    for lo, hi in shard_bounds(offsets[-1], world_size):
        pieces = []
        for i in range(len(numels)):
            a, b = max(lo, offsets[i]), min(hi, offsets[i + 1])
            if a < b:
                pieces.append(Piece(i, a - offsets[i], b - offsets[i]))
        result.append(pieces)
    return result


def describe_partition(parts: Sequence[Sequence[Piece]]) -> str:
    """One line per rank: ``rank 1: 4 elements  p0[5:6] p1[0:3]``."""
    lines = []
    for rank, pieces in enumerate(parts):
        size = sum(p.stop - p.start for p in pieces)
        names = " ".join(f"p{p.param}[{p.start}:{p.stop}]" for p in pieces)
        lines.append(f"rank {rank}: {size} elements  {names}".rstrip())
    return "\n".join(lines)


def blocks_of(lo: int, hi: int, bounds: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Every rank's block of the flat range ``[lo, hi)``: its intersection with the rank's
    range, as flat ``[start, stop)`` (empty blocks keep a position inside ``[lo, hi]``)."""
    blocks = []
    for r_lo, r_hi in bounds:
        start = min(max(lo, r_lo), hi)
        blocks.append((start, max(min(hi, r_hi), start)))
    return blocks


def reduction_buckets(
    numels: Sequence[int],
    element_size: int,
    bucket_bytes: int,
    first_bucket_bytes: int = FIRST_BUCKET_BYTES,
    order: Sequence[int] | None = None,
) -> list[list[int]]:
    """Parameter indices of the gradient buckets, in launch order.

    Parameters are taken in the reverse of ``order`` (default: the flat order; give the
    model's registration order, the order whose reverse backward produces gradients in); a
    bucket closes once it holds at least its limit, the first one at
    ``min(first_bucket_bytes, bucket_bytes)`` so communication starts early (as in
    :func:`plait.strategies.data_parallel.buckets.build_buckets`). Each bucket lists its
    parameters in
    flat order; with the default order every bucket is a contiguous run of the flat space.
    """
    sequence = list(range(len(numels))) if order is None else list(order)
    groups: list[list[int]] = []
    size = 0
    for i in reversed(sequence):
        limit = min(first_bucket_bytes, bucket_bytes) if len(groups) <= 1 else bucket_bytes
        if not groups or size >= limit:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += numels[i] * element_size
    return [sorted(g) for g in groups]


@dataclass
class PartitionBucket:
    """A bucket of parameters ``params`` (flat order). ``pieces[r]``: rank r's part of it,
    as ``(param, flat start, flat stop)`` in that order (possibly none): the rank's block
    of the bucket's reduce-scatter and all-gather is their concatenation, ``sizes[r]``
    elements."""

    index: int
    params: list[int]
    pieces: list[list[tuple[int, int, int]]]
    sizes: list[int]

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    def contiguous(self, rank: int) -> tuple[int, int] | None:
        """Rank's block as one flat ``[start, stop)`` when its pieces are adjacent."""
        pieces = self.pieces[rank]
        if not pieces:
            return None
        for (_, _, stop), (_, start, _) in zip(pieces, pieces[1:], strict=False):
            if stop != start:
                return None
        return pieces[0][1], pieces[-1][2]


def make_buckets(
    numels: Sequence[int],
    element_size: int,
    bucket_bytes: int,
    bounds: Sequence[tuple[int, int]],
    order: Sequence[int] | None = None,
) -> list[PartitionBucket]:
    """The gradient buckets of :func:`reduction_buckets`, with every rank's pieces."""
    offsets = offsets_of(numels)
    buckets = []
    for index, params in enumerate(
        reduction_buckets(numels, element_size, bucket_bytes, order=order)
    ):
        pieces: list[list[tuple[int, int, int]]] = []
        for lo, hi in bounds:
            mine = []
            for i in params:
                a, b = max(lo, offsets[i]), min(hi, offsets[i + 1])
                if a < b:
                    mine.append((i, a, b))
            pieces.append(mine)
        sizes = [sum(b - a for _, a, b in mine) for mine in pieces]
        buckets.append(PartitionBucket(index, params, pieces, sizes))
    return buckets
