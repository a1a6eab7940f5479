"""Activation memory per rank: Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models" (arXiv 2205.05198), section 4.

One transformer block keeps, for the backward pass, per micro-batch of ``b`` sequences of
``s`` tokens (``h`` hidden, ``a`` heads, ``t`` tensor-parallel ranks), in bytes with 16-bit
activations and 1-byte dropout masks (the paper's Table 2)::

    no parallelism               s b h (34 + 5 a s / h)
    tensor parallel              s b h (10 + 24/t + 5 a s / (h t))
    tensor + sequence parallel   s b h (34/t + 5 a s / (h t))
    + selective recomputation    s b h 34/t          (attention's s x s tensors recomputed)
    full recomputation           2 s b h             (only the block's input is kept)

Where 34 and 5 come from, with ``e`` bytes per element (2 in the paper) and ``k`` bytes per
dropout mask element (1 with dropout, 0 without)::

    attention   QKV input e, Q and K 2e, V e, output-projection input e, its dropout mask k
                = (5e + k) s b h;  softmax output e, its dropout mask k, dropout output e
                = (2e + k) a s^2 b
    MLP         fc1 input e, GeLU input 4e, fc2 input 4e, dropout mask k = (9e + k) s b h
    LayerNorms  two inputs, 2e s b h

Tensor parallelism leaves ``(4e + 2k) s b h`` replicated (the LayerNorm inputs, the
inputs of QKV and fc1, the two dropout masks: ``10 s b h`` in the paper) and divides the
rest by ``t``; sequence parallelism divides the replicated part too. The grid modes (2D,
2.5D, 3D) split both batch and features over all ``t`` ranks: everything is divided by
``t`` (an approximation: the papers give no finer count). Full recomputation keeps the
block's input, ``e s b h`` (``/t`` with sequence parallelism: Megatron checkpoints the
sequence-sharded input; the paper's Table 2 writes ``2 s b h``).

A pipeline rank keeps the blocks of its chunks for every micro-batch in flight (forward
done, backward not), at most (in chunk-micro-batches, the first rank being the worst)::

    gpipe        m v               1f1b, zb-h1   min(p, m)
    interleaved  min(v p + p - 1, m v)   (Korthikanti: L (1 + (p-1)/(p v)) layers' worth)
    zbv          min(2 p, 2 m)     dualpipev    2 p + 1 (m >= 2 p: DualPipe's PP + 1)

(checked against :func:`plait.strategies.pipeline.simulate.peak_per_rank` in the tests).
The first rank also keeps the embedding's dropout mask ``k s b h`` per micro-batch in
flight; the rank with the head keeps, for one micro-batch, the final LayerNorm and head
inputs ``2e s b h`` (``/t`` with SP) and the logits in the activation dtype plus an fp32
softmax, ``(e + 4) s b V / t``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from plait.plan.layout import Job, Layout
from plait.plan.model import ModelSpec


@dataclass(frozen=True)
class ActivationMemory:
    """Bytes of saved activations on the worst pipeline rank (module doc)."""

    per_layer: float  # one block, one micro-batch
    layers_per_chunk: int
    in_flight: int  # chunk-micro-batches held at the peak
    blocks: float  # per_layer * layers_per_chunk * in_flight
    embedding: float
    head: float
    total: float
    formula: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def per_layer_bytes(
    *,
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    sp: bool = False,
    recompute: str = "none",
    element_bytes: int = 2,
    mask_bytes: int = 1,
    tp_mode: str = "1d",
) -> float:
    """Bytes one block keeps for one micro-batch (module doc)."""
    e, k = element_bytes, mask_bytes
    sbh = s * b * h
    if recompute == "full":
        return e * sbh / (t if sp or tp_mode != "1d" else 1)
    linear = (5 * e + k) + (9 * e + k) + 2 * e  # 34 for e=2, k=1
    replicated = 4 * e + 2 * k  # 10
    quadratic = 0.0 if recompute == "selective" else (2 * e + k) * a * s * s * b  # 5 a s^2 b
    if tp_mode != "1d" or sp:
        return (linear * sbh + quadratic) / t
    return replicated * sbh + ((linear - replicated) * sbh + quadratic) / t


def in_flight(schedule: str, *, p: int, m: int, v: int, last: bool = False) -> int:
    """Chunk-micro-batches the first pipeline rank (``last``: the last one) holds at the
    peak (module doc; the last rank: 1F1B 1, interleaved ``(v-1) p + 1``)."""
    if p == 1 or schedule == "none":
        return 1
    if schedule == "gpipe":
        return m * v
    if schedule == "zb-h1":
        return min(p, m)
    if schedule == "1f1b":
        return 1 if last else min(p, m)
    if schedule == "interleaved":
        return min((v - 1) * p + 1 if last else v * p + p - 1, m * v)
    if schedule == "zbv":
        return min(2 * p, 2 * m)
    if schedule == "dualpipev":
        return 2 * p + 1
    raise ValueError(f"in_flight: unknown schedule {schedule!r}")


def activation_memory(model: ModelSpec, job: Job, layout: Layout) -> ActivationMemory:
    """Saved activations on the worst rank of ``layout``: the first pipeline rank (blocks
    of every micro-batch in flight, the embedding; the head too when it sits there: one
    stage, or the V placement) or the last (its blocks and the head), whichever is more."""
    lay = layout
    s, b, h = job.seq, lay.microbatch, model.hidden
    e = job.element_bytes
    k = 1 if job.dropout else 0
    per = per_layer_bytes(
        s=s,
        b=b,
        h=h,
        a=model.heads,
        t=lay.tp,
        sp=lay.sp,
        recompute=lay.recompute,
        element_bytes=e,
        mask_bytes=k,
        tp_mode=lay.tp_mode,
    )
    m = lay.microbatches(job)
    chunk_layers = model.layers // (lay.pp * lay.v)
    shard = lay.tp if (lay.sp or lay.tp_mode != "1d") else 1
    head = 2 * e * s * b * h / shard + (e + 4) * s * b * model.vocab / lay.tp
    first_flying = in_flight(lay.schedule, p=lay.pp, m=m, v=lay.v)
    embedding = k * s * b * h / shard * min(first_flying, m)
    head_on_first = lay.pp == 1 or lay.schedule in ("zbv", "dualpipev")
    first = (per * chunk_layers * first_flying, embedding, head if head_on_first else 0.0)
    last_flying = in_flight(lay.schedule, p=lay.pp, m=m, v=lay.v, last=True)
    last = (per * chunk_layers * last_flying, 0.0, head)
    flying, (blocks, emb, hd) = max(
        ((first_flying, first), (last_flying, last)), key=lambda x: sum(x[1])
    )
    total = blocks + emb + hd
    formula = (
        f"{per:,.0f} B/layer x {chunk_layers} layers x {flying} in flight"
        f" + embedding {emb:,.0f} + head {hd:,.0f}"
    )
    return ActivationMemory(per, chunk_layers, flying, blocks, emb, hd, total, formula)


__all__ = ["ActivationMemory", "activation_memory", "in_flight", "per_layer_bytes"]
