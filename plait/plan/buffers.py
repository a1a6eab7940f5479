"""Communication buffers per rank: what the collectives of a layout hold beside the model
states and the saved activations (the ZeRO paper's "residual states", section 3).

Per rank, ``e`` bytes per 16-bit element, ``b s h`` one micro-batch's activation::

    ZeRO-3 / FSDP   3 e U          the gathered unit being used, the next one prefetched,
                                   and its gradient before the reduce-scatter (U: the
                                   largest block's parameters on this rank: a dense
                                   block's split part / t and whole part; an MoE block's
                                   attention / t, its norms, router and shared expert
                                   whole, and its E / ep local experts, whole on every tp
                                   rank, when that is larger)
    ZeRO 0-2        2 x 25 MB      gradient buckets in flight (DDP's default bucket)
    pipeline        2 e b s h / t  a send and a receive buffer (SP or scatter/gather:
                                   ``/t``; the whole activation otherwise)
    experts         2 k e b s h    the all-to-all's dispatch and combine buffers (top-k)
    ring (cp)       6 KV           backward, at a step j >= 1: the K/V block in use and the
                                   next one arriving, and of dK/dV this step's share, the
                                   running sum arriving, the one leaving, the rank's own
                                   (forward holds two); KV = 2 e b (s/c) kv / t, the keys'
                                   and values' width kv (grouped-query: kv heads x head_dim)
    Ulysses (cp)    e b (s/c)      the head-split q, k, v an all-to-all receives into
                    (q + 2 kv)/t   while the sequence-split ones are alive

These are allocations that come and go; the planner counts them at their peak, together.
The allocator's fragmentation is the device's ``memory_reserve`` (10% on the GPU presets),
printed as the fragmentation margin.
"""

from __future__ import annotations

from plait.plan.layout import Job, Layout
from plait.plan.model import ModelSpec

BUCKET_BYTES = 25e6  # torch DDP's default bucket_cap_mb


def gathered_unit(model: ModelSpec, layout: Layout) -> float:
    """Parameters of the largest block ZeRO-3 / FSDP gathers on one rank (module doc): of
    the block kinds the model has, dense and MoE (an MoE block with its ``experts / ep``
    local experts)."""
    units = []
    if model.dense_layers:
        split, whole = model.block_split(moe=False)
        units.append(split / layout.tp + whole)
    if model.moe_layers:
        split, whole = model.block_split(moe=True)
        local = model.experts // layout.ep * model.mlp_params()
        units.append(split / layout.tp + whole + local)
    return max(units)


def buffer_bytes(model: ModelSpec, job: Job, layout: Layout) -> float:
    """Peak communication-buffer bytes on one rank (module doc)."""
    lay, e = layout, job.element_bytes
    act = lay.tokens(job) * model.hidden * e
    total = 0.0
    if lay.cp > 1:
        kv, q = model.kv * model.hd / lay.tp, model.heads * model.hd / lay.tp
        if lay.context == "ring":
            total += 6 * 2 * e * lay.tokens(job) * kv
        else:
            total += e * lay.tokens(job) * (q + 2 * kv)
    if lay.replicas > 1:
        if lay.zero == 3:
            total += 3 * e * gathered_unit(model, lay)
        else:
            total += 2 * BUCKET_BYTES
    if lay.pp > 1:
        sharded = lay.sp or (lay.tp > 1 and job.pp_scatter_gather)
        total += 2 * act / (lay.tp if sharded else 1)
    if lay.ep > 1:
        total += 2 * model.top_k * act
    return total


__all__ = ["BUCKET_BYTES", "buffer_bytes", "gathered_unit"]
