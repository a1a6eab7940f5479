"""``plait.moe``: the mixture-of-experts layer and expert parallelism under short names.

``plait.moe.MoE(d_model, num_experts=8, top_k=2, ...)``, ``plait.moe.expert_parallel(model,
mesh=plait.Mesh(ep=2, dp=2))``, ``plait.moe.collect(model)`` (load statistics of the last
step) and ``plait.moe.plot_tokens_per_expert(history, path)``. The code lives in
``plait/strategies/moe/`` (``gshard_gate.py`` is GShard's gating).
"""

from plait.strategies.moe import (
    Expert,
    ExpertParallelInfo,
    MoE,
    MoEStats,
    Routing,
    all_to_all_rows,
    capacity,
    collect,
    combine_tensor,
    expert_parallel,
    gshard_aux_loss,
    moe_layers,
    plot_tokens_per_expert,
    prepare_ep,
    route,
    switch_aux_loss,
    update_expert_bias,
    z_loss,
)

__all__ = [
    "Expert",
    "ExpertParallelInfo",
    "MoE",
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
