"""Collectives that a compiled graph can hold: plait's functional collectives as custom ops.

``torch.compile`` traces Python into a graph. plait's collectives are Python it cannot
trace (a worker thread, point-to-point sends, a hash of the call's signature folded into
the message tags): traced inside a model's forward, each one would end the graph there (a
"graph break") and Dynamo would warn on every compile. PyTorch solves this for its own
collectives by making each one an operator that takes its group by name
(``torch.ops._c10d_functional.all_reduce(tensor, op, group_name)``): the graph holds one
opaque node, and the operator runs the collective when the graph runs.

This module does the same for the collectives plait calls inside a forward or a backward
(the tensor-parallel mappings): ``torch.ops.plait.all_reduce``, ``all_gather`` and
``reduce_scatter`` are custom operators (``torch.library.custom_op``) whose group is
:attr:`plait.comm.group.Group.key`, and whose shape rule (the "fake" implementation) lets
the compiler plan around them without running them. When the graph runs, each node calls
the collective of :mod:`plait.comm.ops` with every check, the algorithm choice, the byte
counts and the timeout unchanged. Outside a compiled region the functions below call the
collective directly (no operator dispatch).

The communication contract is the collective's: every rank of ``group`` calls the same
function, in the same order, with the same shapes; it blocks on the others up to the
group's timeout. Bytes per rank on the ring: all-reduce ``2 n (t-1)/t`` elements of an
``n``-element tensor; all-gather and reduce-scatter ``n (t-1)/t`` of the full ``n``.
"""

from __future__ import annotations

import torch

from plait.comm import ops
from plait.comm.group import Group, group_by_key


# --- the operators (what a compiled graph holds) --------------------------------------------
@torch.library.custom_op("plait::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, op: str, group: str, algorithm: str) -> torch.Tensor:
    return _all_reduce(x, group_by_key(group), op, algorithm)


@_all_reduce_op.register_fake
def _(x: torch.Tensor, op: str, group: str, algorithm: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("plait::all_gather", mutates_args=())
def _all_gather_op(x: torch.Tensor, size: int, group: str, algorithm: str) -> torch.Tensor:
    return _all_gather(x, group_by_key(group), algorithm)


@_all_gather_op.register_fake
def _(x: torch.Tensor, size: int, group: str, algorithm: str) -> torch.Tensor:
    return x.new_empty((size, *x.shape))


@torch.library.custom_op("plait::reduce_scatter", mutates_args=())
def _reduce_scatter_op(blocks: torch.Tensor, op: str, group: str, algorithm: str) -> torch.Tensor:
    return _reduce_scatter(blocks, group_by_key(group), op, algorithm)


@_reduce_scatter_op.register_fake
def _(blocks: torch.Tensor, op: str, group: str, algorithm: str) -> torch.Tensor:
    return blocks.new_empty(blocks.shape[1:])


# --- eager bodies ----------------------------------------------------------------------------
def _all_reduce(x: torch.Tensor, group: Group, op: str, algorithm: str) -> torch.Tensor:
    out = x.contiguous().clone()
    ops.all_reduce(out, op, group=group, algorithm=algorithm)
    return out


def _all_gather(x: torch.Tensor, group: Group, algorithm: str) -> torch.Tensor:
    out = x.new_empty((group.size, *x.shape))
    ops.all_gather(out, x.contiguous(), group=group, algorithm=algorithm)
    return out


def _reduce_scatter(blocks: torch.Tensor, group: Group, op: str, algorithm: str) -> torch.Tensor:
    out = blocks.new_empty(blocks.shape[1:])
    ops.reduce_scatter(out, blocks.contiguous(), op, group=group, algorithm=algorithm)
    return out


# --- the functions callers use ---------------------------------------------------------------
def all_reduce(
    x: torch.Tensor, *, group: Group, op: str = "sum", algorithm: str = "auto"
) -> torch.Tensor:
    """``op`` of ``x`` over ``group``, as a new tensor (``x`` is unchanged). Collective."""
    if torch.compiler.is_compiling():
        return torch.ops.plait.all_reduce(x, op, group.key, algorithm)  # type: ignore[no-any-return]
    return _all_reduce(x, group, op, algorithm)


def all_gather(x: torch.Tensor, *, group: Group, algorithm: str = "auto") -> torch.Tensor:
    """Every rank's ``x`` stacked in rank order: shape ``(group.size, *x.shape)``. Collective."""
    if torch.compiler.is_compiling():
        return torch.ops.plait.all_gather(x, group.size, group.key, algorithm)  # type: ignore[no-any-return]
    return _all_gather(x, group, algorithm)


def reduce_scatter(
    blocks: torch.Tensor, *, group: Group, op: str = "sum", algorithm: str = "auto"
) -> torch.Tensor:
    """``op`` of ``blocks`` (shape ``(group.size, ...)``) over ``group``; this rank keeps
    block ``group.rank``: shape ``blocks.shape[1:]``. Collective."""
    if torch.compiler.is_compiling():
        return torch.ops.plait.reduce_scatter(blocks, op, group.key, algorithm)  # type: ignore[no-any-return]
    return _reduce_scatter(blocks, group, op, algorithm)
