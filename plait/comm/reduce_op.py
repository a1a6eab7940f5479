"""Reduction operators and the local arithmetic every algorithm shares.

``avg`` never reaches an algorithm: the public ops turn it into ``sum`` and divide by the
group size, so every algorithm only combines with sum, prod, max or min. Where the
division happens depends on the dtype (:func:`prescaled`): after the sum for every dtype
but float16, before it for float16, whose range (65504) a sum of finite values overflows
long before their mean does (three ranks of 60000.0 sum to inf); each rank's
contribution is divided by the group size (in float32, rounded once) before the sum, as
NCCL's PreMulSum does for ``avg``, so the bytes on the wire stay float16 and the mean of
finite values stays finite.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist


class ReduceOp(str, enum.Enum):
    SUM = "sum"
    AVG = "avg"
    PROD = "prod"
    MAX = "max"
    MIN = "min"


_FROM_TORCH = {
    dist.ReduceOp.SUM: ReduceOp.SUM,
    dist.ReduceOp.PRODUCT: ReduceOp.PROD,
    dist.ReduceOp.MAX: ReduceOp.MAX,
    dist.ReduceOp.MIN: ReduceOp.MIN,
    dist.ReduceOp.AVG: ReduceOp.AVG,
}

TO_TORCH = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PROD: dist.ReduceOp.PRODUCT,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
}


def parse_op(op: object) -> ReduceOp:
    """Accept ``"sum"``, ``ReduceOp.SUM`` or ``torch.distributed.ReduceOp.SUM``."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp(op.lower())
        except ValueError:
            pass
    else:
        for torch_op, ours in _FROM_TORCH.items():
            try:
                if op == torch_op:
                    return ours
            except (TypeError, RuntimeError):
                continue
    names = ", ".join(repr(o.value) for o in ReduceOp)
    raise ValueError(f"unknown reduce op {op!r}; use one of {names}")


def prescaled(op: ReduceOp, dtype: torch.dtype) -> bool:
    """True when ``avg`` divides each rank's contribution before the sum (float16: a sum
    of finite values may overflow its range while their mean does not)."""
    return op is ReduceOp.AVG and dtype == torch.float16


def combine_(acc: torch.Tensor, other: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """``acc = acc (op) other``, in place, in acc's dtype (as NCCL and gloo do)."""
    if op is ReduceOp.SUM:
        return acc.add_(other)
    if op is ReduceOp.PROD:
        return acc.mul_(other)
    if op is ReduceOp.MAX:
        return torch.maximum(acc, other, out=acc)
    if op is ReduceOp.MIN:
        return torch.minimum(acc, other, out=acc)
    raise AssertionError(f"{op} must be lowered before it reaches an algorithm")


def combine(a: torch.Tensor, b: torch.Tensor, op: ReduceOp, out: torch.Tensor) -> torch.Tensor:
    """``out = a (op) b`` without touching a or b."""
    if op is ReduceOp.SUM:
        return torch.add(a, b, out=out)
    if op is ReduceOp.PROD:
        return torch.mul(a, b, out=out)
    if op is ReduceOp.MAX:
        return torch.maximum(a, b, out=out)
    if op is ReduceOp.MIN:
        return torch.minimum(a, b, out=out)
    raise AssertionError(f"{op} must be lowered before it reaches an algorithm")
