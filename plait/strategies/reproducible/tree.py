"""The fixed summation tree over micro-batch index, and the layouts that reproduce it.

The global batch of ``B`` samples is cut into ``M = B / m`` micro-batches of ``m``
samples. Their gradients are summed along one balanced binary tree over micro-batch index;
for ``M = 8``::

    level 3                      ((g0+g1)+(g2+g3)) + ((g4+g5)+(g6+g7))
    level 2            (g0+g1)+(g2+g3)                  (g4+g5)+(g6+g7)
    level 1        g0+g1         g2+g3              g4+g5          g6+g7
    level 0      g0     g1     g2     g3          g4     g5     g6     g7
    rank (W=2)   |------- rank 0 ---------|       |------- rank 1 ---------|

With ``M`` and the world size ``W`` powers of two, rank ``r``'s contiguous block of
``M / W`` micro-batches is one whole subtree: each rank sums its block locally
(:class:`TreeSum`), and the ranks' partial sums meet in the top ``log2 W`` levels
(:func:`tree_sum` over rank index, run by :mod:`.collectives`). Every layout therefore
adds the same numbers in the same order, and IEEE addition being commutative, every rank
ends with the same bits as one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


class LayoutError(ValueError):
    """A batch, micro-batch size and world size that cannot reproduce the fixed tree."""


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def microbatch_count(batch: int, microbatch_size: int, world: int) -> int:
    """``M = batch / microbatch_size``, checked: ``M`` and ``world`` powers of two and
    ``world`` dividing ``M``, so that every rank's block is a whole subtree."""
    where = (
        f"global batch B={batch}, microbatch_size m={microbatch_size}, "
        f"data-parallel world size W={world}"
    )
    if microbatch_size <= 0 or batch % microbatch_size:
        raise LayoutError(
            f"reproducible mode: {where}: B must be a multiple of m; pick m dividing B"
        )
    count = batch // microbatch_size
    if not is_power_of_two(count):
        below = 1 << (count.bit_length() - 1) if count else 1
        raise LayoutError(
            f"reproducible mode: {where} gives M=B/m={count} micro-batches; the fixed "
            f"summation tree needs M a power of two (e.g. B={below * microbatch_size} or "
            f"B={2 * below * microbatch_size} with this m)"
        )
    if not is_power_of_two(world) or count % world:
        raise LayoutError(
            f"reproducible mode: {where}, M={count}: W must be a power of two dividing M, so "
            f"that each rank's contiguous block of M/W micro-batches is a whole subtree"
        )
    return count


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The sum of ``parts`` along the balanced binary tree over their index (power-of-two
    length): ``(p0 + p1) + (p2 + p3)``. A new tensor (``parts[0]`` itself for one part)."""
    if len(parts) == 1:
        return parts[0]
    half = len(parts) // 2
    return tree_sum(parts[:half]) + tree_sum(parts[half:])


class TreeSum:
    """A binary-counter accumulator: each leaf is merged with its sibling subtree as soon as
    both are held, so after ``n`` (a power of two) leaves it holds their :func:`tree_sum`.
    Leaves pushed in index order keep at most ``log2(n) + 1`` partial sums alive (the new
    leaf plus one per set bit of the count so far); a pipeline schedule may push them in
    any order (more may then wait for a sibling). :attr:`peak_bytes` records the most held."""

    def __init__(self) -> None:
        self.nodes: dict[tuple[int, int], torch.Tensor] = {}  # (level, index) -> partial sum
        self.leaves = 0
        self.peak_bytes = 0

    def push(self, leaf: torch.Tensor, index: int | None = None) -> None:
        """Leaf ``index`` (default: the next in order)."""
        level, i = 0, self.leaves if index is None else index
        if (level, i) in self.nodes:
            raise RuntimeError(f"reproducible mode: micro-batch {i} summed twice")
        total = leaf
        self.nodes[(level, i)] = total
        self._note()
        while (level, i ^ 1) in self.nodes:
            sibling = self.nodes.pop((level, i ^ 1))
            del self.nodes[(level, i)]
            total = total + sibling if i % 2 == 0 else sibling + total  # left + right
            level, i = level + 1, i // 2
            self.nodes[(level, i)] = total
            self._note()
        self.leaves += 1

    def _note(self) -> None:
        held = sum(t.numel() * t.element_size() for t in self.nodes.values())
        self.peak_bytes = max(self.peak_bytes, held)

    def result(self) -> torch.Tensor:
        """The whole subtree's sum; resets the accumulator."""
        if len(self.nodes) != 1:
            raise LayoutError(
                f"reproducible mode: {self.leaves} micro-batch gradients were summed, not a "
                f"power of two; every rank must run M/W micro-batches per step"
            )
        total = next(iter(self.nodes.values()))
        self.nodes, self.leaves = {}, 0
        return total


@dataclass
class Microbatches:
    """Where the current step is: micro-batch ``index`` of ``count`` on this rank, and one
    :class:`TreeSum` per gradient (keyed by what the strategy sums: a parameter, a bucket,
    an FSDP unit). Strategies read :attr:`final` to decide whether to communicate."""

    count: int = 1
    index: int = 0
    sums: dict[Any, TreeSum] = field(default_factory=dict)
    peak_bytes: int = 0  # the most partial-sum bytes held at once, over every gradient
    # set by the runner that drives the micro-batches; a strategy built with
    # reproducible=True refuses a backward pass that no runner drives (:meth:`check_driven`)
    driven: bool = False
    # FSDP: rank r runs micro-batches r, r+W, r+2W, ... so that each micro-batch step's W
    # leaves are one subtree, reduce-scattered at once; the tree continues on the shards
    interleaved: bool = False

    @property
    def final(self) -> bool:
        return self.index == self.count - 1

    def check_driven(self, who: str) -> None:
        """Refuse a backward pass outside a runner's step: its loss was not scaled by
        ``1/M`` and its micro-batch has no place in the tree."""
        if not self.driven:
            raise RuntimeError(
                f"{who}(reproducible=True): a forward or backward ran outside a "
                f"ReproducibleRunner step, so its micro-batch has no place in the fixed "
                f"summation tree and its loss no 1/M scale. Drive the training loop with "
                f"runner = ReproducibleRunner(module, optimizer, loss_fn=..., "
                f"microbatch_size=m) and loss = runner.step(x, y) on runner.block(x), "
                f"runner.block(y); or build it without reproducible=True"
            )

    def add(self, key: Any, leaf: torch.Tensor) -> torch.Tensor | None:
        """Push micro-batch :attr:`index`'s ``leaf`` for ``key``; at the last micro-batch
        return this rank's subtree sum (None before)."""
        acc = self.sums.setdefault(key, TreeSum())
        if acc.leaves != self.index:
            raise RuntimeError(
                f"reproducible mode: gradient {key!r} got micro-batch {self.index} after "
                f"{acc.leaves}; every micro-batch must reach every gradient exactly once"
            )
        acc.push(leaf)
        held = sum(a.peak_bytes for a in self.sums.values())
        self.peak_bytes = max(self.peak_bytes, held)
        return acc.result() if self.final else None
