"""GShard's gating: which expert each token goes to, at which position, with which weight.

This is Algorithm 1 of GShard (Lepikhin et al. 2020, arXiv 2006.16668) as lingvo's
``Top2GatingOnLogits`` writes it, on logits shaped ``[G, S, E]`` (G groups of S tokens,
E experts); every group is routed on its own ("local group dispatching"):

1. ``gates = softmax(logits)`` over the experts (the router's probabilities).
2. The first expert is ``argmax(gates + bias)`` (``bias`` is the auxiliary-loss-free
   balancing bias, zero unless enabled: it steers the choice only, never the weight).
3. The second expert (``top_k=2``) is the argmax over the other experts; policies:
   ``"random"`` (GShard: kept with probability ``min(1, 2 * g2)``, i.e. iff
   ``u < g2 / 0.5`` for a uniform draw ``u``; ``g2`` is the raw softmax probability),
   ``"sampling"`` (chosen as ``argmax(logits + Gumbel noise)`` among the others, always
   kept: DeepSpeed's and fairscale's way) and ``"all"`` (always kept).
4. Capacity ``C`` per expert per group (see :func:`capacity`). A token's position in its
   expert is the exclusive cumulative sum of the expert's mask over the group (token
   order), so the first ``C`` tokens routed to an expert are kept and the rest dropped.
   Second choices are placed after *all* first choices: their positions start at the
   number of first choices the expert kept.
5. Weights: top-1 uses the raw probability ``g1`` (Switch: the expert's output is scaled by
   the router probability). Top-2 renormalises what survived: ``g1 / (g1 + g2)`` and
   ``g2 / (g1 + g2)`` over the kept choices only (lingvo's non-legacy behaviour: a token whose
   first choice overflowed gives its second choice the whole weight); a dropped choice
   weighs 0. A token with every choice dropped gets 0 from the layer and rides the residual.

Where lingvo builds dense one-hot ``dispatch``/``combine`` tensors of ``G x S x E x C``, plait
keeps the same information as indices (:class:`Routing`): expert, position, kept, weight per
token and choice; :func:`combine_tensor` rebuilds GShard's dense tensor for tests and for
readers who think in einsums. No communication here: pure functions of their inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F

SECOND_EXPERT_POLICIES = ("random", "sampling", "all")
# GShard's threshold: a second choice with raw gate >= 0.5 is always kept, below it with
# probability g2 / 0.5.
SECOND_EXPERT_THRESHOLD = 0.5


def capacity(tokens: int, experts: int, capacity_factor: float, min_capacity: int = 0) -> int:
    """Expert capacity per group: ``C = ceil(S * cf / E)``, at least ``min_capacity``, at
    most ``S``.

    Rounding: up to the next integer (DeepSpeed's ``_capacity``, Megatron's
    ``get_capacity``); lingvo rounds further up to a multiple of 4 for TPU layouts, which
    plait does not. ``cf`` is per token, not per assignment: top-2 routing with ``cf = 2``
    gives GShard's ``2 S / E`` (DeepSpeed doubles ``cf`` for top-2 internally; plait does
    not). More than ``S`` slots can never fill, so ``C`` is capped at ``S``.
    """
    if tokens < 0 or experts < 1:
        raise ValueError(f"capacity: tokens={tokens}, experts={experts}")
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
    c = math.ceil(tokens * capacity_factor / experts)
    return min(max(c, min_capacity), tokens)


@dataclass
class Routing:
    """Where every token of ``G`` groups of ``S`` tokens goes (``k`` = top_k choices).

    ``expert``, ``position``: ``[G, S, k]`` int64; ``kept``: ``[G, S, k]`` bool (within
    capacity and, for the second choice, drawn); ``weight``: ``[G, S, k]`` the combine
    weight (0 where not kept; differentiable with respect to the logits). ``gates``:
    ``[G, S, E]`` softmax probabilities; ``first``: ``[G, S, E]`` one-hot of the first choice
    before capacity (what the auxiliary losses count); ``capacity``: C.
    """

    expert: torch.Tensor
    position: torch.Tensor
    kept: torch.Tensor
    weight: torch.Tensor
    gates: torch.Tensor
    first: torch.Tensor
    capacity: int

    @property
    def num_experts(self) -> int:
        return int(self.gates.shape[-1])

    def routed_per_expert(self) -> torch.Tensor:
        """Assignments (choices that were made, kept or not) per expert: ``[E]`` int64.
        A second choice that ``"random"`` did not draw is not an assignment."""
        chosen = self.kept | (self.position >= self.capacity)
        return _count(self.expert, chosen, self.num_experts)

    def kept_per_expert(self) -> torch.Tensor:
        """Assignments within capacity per expert (tokens the expert computes): ``[E]``."""
        return _count(self.expert, self.kept, self.num_experts)


def _count(expert: torch.Tensor, mask: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.bincount(expert[mask].reshape(-1), minlength=experts)


def _exclusive_cumsum(mask: torch.Tensor) -> torch.Tensor:
    """Exclusive cumulative sum over the token dimension (-2) of a ``[G, S, E]`` mask."""
    return torch.cumsum(mask, dim=-2) - mask


def route(
    logits: torch.Tensor,
    *,
    top_k: int,
    capacity: int,
    second_expert: str = "random",
    uniform: torch.Tensor | None = None,
    gumbel: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> Routing:
    """Route ``logits [G, S, E]`` as GShard does (module docstring).

    ``uniform [G, S]`` are the draws of the ``"random"`` policy (``u < 2 g2`` keeps the second
    choice); ``gumbel [G, S, E]`` the noise of ``"sampling"``; both are required by their
    policy (with ``top_k=2``) and ignored otherwise, so the caller owns the randomness and two
    processes passing the same draws route identically. ``bias [E]`` shifts the choice only.
    """
    if logits.dim() != 3:
        raise ValueError(
            f"route: logits must be [groups, tokens, experts], got {tuple(logits.shape)}"
        )
    if top_k not in (1, 2):
        raise ValueError(f"top_k must be 1 or 2, got {top_k}")
    if second_expert not in SECOND_EXPERT_POLICIES:
        raise ValueError(
            f"second_expert must be one of {SECOND_EXPERT_POLICIES}, got {second_expert!r}"
        )
    G, S, E = logits.shape
    if top_k == 2 and E < 2:
        raise ValueError(f"top_k=2 needs at least 2 experts, got {E}")
    gates = F.softmax(logits, dim=-1)
    choice = gates.detach() if bias is None else gates.detach() + bias
    index_1 = choice.argmax(dim=-1)  # [G, S]
    mask_1 = F.one_hot(index_1, E).to(torch.int64)  # [G, S, E]
    gate_1 = gates.gather(-1, index_1.unsqueeze(-1)).squeeze(-1)

    # first choices: position by exclusive cumsum, the first C kept
    position_1 = (_exclusive_cumsum(mask_1) * mask_1).sum(-1)  # [G, S]
    kept_1 = position_1 < capacity
    count_1 = (mask_1 * kept_1.unsqueeze(-1)).sum(dim=-2)  # [G, E] kept first choices

    if top_k == 1:
        weight = (gate_1 * kept_1).unsqueeze(-1)
        return Routing(
            expert=index_1.unsqueeze(-1),
            position=position_1.unsqueeze(-1),
            kept=kept_1.unsqueeze(-1),
            weight=weight,
            gates=gates,
            first=mask_1,
            capacity=capacity,
        )

    others = mask_1.bool()
    if second_expert == "sampling":
        if gumbel is None or gumbel.shape != logits.shape:
            raise ValueError("route: second_expert='sampling' needs gumbel noise [G, S, E]")
        index_2 = (logits.detach() + gumbel).masked_fill(others, float("-inf")).argmax(-1)
    else:
        index_2 = choice.masked_fill(others, float("-inf")).argmax(-1)
    mask_2 = F.one_hot(index_2, E).to(torch.int64)
    gate_2 = gates.gather(-1, index_2.unsqueeze(-1)).squeeze(-1)
    if second_expert == "random":
        if uniform is None or uniform.shape != (G, S):
            raise ValueError("route: second_expert='random' needs uniform draws [G, S]")
        drawn = uniform < gate_2.detach() / SECOND_EXPERT_THRESHOLD
        mask_2 = mask_2 * drawn.unsqueeze(-1)
    else:
        drawn = torch.ones_like(index_2, dtype=torch.bool)

    # second choices start after all kept first choices of their expert
    position_2 = ((_exclusive_cumsum(mask_2) + count_1.unsqueeze(-2)) * mask_2).sum(-1)
    kept_2 = drawn & (position_2 < capacity)

    g1 = gate_1 * kept_1
    g2 = gate_2 * kept_2
    denom = g1 + g2
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    weight = torch.stack([g1 / denom, g2 / denom], dim=-1)
    # a second choice that was not drawn keeps its (meaningless) position past capacity
    # out of the "routed" count: mark it with position -1
    position_2 = torch.where(drawn, position_2, torch.full_like(position_2, -1))
    return Routing(
        expert=torch.stack([index_1, index_2], dim=-1),
        position=torch.stack([position_1, position_2], dim=-1),
        kept=torch.stack([kept_1, kept_2], dim=-1),
        weight=weight,
        gates=gates,
        first=mask_1,
        capacity=capacity,
    )


def combine_tensor(routing: Routing) -> torch.Tensor:
    """GShard's dense ``combine`` tensor ``[G, S, E, C]``: ``weight`` at (token, expert,
    position) for every kept choice; ``dispatch`` is ``combine > 0`` (for readers and tests;
    the layer never builds it)."""
    G, S, k = routing.expert.shape
    E, C = routing.num_experts, routing.capacity
    out = routing.weight.new_zeros(G, S, E, C)
    g, s, j = torch.nonzero(routing.kept, as_tuple=True)
    out[g, s, routing.expert[g, s, j], routing.position[g, s, j]] = routing.weight[g, s, j]
    return out


__all__ = ["SECOND_EXPERT_POLICIES", "Routing", "capacity", "combine_tensor", "route"]
