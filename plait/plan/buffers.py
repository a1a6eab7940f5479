"""Communication buffers per rank: what the collectives of a layout hold beside the model
states and the saved activations (the ZeRO paper's "residual states", section 3).

Per rank, ``e`` bytes per 16-bit element, ``b s h`` one micro-batch's activation::

    ZeRO-3 / FSDP   3 e U / t      the gathered unit being used, the next one prefetched,
                                   and its gradient before the reduce-scatter (U: the
                                   largest unit's parameters, one block)
    ZeRO 0-2        2 x 25 MB      gradient buckets in flight (DDP's default bucket)
    pipeline        2 e b s h / t  a send and a receive buffer (SP or scatter/gather:
                                   ``/t``; the whole activation otherwise)
    experts         2 k e b s h    the all-to-all's dispatch and combine buffers (top-k)

These are allocations that come and go; the planner counts them at their peak, together.
The allocator's fragmentation is the device's ``memory_reserve`` (10% on the GPU presets),
printed as the fragmentation margin.
"""

from __future__ import annotations

from plait.plan.layout import Job, Layout
from plait.plan.model import ModelSpec

BUCKET_BYTES = 25e6  # torch DDP's default bucket_cap_mb


def buffer_bytes(model: ModelSpec, job: Job, layout: Layout) -> float:
    """Peak communication-buffer bytes on one rank (module doc)."""
    lay, e = layout, job.element_bytes
    act = lay.microbatch * job.seq * model.hidden * e
    total = 0.0
    if lay.data_shards > 1:
        if lay.zero == 3:
            split, whole = model.block_split(moe=False)
            total += 3 * e * (split / lay.tp + whole)
        else:
            total += 2 * BUCKET_BYTES
    if lay.pp > 1:
        sharded = lay.sp or (lay.tp > 1 and job.pp_scatter_gather)
        total += 2 * act / (lay.tp if sharded else 1)
    if lay.ep > 1:
        total += 2 * model.top_k * act
    return total


__all__ = ["BUCKET_BYTES", "buffer_bytes"]
