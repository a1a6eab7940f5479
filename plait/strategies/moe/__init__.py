"""Mixture of experts (GShard) with expert parallelism.

- ``gshard_gate``: GShard's top-1/top-2 gating (second-expert policies, capacity, positions
  by exclusive cumulative sum, drops) as pure functions, :func:`route` and :func:`capacity`.
- ``losses``: the soft limit: GShard's and Switch's auxiliary losses, the router z-loss,
  auxiliary-loss-free bias balancing.
- ``dispatch``: dispatch and combine, the all-to-all autograd function.
- ``padded``: the static-capacity dispatch (``MoE(pad_to_capacity=True)``): GShard's
  ``[E, G*C, d]`` buffers, equal all-to-all splits, no host read.
- ``layer``: :class:`MoE`, the layer.
- ``expert_parallel``: :func:`expert_parallel` / :func:`prepare_ep`, experts split over the
  mesh's ``ep`` group, the rest data parallel.
- ``plan``: :class:`MoEPlan`, how a model's own MoE blocks are laid out; ``stacked``: expert
  parallelism on them (the model's router decides, plait dispatches).
- ``stats``: :class:`MoEStats` per step and :func:`plot_tokens_per_expert`.
"""

from plait.strategies.moe.dispatch import all_to_all_rows
from plait.strategies.moe.expert_parallel import ExpertParallelInfo, expert_parallel, prepare_ep
from plait.strategies.moe.gshard_gate import Routing, capacity, combine_tensor, route
from plait.strategies.moe.layer import Expert, MoE, moe_layers, update_expert_bias
from plait.strategies.moe.losses import gshard_aux_loss, switch_aux_loss, z_loss
from plait.strategies.moe.plan import MoEPlan
from plait.strategies.moe.stats import MoEStats, collect, plot_tokens_per_expert

__all__ = [
    "Expert",
    "ExpertParallelInfo",
    "MoE",
    "MoEPlan",
    "MoEStats",
    "Routing",
    "all_to_all_rows",
    "capacity",
    "collect",
    "combine_tensor",
    "expert_parallel",
    "gshard_aux_loss",
    "moe_layers",
    "plot_tokens_per_expert",
    "prepare_ep",
    "route",
    "switch_aux_loss",
    "update_expert_bias",
    "z_loss",
]
