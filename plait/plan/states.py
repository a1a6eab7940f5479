"""Model-state memory per rank of a layout: which parameters a rank holds, then ZeRO.

Which parameters (elements) a rank holds, 1D tensor parallelism over ``t`` ranks as plait's
:func:`plait.models.gpt.tp_plan` and Megatron shard them (``f`` the MLP multiplier)::

    dense block   sharded  (4 + 2f) h^2 + (3 + f) h   qkv W and b, proj W, fc1 W and b, fc2 W
                  whole    6 h                        proj and fc2 biases, two LayerNorms
    MoE block     sharded  4 h^2 + 3 h                the attention's, as above
                  whole    5 h + h E                  proj bias, LayerNorms, the gate
                           (+ the shared expert       Qwen2-MoE's, and its gate)
                  experts  (E / ep) (2 f h^2 + (f + 1) h)   each expert whole on one ep rank

An MoE block's sparse MLP is not split by tensor parallelism: plait's plans keep it whole
on every tp rank (:func:`plait.models.gpt.tp_plan` leaves plait's MoE MLPs out,
:func:`plait.models.mixtral.moe_tp_plan` keeps each Hugging Face sparse block whole, router,
experts, shared expert and its gate; PTD-P's stacked experts are split over ep and
replicated over tp), so its router and shared expert count whole on every tp rank and the
routed experts are divided by ``ep`` only.
    embedding     ceil(V / t) h sharded (vocabulary-parallel), s h whole (positions)
    head          ceil(V / t) h sharded (unless tied), 2 h whole (final LayerNorm); a tied
                  head on another pipeline rank than the embedding keeps its own copy of
                  the embedding's shard (Megatron synchronises the two)

The grid modes (2D, 2.5D, 3D) divide every tensor over their weight grid (``q^2`` ranks in
2D and 2.5D, whose depth layers hold copies; ``q^3`` in 3D): an approximation for the
vectors, which are split over ``q`` and replicated over the rest of the grid.

Pipeline rank ``r`` holds the blocks of its stages (stage ``c p + r`` for chunk ``c``, or
``r`` and ``2p - 1 - r`` in the V of ``zbv``); stage 0 adds the embedding, the last stage
the head. The result is for the rank whose model states are largest.

Then each kind of state is counted by :func:`plait.plan.memory.estimate` (the ZeRO
paper's bytes per parameter), with the dense parameters replicated over the ``dp * ep * cp``
ranks that see different tokens and the expert parameters over ``dp * cp`` (the cp ranks
see different pieces of the same sequences; Megatron's distributed optimizer shards over
dp x cp too)::

    bytes = estimate(D, n = dp * ep * cp, zero) + estimate(X, n = dp * cp, zero)

``zero``: 0 is ``"ddp"``, 1-3 are ``"zero1"``-``"zero3"`` (3 = FSDP).

Adam and AdamW also keep a 4-byte ``step`` counter per tensor they update (PyTorch's, a
float32 scalar), counted in the optimizer bytes (:func:`step_counters`): one per parameter
tensor held (a block has 12: two LayerNorms, qkv, proj, fc1, fc2, each weight and bias; a
MoE block 9 plus 4 per local expert; the embedding 2; the last stage 2 and its head), one
per flat shard under ZeRO-1/2 (one per kind, dense or expert, that the rank holds), one per
flat FSDP unit under ZeRO-3 (each block wrapped, plus the root). Negligible at scale, but
the difference between the planner and ``measure`` on a small model.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from plait.plan import memory, whole_matrix
from plait.plan.layout import Job, Layout, LayoutError
from plait.plan.model import ModelSpec
from plait.plan.tensor_costs import grid_of

STAGE_NAMES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}


@dataclass(frozen=True)
class ModelStates:
    """Model-state bytes of the largest rank of a layout (module doc)."""

    rank: int  # pipeline rank (coordinate along pp) whose states are largest
    dense_params: int  # elements held, replicated over dp * ep
    expert_params: int  # elements held, replicated over dp
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    total_bytes: float
    formula: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _tp_divisor(model: ModelSpec, layout: Layout) -> int:
    """How many ways a weight is split over the tensor-parallel ranks."""
    if layout.tp_mode == "1d":
        return layout.tp

    depth = layout.depth if layout.tp_mode == "2.5d" else None
    q, _ = grid_of(layout.tp_mode, layout.tp, depth)
    return q**3 if layout.tp_mode == "3d" else q * q


def rank_contents(model: ModelSpec, layout: Layout) -> list[tuple[int, int, bool, bool]]:
    """Per pipeline rank: ``(dense blocks, MoE blocks, holds stage 0, holds the last
    stage)``. Stage ``c p + r`` sits on rank ``r`` (chunk ``c``); under ``zbv`` and
    ``dualpipev`` (the V) rank ``r`` holds stages ``r`` and ``2p - 1 - r``; a stage holds
    ``layers / (pp v)`` blocks."""
    p, v = layout.pp, layout.v
    stages = p * v
    per_stage = model.layers // stages
    if layout.schedule in ("zbv", "dualpipev"):  # the V
        placement = [s if s < p else 2 * p - 1 - s for s in range(stages)]
    else:
        placement = [s % p for s in range(stages)]
    if not model.experts:  # every rank v stages of dense blocks (the search's hot path)
        first, last = placement[0], placement[-1]
        return [(per_stage * v, 0, first == r, last == r) for r in range(p)]
    dense = [0] * p
    moe = [0] * p
    for s in range(stages):
        r = placement[s]
        for i in range(s * per_stage, (s + 1) * per_stage):
            if model.is_moe(i):
                moe[r] += 1
            else:
                dense[r] += 1
    return [(dense[r], moe[r], placement[0] == r, placement[-1] == r) for r in range(p)]


def rank_params(model: ModelSpec, layout: Layout) -> list[tuple[int, int]]:
    """``(dense, expert)`` parameter elements held by each pipeline rank (module doc)."""
    h, t = model.hidden, layout.tp
    grid = layout.tp_mode != "1d"
    div = _tp_divisor(model, layout)

    def split(sharded: int, whole: int) -> int:
        if grid:
            return math.ceil((sharded + whole) / div)
        return math.ceil(sharded / t) + whole

    dense_block = split(*model.block_split(moe=False))
    moe_block = split(*model.block_split(moe=True))
    experts = (model.experts // layout.ep) * model.mlp_params() if model.experts else 0
    vocab_rows = math.ceil(model.vocab / t) if not grid else 0
    table = model.seq_len * h if model.positions == "learned" else 0
    embedding = vocab_rows * h + table if not grid else split(0, model.embedding_params())
    head_weight = vocab_rows * h if not grid else split(0, model.vocab * h)
    out = []
    for dense_blocks, moe_blocks, first, last in rank_contents(model, layout):
        dense = dense_blocks * dense_block + moe_blocks * moe_block
        expert = moe_blocks * experts
        if first:
            dense += embedding
        if last:
            dense += split(0, model.norm_params()) if grid else model.norm_params()
            if not model.tied or not first:
                dense += head_weight
        out.append((dense, expert))
    return out


def step_counters(model: ModelSpec, layout: Layout) -> list[int]:
    """Adam's step counters held by each pipeline rank (module doc)."""
    out = []
    local_experts = model.experts // layout.ep if model.experts else 0
    for (dense_blocks, moe_blocks, first, last), (dense, expert) in zip(
        rank_contents(model, layout), rank_params(model, layout), strict=True
    ):
        if layout.zero in (1, 2):
            out.append(int(dense > 0) + int(expert > 0))
        elif layout.zero == 3:
            out.append(dense_blocks + moe_blocks + 1)
        else:
            n = dense_blocks * model.block_tensors(False)
            n += moe_blocks * (model.block_tensors(True) + model.mlp_tensors() * local_experts)
            n += model.embedding_tensors() if first else 0
            final_norm = 2 if model.norm == "layernorm" else 1
            n += (final_norm + (0 if model.tied and first else 1)) if last else 0
            out.append(n)
    return out


def rank_states(model: ModelSpec, job: Job, layout: Layout) -> list[ModelStates]:
    """Parameters, gradients and optimizer state of each pipeline rank (module doc)."""
    strategy = STAGE_NAMES[layout.zero]
    counters = step_counters(model, layout)
    out = []
    for r, (dense, expert) in enumerate(rank_params(model, layout)):
        parts = [
            memory.estimate(
                num_params=count,
                world_size=n,
                strategy=strategy,
                optimizer=job.optimizer,
                precision=job.precision,
            )
            for count, n in ((dense, layout.replicas), (expert, layout.dp * layout.cp))
            if count
        ]
        params = sum(e.params_bytes for e in parts)
        grads = sum(e.grads_bytes for e in parts)
        optim = sum(e.optimizer_bytes for e in parts)
        formula = f"dense D={dense:,} over n={layout.replicas}: {parts[0].formula}"
        if expert:
            formula += f"; experts X={expert:,} over n={layout.dp * layout.cp}: {parts[-1].formula}"
        if job.optimizer in ("adam", "adamw"):
            optim += 4 * counters[r]
            formula += f"; + 4 x {counters[r]} Adam step counters"
        if job.whole_matrix:
            optim, formula = _whole_matrix(model, job, layout, r, dense, optim, formula)
        out.append(
            ModelStates(r, dense, expert, params, grads, optim, params + grads + optim, formula)
        )
    return out


def _whole_matrix(
    model: ModelSpec, job: Job, layout: Layout, r: int, dense: int, optim: float, formula: str
) -> tuple[float, str]:
    """Pipeline rank ``r``'s optimizer bytes with its blocks' hidden matrices under a
    whole-matrix optimizer (:mod:`plait.plan.whole_matrix`): their slices leave the job
    optimizer's count, their owned whole state is added."""
    if layout.tp_mode != "1d":
        raise LayoutError(
            f"whole_matrix={job.whole_matrix!r} with tp_mode={layout.tp_mode!r}: plait steps "
            f"whole-matrix optimizers under 1D tensor parallelism only"
        )
    dense_blocks, moe_blocks, _, _ = rank_contents(model, layout)[r]
    numels = dense_blocks * whole_matrix.block_matrices(model)
    numels += moe_blocks * whole_matrix.block_matrices(model, moe=True)
    sliced = sum(math.ceil(n / layout.tp) for n in numels)
    rest = memory.estimate(
        num_params=max(dense - sliced, 1),
        world_size=layout.replicas,
        strategy=STAGE_NAMES[layout.zero],
        optimizer=job.optimizer,
        precision=job.precision,
    )
    full = memory.estimate(
        num_params=dense,
        world_size=layout.replicas,
        strategy=STAGE_NAMES[layout.zero],
        optimizer=job.optimizer,
        precision=job.precision,
    )
    per = whole_matrix.state_bytes_per_element(job.whole_matrix or "", job.precision)
    owned = whole_matrix.owned_bytes(
        numels, tp=layout.tp, replicas=layout.replicas, zero=layout.zero, per=per
    )
    optim += rest.optimizer_bytes - full.optimizer_bytes + owned
    formula += (
        f"; {job.whole_matrix} on {len(numels)} hidden matrices ({sum(numels):,} elements) "
        f"owned whole over tp={layout.tp}{' x ' + str(layout.replicas) if layout.zero else ''}:"
        f" {owned:,.0f} bytes on the largest rank"
    )
    return optim, formula


def model_states(model: ModelSpec, job: Job, layout: Layout) -> ModelStates:
    """Parameters, gradients and optimizer state on the largest rank (module doc)."""
    return max(rank_states(model, job, layout), key=lambda s: s.total_bytes)


__all__ = ["ModelStates", "model_states", "rank_contents", "rank_params", "rank_states"]
