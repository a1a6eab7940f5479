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

Without dropout (``k = 0``) there is no dropout output: the softmax output is the tensor the
product with V keeps, ``e a s^2 b`` (the formula above with ``k = 1`` is the paper's).

Other shapes (Llama, Mistral, Qwen, GPT-2: :mod:`plait.plan.hf`), per token of one block,
``q = a d`` the queries' width, ``kv`` the keys' and values' (grouped-query attention:
``kv = k d`` with ``k`` key/value heads), ``f`` the MLP's inner width, as PyTorch's autograd
keeps them for the Hugging Face modules (measured with ``saved_tensors_hooks`` in
tests/test_plan_activations.py, to within the norms' statistics)::

    kept whole by 1D TP   (4e + 2k) h        LayerNorm: as above (two norm inputs, the inputs
                                             of the q/k/v projection and of the MLP, 2 masks)
                          2 (4 + 2e) h       RMSNorm (HF's, PyTorch's): each of the two keeps
                                             its input cast to fp32 (4 h; the input itself at
                                             e = 4), the normalised input before the weight
                                             (e h, for the weight's gradient) and its output,
                                             the next projection's input (e h)
    split by TP           e (2 q + 2 kv)     fused attention: Q and K after RoPE (RoPE's
                                             backward needs only cos and sin), V, the
                                             kernel's output (the output projection's input)
                          4 e q              unfused (eager): repeat_kv copies K and V to the
                                             queries' width for the two products (GQA keeps
                                             no saving there), Q, the output projection's input
                          (4 + e) (q + kv)   q/k RMSNorm per head (Qwen3): fp32 input and
                                             normalised input of queries and keys
                          (n + 1) e f        MLP: the activation keeps ``n`` tensors of width
                                             f (a fused GeLU or SiLU kernel: its input, n = 1;
                                             HF's ``gelu_new``, GPT-2's, in Python ops: 4),
                                             fc2's input 1
                          + 2 e f            SwiGLU: the activation's output and the up
                                             projection's output, kept by their product
                                             (gated: 4 e f; a fused SwiGLU, Megatron's, 3 e f)
    attention core        e a s              unfused, softmax in the activation dtype (GPT-2,
                                             Megatron): its output, which the product with V
                                             keeps too; with dropout + (e + k) a s (mask and
                                             dropout output: the paper's 2e + k)
                          (4 + e) a s        HF's Llama family computes the softmax in fp32
                                             (4 a s) and keeps its cast to e too (4 a s at e = 4)
                          4 a                fused (``Job.flash_attention``, FlashAttention,
                                             PyTorch's SDPA): the fp32 log-sum-exp only

For GPT (LayerNorm, fused GeLU, ``q = kv = h``, ``f = 4h``) the split part is
``e (4h + 8h) = 24 h`` with ``e = 2``: the paper's formula. Not counted: a norm's statistics
(``4 b s`` bytes each), RoPE's cos and sin (``s d``, shared by every block).

A mixture-of-experts block (Mixtral, Qwen2-MoE, Qwen3-MoE, plait's GPT with ``experts``)
keeps a dense block's attention and norms (the MLP's input among them); its MLP is replaced
by a router over ``E`` experts, ``k = top_k`` routed copies of each token through experts of
inner width ``x`` (``expert_ffn``: ``moe_intermediate_size``, Mixtral's
``intermediate_size``) and, in Qwen2-MoE, a shared expert of width ``g``
(``shared_expert_intermediate_size``) scaled by a sigmoid gate. Per token, as autograd keeps
them for the Hugging Face blocks (their default grouped experts: the copies sorted by
expert, gathered into one matrix, the expert MLPs as grouped products; measured in
tests/test_plan_activations.py)::

    router      4 E             the softmax in fp32, which its backward needs (the logits
                                are not kept: neither the cast nor the router's projection,
                                whose input is the MLP's, needs them)
                8 k             the top-k choice's int64 indices
                4 k + 4         renormalised weights (Mixtral; ``norm_topk_prob``): the fp32
                                top-k values and their sum, kept by the division
    per copy    (n + 1) e x     the expert's MLP, counted as the dense MLP above with width
    (k copies)  + 2 e x gated   ``x`` (SwiGLU: 4 e x, the gate and up outputs, SiLU's
                                output, the down projection's input)
                2 e h           the gathered input (the up projection's weight gradient)
                                and the down projection's output (kept by its product with
                                the routing weight; the weighted copies are only summed
                                back to their token, which keeps nothing)
                4               the routing weight (fp32 in Mixtral; Qwen's router casts it
                                to ``e``: counted as 4, 2 bytes a copy over in bf16)
                24              three int64 indices: the sort by expert, its inverse, each
                                copy's token
    shared      (n + 1 + 2) e g the shared expert, a dense gated MLP of width ``g``
                e h + e         its output and the sigmoid gate, kept by their product

so a Mixtral block's MLP keeps, per token, ``4E + 12k + 4 + k (4 e x + 2 e h + 28)`` where
the dense count has ``4 e x`` (the measured Mixtral block is 1.68 times its dense count).
The dense blocks of an MoE model (``moe_every``, Qwen's ``mlp_only_layers``:
``ModelSpec.dense_at``) keep the dense count of ``ffn``.

Routing is dropless in the Hugging Face models: ``k b s`` copies per micro-batch, however
they fall on the experts. plait's own MoE layer (GShard gating, ``plait.strategies.moe``)
computes only the choices that fit each expert's capacity: ``k`` copies per token is its
upper bound (nothing dropped); capacity is not modelled, and neither are its gating tensors,
which the measurement does not cover. Tensor parallelism: plait's plans keep an MoE block's
MLP whole on every tensor-parallel rank (plait's GPT leaves the MoE MLPs out of its tp plan;
the Hugging Face MoE families' plan keeps each sparse block whole, shared expert included),
which runs it on the replicated input: the MoE terms above are in the "kept whole by 1D TP"
part, not divided by ``t``; under sequence parallelism each rank routes its own ``s / t``
tokens (divided by ``t``, like the grid modes' approximation). Expert parallelism over
``ep`` ranks: a rank routes its own tokens (the router's terms) and runs the copies the
all-to-all brings it for its ``E / ep`` experts, ``k b s`` rows per micro-batch on average
over the ranks, the same count as without ``ep``; the planner counts that mean (load
imbalance, which makes the busiest expert rank hold more, is not modelled). The all-to-alls'
dispatch and combine buffers are :mod:`plait.plan.buffers`'.

Context parallelism over ``c`` ranks (:mod:`plait.strategies.context`): each rank holds
``s / c`` tokens of every tensor above, so every per-token term is divided by ``c``. The
attention core never holds a score matrix under cp. Per token of a rank (measured on every
rank of plait's GPT and a Hugging Face Llama at cp 2 and 4: tests/test_plan_context_measured.py)::

    ring      e (2 q + 2 kv) + 4 a   the ring's saved q, k, v (its own rows, k and v
                                     compact: kv wide), its output (which the output
                                     projection keeps too: the same storage) and the fp32
                                     log-sum-exp of its rows; blockwise partials are merged
                                     with the online softmax and recomputed in the backward
    Ulysses   e (2 q + 2 kv') + 4 a  the fused kernel's saved head-split copies of q, k, v,
              + e q                  its output and log-sum-exp (a / c heads of all s
                                     tokens: the same bytes as s / c tokens of all heads),
                                     and the output brought back to this rank's tokens (the
                                     output projection's input, a second copy of the
                                     output); ``kv' = kv`` when ``c`` divides the key/value
                                     heads (per tp rank), else ``q``: the keys and values are
                                     repeated to every query head before the all-to-all

so Ulysses keeps ``e q`` per token more than the ring (``e (q + 2 (q - kv))`` when the
key/value heads do not split; until measured the planner counted the ring's figure for both,
6% of a block short for plait's GPT, 9% for a Llama with 2 key/value heads at cp 4). An
unfused kernel under Ulysses (``flash_attention`` off) keeps its ``s x s`` core for ``a / c``
heads, the one-rank figure / ``c``, and no second output copy (its output is not saved).

The ring's keys and values of the block in flight are communication buffers
(:mod:`plait.plan.buffers`), held for one layer at a time, not per layer.

A pipeline rank keeps the blocks of its chunks for every micro-batch in flight (forward
done, backward not), at most (in chunk-micro-batches, for pipeline rank ``r``; a chunk
counted as the mean of the rank's chunks when its dense and MoE blocks differ between
them)::

    gpipe        m v               1f1b   min(p - r, m)     zb-h1   min(p, m)
    interleaved  (v + 1) p - 1 - 2 r, m v when m = p (every forward first)
                 (rank 0: Korthikanti's L (1 + (p-1)/(p v)) layers' worth)
    zbv          min(2 p, 2 m)     dualpipev    2 p + 1 (m >= 2 p: DualPipe's PP + 1)

(checked rank by rank against :func:`plait.strategies.pipeline.simulate.peak_per_rank` in
the tests). :func:`rank_activations` counts every rank; :func:`activation_memory` is the
rank that keeps the most.
The first rank also keeps the embedding's dropout mask ``k s b h`` per micro-batch in
flight; the rank with the head keeps, for one micro-batch, the final norm's saved tensors
and the head's input (LayerNorm ``2e s b h``, RMSNorm ``(4 + 2e) s b h``; ``/t`` with SP),
the fp32 log-softmax of the loss (``4 s b V / t``, the cross-entropy's saved output) and
the logits in the activation dtype (``e s b V / t``: autograd does not save them, but the
model returns them and a loop that holds its output, ``out.loss.backward()``, keeps them
through the backward), ``(e + 4) s b V / t`` in all.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from plait.plan.layout import Job, Layout
from plait.plan.model import ModelSpec
from plait.plan.states import rank_contents


@dataclass(frozen=True)
class ActivationMemory:
    """Bytes of saved activations on one pipeline rank (module doc)."""

    per_layer: float  # one (dense) block, one micro-batch
    layers_per_chunk: int
    in_flight: int  # chunk-micro-batches held at the peak
    blocks: float  # the rank's blocks per chunk (per_layer, per_moe_layer) * in_flight
    embedding: float
    head: float
    total: float
    formula: str
    per_moe_layer: float = 0.0  # one mixture-of-experts block (0: the model has none)
    rank: int = 0  # the pipeline rank (coordinate along pp) these are of

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
    q: int = 0,
    kv: int = 0,
    ffn: int = 0,
    gated: bool = False,
    flash: bool = False,
    cp: int = 1,
    context: str = "ring",
    norm: str = "layernorm",
    qk_norm: bool = False,
    activation: str = "gelu",
    softmax_fp32: bool = False,
    experts: int = 0,
    top_k: int = 2,
    expert_ffn: int = 0,
    shared_ffn: int = 0,
    norm_topk: bool = True,
) -> float:
    """Bytes one block keeps for one micro-batch (module doc). ``q`` and ``kv``: the query
    and key/value widths (``a d`` and ``k d``; default ``h``, no grouped-query attention),
    ``ffn`` the MLP's inner width (default ``4 h``), ``gated`` a SwiGLU MLP, ``flash`` a
    fused attention that keeps no ``s x s`` tensor (module doc, "Other shapes"); ``cp``
    context-parallel ranks over the sequence, ``context`` their attention (module doc);
    ``norm``, ``qk_norm``, ``activation`` and ``softmax_fp32`` as :class:`ModelSpec`'s.
    ``experts`` > 0: an MoE block, its MLP ``top_k`` routed copies through experts of
    ``expert_ffn`` (default ``ffn``) and a shared expert of ``shared_ffn`` (module doc,
    "A mixture-of-experts block")."""
    e, k = element_bytes, mask_bytes
    tokens = s * b / cp  # this rank's
    if recompute == "full":
        return e * tokens * h / (t if sp or tp_mode != "1d" else 1)
    q, kv, f = q or h, kv or h, ffn or 4 * h
    fused = flash or (cp > 1 and context == "ring")
    # two norms (their inputs, RMSNorm's fp32 copy and normalised input) and the inputs of
    # the q/k/v projection and of the MLP; two dropout masks: 10 h for GPT (e 2, k 1)
    norms = 2 * (4 + 2 * e) if norm == "rmsnorm" else 4 * e
    replicated: float = norms * h + 2 * k * h
    # Q, K, V, the output projection's input: eager attention repeats K and V to q's width
    attention = e * (2 * q + 2 * kv) if fused else 4 * e * q
    if cp > 1 and context == "ulysses" and fused:
        # module doc: the head-split copies the fused kernel keeps, keys and values repeated
        # to q's width when the cp size does not divide this tp rank's key/value heads, and
        # the output's copy back on this rank's tokens (the output projection's input)
        if (kv * a // q // t) % cp:
            attention += 2 * e * (q - kv)
        attention += e * q
    if qk_norm:
        attention += (4 + e) * (q + kv)
    per_width = (4 if activation == "gelu_new" else 1) + 1 + (2 if gated else 0)
    if experts:
        # kept whole on every tensor-parallel rank (module doc): replicated unless SP
        replicated += moe_mlp_bytes(
            h=h,
            element_bytes=e,
            experts=experts,
            top_k=top_k,
            expert_ffn=expert_ffn or f,
            shared_ffn=shared_ffn,
            per_width=per_width,
            norm_topk=norm_topk,
        )
        mlp = 0
    else:
        mlp = per_width * e * f  # 8 e h for GPT
    split = attention + mlp  # 24 h for GPT
    if fused:
        # the log-sum-exp, fp32, per head and token of this rank; the scores are recomputed
        quadratic = 4.0 * a * tokens
    elif recompute == "selective":
        quadratic = 0.0
    else:
        # the softmax output (fp32 and its cast with softmax_fp32); with dropout its mask
        # and output: 5 a s^2 b for GPT (e 2, k 1), Ulysses: a / cp heads
        softmax = (4 + (e if e < 4 else 0)) if softmax_fp32 else e
        per_score = softmax + (e + k if k else 0)
        quadratic = per_score * a * s * s * b / cp
    if tp_mode != "1d" or sp:
        return ((replicated + split) * tokens + quadratic) / t
    return replicated * tokens + (split * tokens + quadratic) / t


def moe_mlp_bytes(
    *,
    h: int,
    element_bytes: int,
    experts: int,
    top_k: int,
    expert_ffn: int,
    shared_ffn: int = 0,
    per_width: int = 4,
    norm_topk: bool = True,
) -> float:
    """Bytes per token an MoE block's MLP keeps (module doc, "A mixture-of-experts block"):
    the router, ``top_k`` routed copies, the shared expert. ``per_width``: what the dense
    MLP keeps per element of its inner width (4 for SwiGLU with a fused SiLU)."""
    e, k = element_bytes, top_k
    router = 4 * experts + 8 * k + (4 * k + 4 if norm_topk else 0)
    copy = per_width * e * expert_ffn + 2 * e * h + 4 + 3 * 8
    shared = per_width * e * shared_ffn + e * h + e if shared_ffn else 0
    return float(router + k * copy + shared)


def model_layer_bytes(
    model: ModelSpec,
    job: Job,
    layout: Layout,
    *,
    recompute: str | None = None,
    moe: bool = False,
) -> float:
    """:func:`per_layer_bytes` of one of ``model``'s blocks under ``layout`` (its query,
    key/value and MLP widths, gated or not; ``job.flash_attention``); ``moe``: one of its
    mixture-of-experts blocks."""
    return per_layer_bytes(
        s=job.seq,
        b=layout.microbatch,
        h=model.hidden,
        a=model.heads,
        t=layout.tp,
        sp=layout.sp,
        recompute=layout.recompute if recompute is None else recompute,
        element_bytes=job.element_bytes,
        mask_bytes=1 if job.dropout else 0,
        tp_mode=layout.tp_mode,
        q=model.heads * model.hd,
        kv=model.kv * model.hd,
        ffn=model.ffn,
        gated=model.gated,
        flash=job.flash_attention,
        cp=layout.cp,
        context=layout.context,
        norm=model.norm,
        qk_norm=model.qk_norm,
        activation=model.activation,
        softmax_fp32=model.softmax_fp32,
        experts=model.experts if moe else 0,
        top_k=model.top_k,
        expert_ffn=model.expert_ffn,
        shared_ffn=model.shared_ffn,
        norm_topk=model.norm_topk,
    )


def in_flight(
    schedule: str, *, p: int, m: int, v: int, last: bool = False, rank: int | None = None
) -> int:
    """Chunk-micro-batches pipeline rank ``rank`` (default the first; ``last``: the last
    one) holds at the peak (module doc; rank ``r`` of 1F1B ``min(p - r, m)``, of interleaved
    ``(v + 1) p - 1 - 2 r``, or ``m v`` on every rank when ``m = p``: every forward first)."""
    r = (p - 1 if last else 0) if rank is None else rank
    if not 0 <= r < p:
        raise ValueError(f"in_flight: rank={r} outside 0..{p - 1}")
    if p == 1 or schedule == "none":
        return 1
    if schedule == "gpipe":
        return m * v
    if schedule == "zb-h1":
        return min(p, m)
    if schedule == "1f1b":
        return min(p - r, m)
    if schedule == "interleaved":
        return m * v if m <= p else min((v + 1) * p - 1 - 2 * r, m * v)
    if schedule == "zbv":
        return min(2 * p, 2 * m)
    if schedule == "dualpipev":
        return 2 * p + 1
    raise ValueError(f"in_flight: unknown schedule {schedule!r}")


def rank_activations(model: ModelSpec, job: Job, layout: Layout) -> list[ActivationMemory]:
    """Saved activations of each pipeline rank of ``layout`` (its ``rank`` field): its
    blocks (dense and MoE, over its ``v`` chunks: :func:`plait.plan.states.rank_contents`)
    for the micro-batches it holds at the peak (:func:`in_flight` of that rank), the
    embedding on the rank of stage 0, the head on the rank of the last stage (the first
    rank under the V of ``zbv`` and ``dualpipev``)."""
    lay = layout
    s, b, h = job.seq / lay.cp, lay.microbatch, model.hidden  # this rank's tokens
    e = job.element_bytes
    k = 1 if job.dropout else 0
    per = model_layer_bytes(model, job, lay)
    per_moe = model_layer_bytes(model, job, lay, moe=True) if model.moe_layers else 0.0
    m = lay.microbatches(job)
    chunk_layers = model.layers // (lay.pp * lay.v)
    shard = lay.tp if (lay.sp or lay.tp_mode != "1d") else 1
    final_norm = (4 + 2 * e) if model.norm == "rmsnorm" else 2 * e  # with the head's input
    head = final_norm * s * b * h / shard + (e + 4) * s * b * model.vocab / lay.tp

    def chunk(dense: int, moe: int) -> float:  # one chunk: the mean of the rank's
        if not moe:
            return per * (dense // lay.v)
        return (per * dense + per_moe * moe) / lay.v

    out = []
    for r, (dense, moe, first, last) in enumerate(rank_contents(model, lay)):
        flying = in_flight(lay.schedule, p=lay.pp, m=m, v=lay.v, rank=r)
        blocks = chunk(dense, moe) * flying
        emb = k * s * b * h / shard * min(flying, m) if first else 0.0
        hd = head if last else 0.0
        if not model.moe_layers:
            layers = f"{per:,.0f} B/layer x {chunk_layers} layers"
        else:  # the rank's blocks of each kind over its v chunks
            kinds = [(per, "dense", dense), (per_moe, "MoE", moe)]
            layers = " + ".join(f"{x:,.0f} B/{kind} layer x {n}" for x, kind, n in kinds if n)
            if lay.v > 1:
                layers = f"({layers}) / {lay.v} chunks"
        formula = f"{layers} x {flying} in flight + embedding {emb:,.0f} + head {hd:,.0f}"
        total = blocks + emb + hd
        out.append(
            ActivationMemory(
                per, chunk_layers, flying, blocks, emb, hd, total, formula, per_moe, rank=r
            )
        )
    return out


def activation_memory(model: ModelSpec, job: Job, layout: Layout) -> ActivationMemory:
    """Saved activations on the pipeline rank that keeps the most (:func:`rank_activations`;
    the first rank on ties)."""
    return max(rank_activations(model, job, layout), key=lambda a: a.total)


__all__ = [
    "ActivationMemory",
    "activation_memory",
    "in_flight",
    "model_layer_bytes",
    "moe_mlp_bytes",
    "per_layer_bytes",
    "rank_activations",
]
