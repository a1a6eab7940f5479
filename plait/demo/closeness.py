"""How far a demo run lands from one process: the statistics ``plait demo --check`` judges.

:func:`max_diff` (the largest elementwise difference) suits float64, where rounding stays
tiny; in float32 training amplifies rounding and a largest element is chaotic (under Adam
an element whose gradient is near zero steps by about lr whatever its sign), so the demos
judge :func:`distance`, the L2 distance over every parameter relative to how far training
moved them, against the same statistic for float32 in one process. The one-process runs
train on :func:`one_thread`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest elementwise difference of two state dicts (``b``'s keys)."""
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in b)


def distance(
    state: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    start: dict[str, torch.Tensor],
) -> float:
    """``|state - reference| / |reference - start|`` over all of ``reference``'s tensors
    (L2): how far ``state`` lands from ``reference``, relative to how far training moved
    ``reference`` from ``start``."""

    def square(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return sum(float((a[k].double() - b[k].double()).square().sum()) for k in reference)

    far, moved = square(state, reference), square(reference, start)
    if moved == 0:
        return 0.0 if far == 0 else math.inf
    return math.sqrt(far / moved)


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread while open: the demos' small one-process runs are no
    slower for it, and on a busy machine threads that wait for each other cost far more
    (measured at a load of 10 on 2 cores: the float32 check's three 6-step GPT runs 8 s on
    one thread, 48 s on two; the digits CNN's epoch 1.2 s against 31 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
