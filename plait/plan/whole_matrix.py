"""Optimizer-state memory when the blocks' hidden matrices take a whole-matrix optimizer
(``Job(whole_matrix="muon")``, ``plait plan fit --whole-matrix muon``): Muon as it is used,
on the attention projections and the dense MLP's matrices, the job's optimizer (Adam) on
everything else (embeddings, head, norms, biases, routed experts).

plait steps a whole-matrix optimizer by parameter ownership
(:mod:`plait.strategies.whole_matrix`): a matrix is never split, its state lives whole on
one rank. Under tensor parallelism the matrices of a pipeline rank's blocks are dealt
over the tp group (full matrices, not their slices); with ZeRO (``zero`` >= 1) the
matrices a tp rank owns are dealt again over the ``dp * ep * cp`` ranks holding the same
ones (PTD-P's nested ownership); without ZeRO every replica keeps its tp rank's share.
Each level deals by size (:func:`plait.plan.memory.owned_state_bytes`), so the largest
rank holds ``max_r sum numel`` and not ``P/n``.

Bytes per owned element: Muon's float32 momentum, 4, plus the float32 master copy under
``precision="mixed"`` (the ZeRO paper's accounting: the master lives with the optimizer
state), 8 in all. No communication; plain arithmetic.
"""

from __future__ import annotations

from plait.plan import memory
from plait.plan.model import ModelSpec

KINDS = ("muon",)


def state_bytes_per_element(kind: str, precision: str) -> int:
    """Bytes of optimizer state per owned element (module doc)."""
    if kind not in KINDS:
        raise ValueError(f"whole_matrix={kind!r}; the planner knows {list(KINDS)}")
    return 4 + (4 if precision == "mixed" else 0)


def block_matrices(model: ModelSpec, moe: bool = False) -> list[int]:
    """Full element counts of one block's hidden matrices: the attention projections
    (fused q/k/v as one, or three) and the output projection; a dense block's MLP
    matrices too (two, or three gated). An MoE block's experts keep the job's optimizer."""
    h, q, kv = model.hidden, model.heads * model.hd, model.kv * model.hd
    attention = [h * (q + 2 * kv)] if model.fused_qkv else [h * q, h * kv, h * kv]
    attention.append(q * h)
    if moe:
        return attention
    return attention + [model.ffn * h] * (3 if model.gated else 2)


def owned_bytes(numels: list[int], *, tp: int, replicas: int, zero: int, per: float) -> float:
    """Whole-matrix state bytes on the largest rank: dealt over ``tp``, then (ZeRO) over
    the ``replicas`` holding the same matrices (module doc)."""
    if not numels:
        return 0.0
    # deferred: the planner imports no strategy at module level
    from plait.strategies.whole_matrix.owners import ownership

    owners = ownership(numels, tp)
    worst = 0.0
    for t in range(tp):
        mine = [n for n, r in zip(numels, owners, strict=True) if r == t]
        if zero and replicas > 1:
            load = max(memory.owned_state_bytes(mine, replicas, state_bytes_per_element=per))
        else:
            load = sum(mine) * per
        worst = max(worst, load)
    return worst
