"""Reproducible pipeline accumulation: each stage parameter's micro-batch gradients are
summed along the fixed tree over micro-batch index, whatever order the schedule runs the
backward passes in (1F1B, interleaved, zero-bubble all differ).

The pipeline's micro-batches are already the same for every pipeline depth, and the loss
of each is divided by the micro-batch count (a power of two here: exact). Only the order
in which ``.grad`` accumulates them depends on the schedule; the runtime wraps each
backward action in :func:`one_microbatch` and calls :func:`finish` at the end of the step.
No communication.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from torch import nn

from plait.strategies.reproducible.tree import LayoutError, Microbatches, TreeSum, is_power_of_two


def for_pipeline(microbatches: int) -> Microbatches:
    """The accumulator of a pipeline of ``microbatches`` micro-batches per step."""
    if not is_power_of_two(microbatches):
        raise LayoutError(
            f"pipeline, reproducible=True: microbatches={microbatches}; the fixed summation "
            f"tree needs a power of two"
        )
    return Microbatches(count=microbatches)


@contextlib.contextmanager
def one_microbatch(tree: Microbatches | None, stage: nn.Module, index: int) -> Iterator[None]:
    """Around one backward action of micro-batch ``index`` on ``stage``: what it adds to
    the stage's ``.grad`` becomes that micro-batch's leaf instead (None: no-op)."""
    if tree is None:
        yield
        return
    params = [p for p in stage.parameters() if p.requires_grad]
    before = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in zip(params, before, strict=True):
            leaf, p.grad = p.grad, grad
            if leaf is not None:
                tree.sums.setdefault(p, TreeSum()).push(leaf, index)
        tree.peak_bytes = max(tree.peak_bytes, sum(t.peak_bytes for t in tree.sums.values()))


def finish(tree: Microbatches | None, stages: Mapping[int, nn.Module]) -> None:
    """End of step: each parameter's ``.grad`` gains its tree sum (None: no-op)."""
    if tree is None:
        return
    for stage in stages.values():
        for p in stage.parameters():
            acc = tree.sums.pop(p, None)
            if acc is None:
                continue
            total = acc.result()
            p.grad = total if p.grad is None else p.grad + total
    tree.sums = {}
