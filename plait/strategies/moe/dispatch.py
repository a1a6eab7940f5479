"""Dispatch and combine: tokens to their experts and back, across the expert-parallel group.

The gate (``gshard_gate.route``) says, per token and choice, which expert, at which position,
kept or not, with which weight. Dispatch sends every kept choice's token to the rank that
holds its expert; the experts run; combine brings the outputs back and adds them up,
weighted: ``y[t] = sum over kept choices of weight * expert(x[t])``.

Order. On each rank the kept choices are sorted by (expert, group, position): GShard's
``[E, G, C]`` expert buffer with the empty slots left out. Experts are numbered globally and
rank ``r`` of the expert-parallel group ``P`` (``p`` ranks) holds experts ``r * E/p ..
(r+1) * E/p - 1``, so the sorted rows form one contiguous block per destination rank.

Communication contract, per MoE layer per step, on ``P`` (the ``ep`` group of the mesh):

=========================  ===========================================  ======================
step                       forward                                      backward
=========================  ===========================================  ======================
counts                     all-gather of ``E`` int64 per rank           none
                           (kept choices per expert; ``2 E`` with the
                           routed counts for statistics)
dispatch                   all-to-all (list form, uneven): rank r       the reverse all-to-all
                           sends rank j the rows for j's experts        of the gradients
combine                    the reverse all-to-all of the outputs        all-to-all of the
                                                                        gradients (as dispatch)
=========================  ===========================================  ======================

Bytes this rank sends in the all-to-alls of one step: with ``n_out`` kept choices of its
tokens bound for other ranks' experts and ``n_in`` choices of other ranks' tokens for its
experts, ``(2 n_out + 2 n_in) * d * element_size`` (dispatch and combine's backward send
``n_out`` rows, combine and dispatch's backward ``n_in``). Only kept rows travel, no
padding to capacity: dropless routing needs no capacity agreed across the group, because
the counts all-gather tells every rank how many rows to expect. Every call here is
collective over ``P`` when ``group`` is given (every rank of ``P`` must run the same MoE
layers in the same order) and waits at most the group's timeout. With ``group=None`` (one
process) nothing is sent and the same code runs all experts locally.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait import comm
from plait.comm.device import control_device
from plait.comm.group import Group
from plait.strategies.moe.gshard_gate import Routing


@dataclass
class Dispatch:
    """This rank's kept choices in expert order: ``token`` (row of the flattened input),
    ``weight`` (combine weight, differentiable) and ``counts[e]`` rows per global expert."""

    token: torch.Tensor
    weight: torch.Tensor
    counts: list[int]


def refuse_meta(x: torch.Tensor, who: str) -> None:
    """Refuse dropless routing on the ``meta`` device, naming ``who`` and why: which expert
    each token goes to, and so how many rows every rank sends every other in the
    all-to-alls, is read on the host from the gate's scores, and a meta tensor holds no
    values. plait's MoE layer with ``pad_to_capacity=True`` needs no such read."""
    if x.is_meta:
        raise NotImplementedError(
            f"{who}: routing tokens on the meta device is not supported by the dropless "
            f"dispatch. Its all-to-all's split sizes are the tokens each expert receives, "
            f"read on the host from the gate's scores, and a meta tensor holds no values. "
            f"plait's MoE layer steps on meta with pad_to_capacity=True (MoE(..., "
            f"pad_to_capacity=True), MoEConfig(pad_to_capacity=True): buffers padded to the "
            f"capacity, equal splits); a model's own router (Hugging Face Mixtral, Qwen-MoE: "
            f"dropless top-k) runs expert parallelism on a real device"
        )


def plan(routing: Routing) -> Dispatch:
    """Sort the kept choices of ``routing`` by (expert, group, position). Local."""
    G, S, _ = routing.expert.shape
    g, s, j = torch.nonzero(routing.kept, as_tuple=True)
    expert = routing.expert[g, s, j]
    key = (expert * G + g) * S + routing.position[g, s, j]  # positions are < C <= S
    order = torch.argsort(key)
    counts = torch.bincount(expert, minlength=routing.num_experts).tolist()
    return Dispatch(token=(g * S + s)[order], weight=routing.weight[g, s, j][order], counts=counts)


def plan_top_k(index: torch.Tensor, weight: torch.Tensor, num_experts: int) -> Dispatch:
    """The dispatch of dropless top-k routing decided elsewhere (a model's own router):
    ``index [T, k]`` (global expert of each choice) and ``weight [T, k]`` (its combine
    weight), every choice kept, sorted by (expert, token, choice). Local; refuses an index
    outside ``0 .. num_experts - 1``, naming it."""
    if index.shape != weight.shape or index.dim() != 2:
        raise ValueError(
            f"expert parallelism: the router returned expert indices of shape "
            f"{tuple(index.shape)} and weights of shape {tuple(weight.shape)}; both must be "
            f"[tokens, top_k]"
        )
    T, k = index.shape
    expert = index.reshape(-1).to(torch.int64)
    if expert.numel() and (int(expert.min()) < 0 or int(expert.max()) >= num_experts):
        bad = int(expert.max()) if int(expert.max()) >= num_experts else int(expert.min())
        raise ValueError(
            f"expert parallelism: the router chose expert {bad}, outside 0..{num_experts - 1}; "
            f"masked or padded choices are not supported: route every token to real experts"
        )
    order = torch.argsort(expert, stable=True)
    token = torch.arange(T, device=index.device).repeat_interleave(k)
    counts = torch.bincount(expert, minlength=num_experts).tolist()
    return Dispatch(token=token[order], weight=weight.reshape(-1)[order], counts=counts)


class _AllToAllRows(torch.autograd.Function):
    """Rows ``x[send[0]], x[send[1]], ...`` go to ranks 0, 1, ...; ``recv[i]`` rows come
    from rank i. Backward: the reverse all-to-all of the gradient (sizes swapped)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        send: list[int],
        recv: list[int],
        group: Group,
        algorithm: str,
    ) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.algorithm = send, recv, group, algorithm
        return _exchange(x, send, recv, group, algorithm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _exchange(grad, ctx.recv, ctx.send, ctx.group, ctx.algorithm), None, None, None, None


def _exchange(
    x: torch.Tensor, send: list[int], recv: list[int], group: Group, algorithm: str
) -> torch.Tensor:
    width = x.shape[1:]
    ins = [b.contiguous() for b in torch.split(x.detach(), send)]
    outs = [x.new_empty((n, *width)) for n in recv]
    comm.all_to_all(outs, ins, group=group, algorithm=algorithm)
    return torch.cat(outs) if outs else x.new_empty((0, *width))


def all_to_all_rows(
    x: torch.Tensor, send: list[int], recv: list[int], *, group: Group, algorithm: str = "auto"
) -> torch.Tensor:
    """Differentiable uneven all-to-all of the rows of ``x`` over ``group`` (see
    :class:`_AllToAllRows`); ``send`` and ``recv`` hold one row count per rank. Collective."""
    if len(send) != group.size or len(recv) != group.size or sum(send) != x.shape[0]:
        raise ValueError(
            f"all_to_all_rows: send {send} must hold {group.size} counts summing to "
            f"{x.shape[0]} rows, recv {recv} {group.size} counts (group {group.name!r})"
        )
    out: torch.Tensor = _AllToAllRows.apply(x, send, recv, group, algorithm)
    return out


def gather_counts(local: list[int], group: Group | None) -> torch.Tensor:
    """Every rank's ``local`` counts as a ``[p, len(local)]`` int64 matrix on the host.
    Collective (an all-gather over ``group``, on its device); ``[1, len]`` without a group.
    The sizes of the expert all-to-all are read from it on the host: on a GPU one
    synchronization per MoE layer and step, as in every dropless MoE."""
    if group is None or group.size == 1:
        return torch.tensor(local, dtype=torch.int64).unsqueeze(0)
    where = control_device(group=group)  # NCCL: the GPU
    mine = torch.tensor(local, dtype=torch.int64, device=where)
    out = torch.empty(group.size, mine.numel(), dtype=torch.int64, device=where)
    comm.all_gather(out, mine, group=group, algorithm="auto")
    return out.cpu()


def _expert_major(counts: torch.Tensor, first: int, local: int) -> tuple[torch.Tensor, list[int]]:
    """For rows received source by source (each source's rows ordered by local expert),
    the permutation that orders them expert by expert, and the rows per local expert."""
    block = counts[:, first : first + local]  # [p, local]
    offsets = torch.cumsum(block.reshape(-1), 0) - block.reshape(-1)  # source-major starts
    pieces = []
    for e in range(local):
        for src in range(block.shape[0]):
            start, n = int(offsets[src * local + e]), int(block[src, e])
            pieces.append(torch.arange(start, start + n))
    order = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)
    return order, block.sum(dim=0).tolist()


def run_experts(
    x: torch.Tensor,
    dispatch: Dispatch,
    experts: nn.ModuleDict | Callable[[int, torch.Tensor], torch.Tensor],
    *,
    counts: torch.Tensor,
    group: Group | None,
    algorithm: str = "auto",
) -> torch.Tensor:
    """``y[t] = sum of weight * expert(x[t])`` over the kept choices of ``dispatch``, for
    ``x [tokens, d]``; ``experts`` maps the global index (as a string) of each expert this
    rank holds to its module; ``counts [p, E]`` is :func:`gather_counts` of every rank's
    ``dispatch.counts``. Collective over ``group`` (module docstring: the contract)."""
    p = 1 if group is None else group.size
    rank = 0 if group is None else group.rank
    E = counts.shape[1]
    local = E // p
    first = rank * local
    rows = x[dispatch.token]  # [A, d] in expert order
    if group is not None and p > 1:
        per_rank = counts[rank].reshape(p, local).sum(dim=1).tolist()
        incoming = counts[:, first : first + local].sum(dim=1).tolist()
        rows = all_to_all_rows(rows, per_rank, incoming, group=group, algorithm=algorithm)
        order, sizes = _expert_major(counts, first, local)
        rows = rows[order]
    else:
        sizes = counts[0].tolist()
    # every held expert runs, even on no rows, so each has a gradient on every rank
    apply: Callable[[int, torch.Tensor], torch.Tensor]
    if isinstance(experts, nn.ModuleDict):
        table = experts

        def apply(e: int, chunk: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = table[str(e)](chunk)
            return out
    else:
        apply = experts
    outs = [apply(first + e, chunk) for e, chunk in enumerate(torch.split(rows, sizes))]
    out = torch.cat(outs) if outs else rows
    if group is not None and p > 1:
        out = out[torch.argsort(order)]  # back to source-major
        out = all_to_all_rows(out, incoming, per_rank, group=group, algorithm=algorithm)
    weighted = out * dispatch.weight.unsqueeze(-1).to(out.dtype)
    # under autocast the experts compute in 16 bits; their outputs join x's dtype
    return x.new_zeros(x.shape).index_add(0, dispatch.token, weighted.to(x.dtype))


__all__ = ["Dispatch", "all_to_all_rows", "gather_counts", "plan", "plan_top_k", "run_experts"]
