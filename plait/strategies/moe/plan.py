"""The MoE-block plan: what expert parallelism needs to know about a model's own sparse blocks.

plait's own :class:`~plait.strategies.moe.MoE` layer needs no plan. A model with its own
mixture-of-experts blocks (Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE, ...) describes them
with a :class:`MoEPlan`, which lives with the model's family (``plait/models/<family>.py``,
``moe_plan(model)``), so the strategy never imports a model.

What the plan says, and how expert parallelism uses it:

- **the expert containers**: modules (matched by class name, walking base classes) that
  hold every expert of one block, their weights *stacked* on dimension 0 (``stacked``:
  ``gate_up_proj [E, 2I, d]``, ``down_proj [E, d, I]`` in Hugging Face 5.x), called by the
  block as ``experts(hidden [T, d], top_k_index [T, k], top_k_weights [T, k]) -> [T, d]``.
  Expert parallelism keeps rows ``r*E/p .. (r+1)*E/p - 1`` of each stacked weight on ep rank
  ``r`` (sliced from the built model, not re-initialised) and replaces the container's
  forward: the block's own code still runs around it (its router decides top-k and the
  normalisation of the weights, a shared expert and its gate are added by the block), and
  plait dispatches the choices to the ranks holding their experts, runs them there with
  ``run_expert``, and combines the weighted outputs.
- **the routers**: modules whose output ``[logits_index]`` is the router logits that the
  model's auxiliary (load-balancing) loss reads (Hugging Face records them with a forward
  hook). In training, expert parallelism gathers them over every rank that feeds its own
  data (``dp x ep``), in batch-slice order, so the auxiliary loss each rank computes is that
  of the global batch, as in one process; ``aux_loss_on(model, kwargs)`` says whether a
  forward computes it (so nothing is gathered when it does not).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class MoEPlan:
    """How a model's sparse MoE blocks are laid out (module docstring).

    ``experts``: class names of the expert containers. ``stacked``: their parameters
    stacked by expert on dimension 0. ``num_experts``: the container attribute holding the
    number of experts ``E``. ``run_expert(container, local, rows)``: the output of the
    container's ``local``-th expert (index into the stacked weights this rank holds) on
    ``rows [n, d]``. ``routers``: class names of the routers whose output
    ``[logits_index]`` feeds the auxiliary loss (empty: no auxiliary loss).
    ``aux_loss_on(model, kwargs)``: whether a forward of the whole model with these keyword
    arguments computes the auxiliary loss. ``refuse_kwargs``: forward keyword arguments that
    cannot be honoured with global router logits, with the reason (for example the attention
    mask that Hugging Face's auxiliary loss reads per rank).
    """

    experts: tuple[str, ...]
    stacked: tuple[str, ...]
    run_expert: Callable[[nn.Module, int, torch.Tensor], torch.Tensor]
    num_experts: str = "num_experts"
    routers: tuple[str, ...] = ()
    logits_index: int = 0
    aux_loss_on: Callable[[nn.Module, dict[str, Any]], bool] | None = None
    refuse_kwargs: tuple[tuple[str, str], ...] = ()


def matches(module: nn.Module, names: tuple[str, ...]) -> bool:
    """``module``'s class, or one of its bases, is named in ``names``."""
    return any(cls.__name__ in names for cls in type(module).__mro__)


__all__ = ["MoEPlan", "matches"]
