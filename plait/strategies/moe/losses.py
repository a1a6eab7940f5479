"""The soft limit: losses and a bias that push the router toward a balanced load.

The hard limit (capacity, ``gshard_gate.capacity``) drops what overflows; these make
overflow rarer. All are local functions of one rank's routing (no communication).

- :func:`gshard_aux_loss`: GShard's ``l_aux = mean_e(m_e * c_e / S) * E^2`` per group, averaged
  over the groups: ``m_e`` is the mean router probability of expert e over the group's S
  tokens, ``c_e`` how many of them chose e first (before capacity). Differentiable through
  ``m_e`` only (``c_e`` is a count). Uniform routing gives 1.
- :func:`switch_aux_loss`: Switch Transformer's ``E * sum_i f_i * P_i`` over every token of
  the call (``f_i`` fraction routed first to i, ``P_i`` mean probability). Note
  ``mean_e(m_e c_e / S) E^2 = E sum_e m_e f_e``: the two are the same formula; they differ
  in the set of tokens it is taken over (each group, or the whole batch; equal with one
  group) and in the weight the papers use (Switch: alpha = 1e-2).
- :func:`z_loss`: the router z-loss of ST-MoE, ``mean over tokens of logsumexp(logits)^2``,
  keeps the logits small.
- :func:`balance_bias_step`: auxiliary-loss-free balancing (DeepSeek-V3, torchtitan's
  ``expert_bias``): after a step, ``bias_e += rate * sign(mean_load - load_e)``; the bias
  is added to the scores for the choice of experts only, never to the combine weights.

Under expert parallelism each rank takes these over its own groups; the data-parallel
gradient average then averages them over the ranks, which for the GShard form (a mean over
groups, every rank holding as many groups) equals the one-process loss over all groups.
The Switch form is a batch statistic: over several ranks it becomes the mean of the
per-rank values (as in DeepSpeed and Megatron's default per-micro-batch aux loss).
"""

from __future__ import annotations

import torch

AUX_LOSSES = ("gshard", "switch")


def gshard_aux_loss(gates: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """``mean over groups of mean_e(m_e * c_e / S) * E^2`` for ``gates, first [G, S, E]``."""
    E = gates.shape[-1]
    m = gates.mean(dim=-2)  # [G, E] mean probability
    c = first.to(gates.dtype).mean(dim=-2)  # [G, E] fraction routed first = c_e / S
    return (m * c).mean(dim=-1).mean() * E * E


def switch_aux_loss(gates: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """``E * sum_i f_i * P_i`` over every token of ``gates, first [..., E]``."""
    E = gates.shape[-1]
    P = gates.reshape(-1, E).mean(dim=0)
    f = first.reshape(-1, E).to(gates.dtype).mean(dim=0)
    return E * (f * P).sum()


def aux_loss(kind: str, gates: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """The auxiliary loss named ``kind`` (``"gshard"`` or ``"switch"``)."""
    if kind == "gshard":
        return gshard_aux_loss(gates, first)
    if kind == "switch":
        return switch_aux_loss(gates, first)
    raise ValueError(f"aux_loss must be one of {AUX_LOSSES}, got {kind!r}")


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """``mean over tokens of logsumexp(logits)^2`` (ST-MoE's router z-loss)."""
    return torch.logsumexp(logits, dim=-1).pow(2).mean()


def balance_bias_step(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    """In place: ``bias += rate * sign(mean(load) - load)`` (underloaded experts gain)."""
    with torch.no_grad():
        load = load.to(bias.dtype)
        bias.add_(rate * torch.sign(load.mean() - load))


__all__ = [
    "AUX_LOSSES",
    "aux_loss",
    "balance_bias_step",
    "gshard_aux_loss",
    "switch_aux_loss",
    "z_loss",
]
