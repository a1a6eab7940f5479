"""Static-capacity dispatch: GShard's ``[experts, capacity, d]`` buffers, no host read.

The dropless dispatch (:mod:`~plait.strategies.moe.dispatch`) sends only the kept rows, so
every rank must first learn how many rows each expert gets: a counts all-gather read on the
host (on a GPU one synchronization per layer and step), and on the ``meta`` device no value
at all. With a fixed capacity ``C`` per expert and group (plait's GShard gate has one) the
buffer shapes are known before any value: this is GShard's own dispatch (lingvo's
``[E, G, C, d]`` einsum), Megatron-LM's ``moe_pad_expert_input_to_capacity``.
``MoE(..., pad_to_capacity=True)`` takes this path.

Layout. This rank's ``G`` groups of ``S`` tokens fill a buffer of ``E * G * C`` rows, row
``(expert * G + group) * C + position`` for every kept choice; an empty slot is zero and no
choice reads its output back (its combine weight is zero). A choice that was not kept
(overflow, or a second choice not drawn) writes to and reads from one spill row past the
end, which never travels and reads back zero. Rank ``r`` of the expert-parallel group ``P``
(``p`` ranks) holds experts ``r * E/p .. (r+1) * E/p - 1``, so the buffer is ``p`` equal
blocks of ``E/p * G * C`` rows, one per destination rank: the all-to-all's splits are
static. Every rank of ``P`` must route the same ``G`` and ``C`` (equal local batches, as
plait's strategies cut them): :func:`agree_on_slots` checks it once per new ``(G, C)``.

Communication contract, per MoE layer per step, on ``P``:

==============  ================================================  ==========================
step            forward                                           backward
==============  ================================================  ==========================
agreement       once per new ``(G, C)`` of this rank: an          none
                all-gather of 2 int64, read on the host
                (:func:`agree_on_slots`)
dispatch        all-to-all, equal splits of ``E/p * G * C`` rows  the reverse all-to-all of
                per rank (``plait.comm.all_to_all``)              the gradients
combine         the reverse all-to-all of the expert outputs      all-to-all (as dispatch)
==============  ================================================  ==========================

No counts all-gather: after the first call of a shape nothing is read on the host. Bytes
this rank sends in one step: ``4 (p-1)/p * E * G * C * d * element_size`` (each of the four
all-to-alls sends the ``(p-1)/p`` of its ``E * G * C`` rows bound for other ranks), padding
included, against the dropless path's ``(2 n_out + 2 n_in) * d * element_size`` of kept
rows only: with ``capacity_factor`` ``cf`` and top-``k`` routing, at most ``k / cf`` of the
slots are filled. Every expert computes on all its ``p * G * C`` rows, empty or not.

Results: the output and the gradients equal the dropless path's to float64 rounding, not
bitwise: the experts' matrix products run over more rows (the blocking of a GEMM depends on
its size) and their weight gradients sum over more rows, zeros among them, in another
order. The routing, the statistics and which rows are dropped are the same. Collective over
``group`` when given; with ``group=None`` every expert is local and nothing is sent.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from plait import comm
from plait.comm.device import control_device, host_list
from plait.comm.group import Group
from plait.strategies.moe.dispatch import all_to_all_rows
from plait.strategies.moe.gshard_gate import Routing


def slots(routing: Routing) -> torch.Tensor:
    """The buffer row of every choice, ``[G * S * k]`` in (group, token, choice) order:
    ``(expert * G + group) * C + position`` when kept, else ``E * G * C`` (the spill row).
    Local; no host read."""
    G, S, k = routing.expert.shape
    C, E = routing.capacity, routing.num_experts
    group = torch.arange(G, device=routing.expert.device).view(G, 1, 1)
    row = (routing.expert * G + group) * C + routing.position
    spill = torch.full_like(row, E * G * C)
    return torch.where(routing.kept, row, spill).reshape(-1)


def agree_on_slots(groups: int, capacity: int, group: Group, who: str) -> None:
    """Refuse, on every rank of ``group``, a layout whose ranks route different numbers of
    groups or capacities (their all-to-all blocks would differ in size: on gloo a size
    mismatch inside the all-to-all, on NCCL garbage or a hang), naming each rank's values
    and what to change. Collective: an all-gather of 2 int64 on the group's device, read on
    the host (on the meta device: this rank's values, the fake backend's result)."""
    mine = [groups, capacity]
    where = control_device(group=group)
    out = torch.empty(group.size * 2, dtype=torch.int64, device=where)
    comm.all_gather(out, torch.tensor(mine, dtype=torch.int64, device=where), group=group)
    seen = host_list(out, mine * group.size)
    pairs = [(seen[2 * i], seen[2 * i + 1]) for i in range(group.size)]
    if len(set(pairs)) > 1:
        listed = ", ".join(
            f"rank {r}: G={g}, C={c}" for r, (g, c) in zip(group.ranks, pairs, strict=True)
        )
        raise ValueError(
            f"{who}: pad_to_capacity=True needs the same groups G and capacity C on every "
            f"rank of the expert-parallel group {group.name!r} (their all-to-all blocks are "
            f"E/p*G*C rows), got {listed}; give every rank the same number of sequences of "
            f"the same length (or set pad_to_capacity=False: the dropless dispatch agrees "
            f"sizes every step)"
        )


def _apply(
    experts: nn.ModuleDict | Callable[[int, torch.Tensor], torch.Tensor],
) -> Callable[[int, torch.Tensor], torch.Tensor]:
    if not isinstance(experts, nn.ModuleDict):
        return experts
    table = experts

    def apply(e: int, rows: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = table[str(e)](rows)
        return out

    return apply


def run_experts_padded(
    x: torch.Tensor,
    routing: Routing,
    experts: nn.ModuleDict | Callable[[int, torch.Tensor], torch.Tensor],
    *,
    group: Group | None,
    algorithm: str = "auto",
) -> torch.Tensor:
    """``y[t] = sum of weight * expert(x[t])`` over the kept choices of ``routing``, for
    ``x [G * S, d]`` (the routed groups, flattened), through static ``[E, G * C, d]``
    buffers (module docstring: layout and contract). ``experts`` maps the global index (as
    a string) of each expert this rank holds to its module. Collective over ``group``."""
    G, S, k = routing.expert.shape
    E, C = routing.num_experts, routing.capacity
    d = x.shape[-1]
    ep = group if group is not None and group.size > 1 else None  # None: all experts here
    p = 1 if ep is None else ep.size
    rank = 0 if ep is None else ep.rank
    local = E // p
    width = G * C  # slots per expert from this rank
    slot = slots(routing)
    token = torch.arange(G * S, device=x.device).repeat_interleave(k)
    # rows[slot] = x[token]: kept choices in their slots, the rest on the spill row
    buffer = x.new_zeros(E * width + 1, d).index_copy(0, slot, x[token])[:-1]
    if ep is not None:
        n = local * width
        buffer = all_to_all_rows(buffer, [n] * p, [n] * p, group=ep, algorithm=algorithm)
        # source-major [p, local, G*C, d] -> expert-major [local, p*G*C, d]
        inputs = buffer.view(p, local, width, d).transpose(0, 1).reshape(local, p * width, d)
    else:
        inputs = buffer.view(E, width, d)
    apply = _apply(experts)
    # every held expert runs, on every slot: static shapes, a gradient on every rank
    out = torch.stack([apply(rank * local + e, inputs[e]) for e in range(local)])
    if ep is not None:
        out = out.view(local, p, width, -1).transpose(0, 1).reshape(p * local * width, -1)
        n = local * width
        out = all_to_all_rows(out, [n] * p, [n] * p, group=ep, algorithm=algorithm)
    else:
        out = out.reshape(E * width, -1)
    out = torch.cat([out, out.new_zeros(1, out.shape[-1])])  # the spill row reads zero
    weighted = out[slot] * routing.weight.reshape(-1, 1).to(out.dtype)
    # under autocast the experts compute in 16 bits; their outputs join x's dtype
    return x.new_zeros(x.shape).index_add(0, token, weighted.to(x.dtype))


def per_expert(expert: torch.Tensor, mask: torch.Tensor, experts: int) -> torch.Tensor:
    """Choices per expert where ``mask``: ``[experts]`` int64, on ``expert``'s device (a
    scatter-add: no data-dependent shape, no host read)."""
    counts = torch.zeros(experts, dtype=torch.int64, device=expert.device)
    return counts.scatter_add_(0, expert.reshape(-1), mask.reshape(-1).to(torch.int64))


__all__ = ["agree_on_slots", "per_expert", "run_experts_padded", "slots"]
