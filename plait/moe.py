"""``plait.moe``: the mixture-of-experts layer and expert parallelism under short names.

``plait.moe.MoE(d_model, num_experts=8, top_k=2, ...)``, ``plait.moe.expert_parallel(model,
mesh=plait.Mesh(ep=2, dp=2))``, ``plait.moe.collect(model)`` (load statistics of the last
step) and ``plait.moe.plot_tokens_per_expert(history, path)``. The code lives in
``plait/strategies/moe/`` (``gshard_gate.py`` is GShard's gating).
"""

from plait.strategies import moe as _moe
from plait.strategies.moe import *  # noqa: F403  (the same names, one list: _moe.__all__)

__all__ = list(_moe.__all__)
