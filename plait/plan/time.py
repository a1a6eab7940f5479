"""Step time of a layout: compute at a calibrated efficiency, communication per group with
alpha-beta costs, the pipeline bubble, and which of them overlap.

One optimizer step of ``m`` micro-batches on a pipeline of ``p`` ranks (Narayanan et al.
2021, Eq. 1, generalised to any schedule through its bubble fraction ``beta``)::

    step     = m * t_mb / (1 - beta)  +  (1 - overlap.dp) * t_dp
    t_mb     = t_compute + (1 - overlap.tp) (t_tp + t_ep) + t_cp + (1 - overlap.pp) t_pp

taken on the slowest pipeline rank (the one with the most blocks, or the head).

``t_compute = (F_split / t + F_whole) / (peak * efficiency) + blocks * passes * A / hbm``:
the rank's FLOPs for one micro-batch (:mod:`plait.plan.model`, recomputation included),
``F_split`` those the ``t`` tensor-parallel ranks share (attention, dense MLPs, the head) and
``F_whole`` an MoE block's MLP (router, routed experts, shared expert), which plait's plans
run whole on every tp rank (:meth:`~plait.plan.model.ModelSpec.block_flops_split`; ``/t``
under sequence parallelism, where each rank routes its own ``s/t`` tokens, and in the grid
modes, an approximation), and its memory-bound work (norms, activation functions,
softmax, dropout, residual adds): ``Cluster.elementwise_passes`` times ``A``, the bytes
a block saves without recomputation (:func:`plait.plan.activations.model_layer_bytes`, an
MoE block's own figure for the MoE blocks), at the HBM's bandwidth, 4/3 of that with full
recomputation (the forward runs twice).
The memory-bound share is what makes small GEMMs slow per FLOP: ``A / FLOPs`` per layer
goes as ``1/h`` (and as ``a s / h^2`` for the unfused softmax), so one efficiency
constant cannot serve both a 22B and a 1T model; two can (benchmarks/plan_validate.py).
A fused attention (``Job.flash_attention``) adds ``2 s a d`` FLOPs per token and block
(the backward's recomputed scores) and, with a causal mask, runs only the tiles the mask
does not hide entirely (``Job.causal_share``, 1/2): every pass over the ``s x s`` products
(forward, backward, a recomputed forward, the recomputed scores) costs half. These are the
FLOPs the hardware runs; MFU keeps the model FLOPs' formula (the whole square), as the
published runs report it.

Context parallelism (``cp = c``): a rank computes ``b s / c`` tokens of each sequence
(every per-token FLOP and byte below is of those tokens; the attention core still sees the
whole sequence's keys, ``4 s h`` per token); ``t_cp`` is the exposed part of the ring's
transfers or Ulysses' all-to-alls (:func:`plait.plan.costs.context_layer`: a ring step's
transfer is assumed hidden behind that step's blockwise attention, ``1/c`` of the rank's
attention core, up to its length).

Communication, ``S`` the micro-batch's activation ``b s h / c`` in bytes, groups laid out
as :class:`plait.Mesh` does (``tp`` innermost, then ``cp``, ``ep``, ``dp``, ``pp``; a group
is on the slow inter-node link as soon as it spans two nodes):

=====  ==========================================  ==========================================
group  what, per micro-batch (forward + backward)   cost (ring; alpha, beta of the group's link)
=====  ==========================================  ==========================================
tp     1D: per block 4 all-reduces of S (2 with       ``2(t-1) alpha + 2(t-1)/t S/beta`` each;
       experts), +2 with full recomputation; SP:      a reduce-scatter or all-gather is half
       a reduce-scatter and an all-gather instead;    of that
       embedding 1, head 1 (+3 small, the loss)
       2D/2.5D/3D: :func:`plait.plan.tensor_costs.   ``6(q-1)`` latency steps per linear
       linear_cost` per linear (4 per block, and
       the head; embedding and LayerNorm vectors
       not counted)
ep     per MoE block 4 all-to-alls of ``top_k S``     ``(ep-1) alpha + (ep-1)/ep top_k S/beta``
       (dispatch and combine, and their gradients)
cp     ring: per block ``(c-1)`` sends of K/V     ``alpha + KV/beta`` a step, hidden up
       (``KV = 2 b s kv e / (c t)``) forward,      to the step's attention (see above)
       ``(c-1)`` of 2 KV backward; Ulysses: per
       block 4 all-to-alls forward, 4 backward   ``(c-1) alpha + (c-1)/c X/beta`` each
       (q, k, v, the output; their gradients)
pp     2 v point-to-point messages of S/t             ``alpha + S/(t beta)`` each, + an
       (PTD-P's scatter/gather; SP's shard):          all-gather over tp without SP
       activations forward, gradients back; S         (``Job.pp_scatter_gather=False``:
       without scatter/gather                         S per message, no all-gather)
dp     per step: the gradients, all-reduced (ZeRO     ``2(n-1) alpha + 2(n-1)/n G/beta``;
       1-2: reduce-scatter + all-gather, the same     ZeRO-3: per unit ``3 (n-1) alpha +
       bytes; ZeRO-3, per unit (each block, and the   3 (n-1)/n G_u/beta``
       root): all-gathers in forward and backward,
       a reduce-scatter); dense over dp*ep*cp,
       experts over dp*cp
=====  ==========================================  ==========================================

The bubble ``beta``: GPipe and 1F1B ``(p-1)/(m+p-1)``, interleaved ``(p-1)/(vm+p-1)``,
ZB-H1 ``(p-1)/(3m+p-1)`` (:func:`plait.strategies.pipeline.simulate.formula_bubble`), ZBV
``(p-1)/(6m+p-1)`` (its fill, which the simulator measures; :func:`bubble` can run the
simulator instead for small pipelines, and does for ZB-H1 and ZBV with ``m < p``, where
the formulas undercount: at p = 8, m = 1 ZB-H1's is 0.70 and the simulated 0.82).
DualPipeV (``m >= 2p``, F&B pairs) is played by the simulator whenever it has at most
:data:`~plait.plan.costs.SIMULATE_ACTIONS` compute actions, else given ZBV's formula.

With a calibration (:mod:`plait.plan.measure.calibrate`, the CPU preset), every collective above is
its measured line for the group size instead of the ring formula; each block costs a
measured ``block_overhead`` per micro-batch on top of its FLOPs (operator dispatch: every
tensor-parallel rank and every micro-batch pays it whole); and the optimizer step
is added: ``torch.optim.Adam``'s measured seconds for the elements this rank updates (its
parameters, over ``dp`` under ZeRO). The strategies' own work, measured by
:mod:`plait.plan.measure.probe_runtime` and charged by what the layout does::

    t_tp    += calls * tp_call(t)           calls: :func:`~plait.plan.costs.tp_calls`
    t_comp  += actions * pipe_action        actions per micro-batch of the busiest rank
                                            (:func:`~plait.plan.costs.pipeline_actions`)
    step    += per_tensor * T + per_byte * G   DDP (plait's, pp = tp = 1), ZeRO-1/2, FSDP:
                                            T the rank's parameter tensors
                                            (:func:`~plait.plan.costs.param_tensors`),
                                            G its gradient bytes

On ranks that share cores (``Cluster.shared_cores``) a rank idle in the bubble frees its
share of the cores for the busy ones. With a calibration that measured what that costs
(:mod:`plait.plan.measure.probe_pipeline`: per schedule and pipeline size the ``wake`` a compute
action pays when a message woke it, and ZB's split backward's work against B's), the
schedule is played under processor sharing (:func:`~plait.plan.costs.shared_cores_path`):
the pipeline's share of the cores ``c pp / n``, every action's work its time with every
rank busy times ``c/n``, each message the p2p line. Without one:
``max(m t_mb, m t_mb' / (1 - beta))``, ``t_mb'`` with the compute at up to a whole core
(``Cluster.alone_speedup``): all the work at the shared speed, or the schedule's critical
path, whichever is longer.

Overlap rules (:class:`Overlap`, all 0 by default, as Megatron-LM ran for the published
runs): ``dp`` the share of the data-parallel reduction hidden behind the backward pass
(DDP's buckets hide most of it when ``p = 1``), ``tp`` and ``pp`` the share of tensor- and
pipeline-parallel traffic hidden behind compute. Not counted: the optimizer step (unless
calibrated), the data loader, kernel launch gaps beyond what ``efficiency`` absorbs, stragglers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from plait.plan.activations import model_layer_bytes
from plait.plan.costs import (
    SIMULATE_ACTIONS,
    collective_seconds,
    context_layer,
    critical_path,
    dp_seconds,
    gemm_slowdown,
    param_tensors,
    pipeline_actions,
    ring_seconds,
    shared_cores_path,
    tp_calls,
)
from plait.plan.hardware import Cluster
from plait.plan.layout import Job, Layout
from plait.plan.model import ModelSpec
from plait.plan.states import rank_contents, rank_params
from plait.plan.tensor_costs import gpt_linears, linear_cost
from plait.strategies.pipeline.schedules import build
from plait.strategies.pipeline.simulate import formula_bubble
from plait.strategies.pipeline.simulate import simulate as play


@dataclass(frozen=True, kw_only=True)
class Overlap:
    """Share (0..1) of each group's communication hidden behind compute (module doc)."""

    dp: float = 0.0
    tp: float = 0.0
    pp: float = 0.0


@dataclass(frozen=True)
class GroupComm:
    """One group's traffic in a step: bytes one rank sends, seconds, whether inter-node."""

    group: str
    size: int
    inter_node: bool
    bytes_per_step: float
    seconds: float


@dataclass(frozen=True)
class StepTime:
    """A predicted step (module doc); seconds unless named otherwise."""

    compute_per_mb: float
    tp_per_mb: float
    ep_per_mb: float
    pp_per_mb: float
    per_microbatch: float
    microbatches: int
    bubble: float  # fraction of the pipeline's time its ranks idle
    pipeline: float  # m * t_mb / (1 - bubble)
    dp: float
    dp_exposed: float
    total: float
    model_flops: float  # per step, the whole job
    hardware_flops: float  # with recomputation
    mfu: float
    hfu: float
    comm: tuple[GroupComm, ...] = field(default=())
    optimizer: float = 0.0  # the optimizer step (measured rate; 0 without a calibration)
    runtime_per_mb: float = 0.0  # the pipeline runtime's own work, in compute_per_mb
    tp_calls_per_mb: int = 0  # tensor-parallel collectives per micro-batch (slowest rank)
    strategy: float = 0.0  # DDP's, ZeRO's or FSDP's own work per step (calibrated)
    cp_per_mb: float = 0.0  # context parallelism's exposed seconds per micro-batch

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def spans_nodes(layout: Layout, group: str, cluster: Cluster) -> bool:
    """Whether ``group``'s members sit on more than one node (Mesh order tp, cp, ep, dp,
    pp)."""
    sizes = {
        "tp": layout.tp,
        "cp": layout.cp,
        "ep": layout.ep,
        "dp": layout.dp,
        "pp": layout.pp,
    }
    stride = 1
    order = ("tp", "cp", "ep", "dp", "pp")
    if group == "dpep":  # the dense gradients' group: cp, ep and dp together
        stride, size = layout.tp, layout.replicas
    else:
        for name in order[: order.index(group)]:
            stride *= sizes[name]
        size = sizes[group]
    return size > 1 and stride * size > cluster.devices_per_node


def bubble(schedule: str, *, p: int, m: int, v: int = 1, simulate: bool = False) -> float:
    """The bubble fraction of ``schedule`` (module doc); ``simulate=True`` plays the
    schedule in :mod:`plait.strategies.pipeline.simulate` with unit costs instead."""
    if p == 1 or schedule == "none":
        return 0.0
    # the zero-bubble formulas hold once the pipeline fills (m >= p); below, the
    # simulator's (unit costs) is larger, and cheap at that size
    small = p * m * v * 3 <= SIMULATE_ACTIONS
    if simulate or (schedule in ("zb-h1", "zbv") and m < p) or (schedule == "dualpipev" and small):
        return play(build(schedule, p=p, m=m, v=v)).bubble
    if schedule in ("zbv", "dualpipev"):  # DualPipeV too large to play: ZBV's fill
        return (p - 1) / (6 * m + p - 1)

    return formula_bubble(schedule, p, m, v)


def _tp_block_seconds(
    model: ModelSpec, job: Job, layout: Layout, cluster: Cluster, moe: bool
) -> tuple[float, float]:
    """(bytes, seconds) of one block's tensor-parallel traffic for one micro-batch."""
    t = layout.tp
    if t == 1:
        return 0.0, 0.0
    inter = spans_nodes(layout, "tp", cluster)
    lat, bw = cluster.link(inter)
    e = job.element_bytes
    tokens = layout.tokens(job)
    size = tokens * model.hidden * e
    if layout.tp_mode == "1d":
        n = 2 if moe else 4
        if layout.recompute == "full":
            n += 1 if moe else 2
        sent = n * 2 * (t - 1) / t * size
        if layout.sp:  # a reduce-scatter and an all-gather in place of each all-reduce
            one = sum(
                collective_seconds(cluster, c, t, size, inter_node=inter)
                for c in ("reduce_scatter", "all_gather")
            )
        else:
            one = collective_seconds(cluster, "all_reduce", t, size, inter_node=inter)
        return sent, n * one

    linears = gpt_linears(model.hidden, 1, model.vocab)[: (2 if moe else 4)]
    sent = 0.0
    steps = 0
    for i, o, _ in linears:
        c = linear_cost(
            layout.tp_mode,
            ranks=t,
            tokens=tokens,
            in_features=i,
            out_features=o,
            depth=layout.depth if layout.tp_mode == "2.5d" else None,
            bytes_per_element=e,
        )
        sent += c.bytes_per_rank
        steps += 6 * (c.q - 1)
    if layout.recompute == "full":
        sent, steps = sent * 4 / 3, steps * 4 // 3
    return sent, steps * lat + sent / bw


def _tp_head_grid(
    model: ModelSpec, job: Job, layout: Layout, cluster: Cluster
) -> tuple[float, float]:
    """(bytes, seconds) of the head as a grid linear ``h -> V`` for one micro-batch."""

    lat, bw = cluster.link(spans_nodes(layout, "tp", cluster))
    c = linear_cost(
        layout.tp_mode,
        ranks=layout.tp,
        tokens=layout.tokens(job),
        in_features=model.hidden,
        out_features=model.vocab,
        depth=layout.depth if layout.tp_mode == "2.5d" else None,
        bytes_per_element=job.element_bytes,
    )
    return c.bytes_per_rank, 6 * (c.q - 1) * lat + c.bytes_per_rank / bw


def step_time(
    model: ModelSpec,
    job: Job,
    layout: Layout,
    cluster: Cluster,
    *,
    overlap: Overlap | None = None,
    simulate_bubble: bool = False,
) -> StepTime:
    """Predicted seconds per optimizer step of ``layout`` (module doc)."""
    ov = overlap or Overlap()
    lay, s = layout, job.seq
    e = job.element_bytes
    tokens = lay.tokens(job)  # this rank's
    m = lay.microbatches(job)
    mult = 3.0 + (1.0 if lay.recompute == "full" else 0.0)
    core = model.attention_core_flops(s)  # forward, per token: QK^T and PV, 4 s a d
    # what the kernel skips of the causal square (Job.causal_share), in every pass over it
    skipped = core * (1 - job.causal_share)
    per_flop = 1.0 / (lay.tp * cluster.peak_flops * cluster.efficiency)
    # an MoE block's MLP runs whole on every 1D tp rank (plait's plans): on the replicated
    # input, or on the rank's s / t tokens under SP; the grid modes divide everything by t
    whole_div = lay.tp if (lay.sp or lay.tp_mode != "1d") else 1
    split_dense, _ = model.block_flops_split(s, moe=False)
    split_moe, whole_moe = model.block_flops_split(s, moe=True) if model.experts else (0.0, 0.0)
    act = tokens * model.hidden * e

    tp_bytes_dense, tp_dense = _tp_block_seconds(model, job, lay, cluster, False)
    tp_bytes_moe, tp_moe = _tp_block_seconds(model, job, lay, cluster, True)
    tp_inter = spans_nodes(lay, "tp", cluster)
    ep_size = model.top_k * act
    ep_n = 4 + (2 if lay.recompute == "full" else 0)
    ep_one = ep_n * collective_seconds(
        cluster, "all_to_all", lay.ep, ep_size, inter_node=spans_nodes(lay, "ep", cluster)
    )
    slow = gemm_slowdown(cluster, tokens, model.hidden, lay.tp)
    ep_one_bytes = ep_n * (lay.ep - 1) / lay.ep * ep_size if lay.ep > 1 else 0.0

    # memory-bound work per block and micro-batch (Cluster.elementwise_passes)
    elementwise = elementwise_moe = 0.0
    if cluster.elementwise_passes:
        scale = cluster.elementwise_passes * (4 / 3 if lay.recompute == "full" else 1)

        def passes(sparse: bool) -> float:
            saved = model_layer_bytes(model, job, lay, recompute="none", moe=sparse)
            return scale * saved / cluster.hbm_bandwidth

        elementwise = passes(False)
        elementwise_moe = passes(True) if model.moe_layers else 0.0
    # context parallelism per block: the ring's step hides behind 1/c of the rank's
    # attention core (forward, 4 s q_width FLOPs per token, over tp)
    q_w, kv_w = model.heads * model.hd / lay.tp, model.kv * model.hd / lay.tp
    step_s = 4 * s * model.heads * model.hd * tokens * per_flop / lay.cp
    cp_bytes_one, cp_one = context_layer(
        cluster,
        context=lay.context,
        c=lay.cp,
        tokens=tokens,
        q_width=q_w,
        kv_width=kv_w,
        element_bytes=e,
        step_seconds=step_s,
        passes=3 if lay.recompute == "full" else 2,
        inter_node=spans_nodes(lay, "cp", cluster),
    )
    worst = (0.0, 0.0, 0.0, 0.0, 0.0)  # (total, compute, tp, ep, tp bytes) per micro-batch
    tp_bytes_mb = ep_bytes_mb = cp_mb = cp_bytes_mb = 0.0
    calls_mb = 0
    cal = cluster.calibration
    call_s = cal.tp_call_seconds(lay.tp) if cal is not None else 0.0
    for dense, moe, first, last in rank_contents(model, lay):
        flops = (dense * split_dense + moe * split_moe - (dense + moe) * skipped) * mult
        whole = moe * whole_moe * mult  # run by every tp rank (over whole_div)
        if lay.recompute == "selective" and not job.flash_attention:
            flops += (dense + moe) * core
        if job.flash_attention:  # the backward recomputes the scores, QK^T
            flops += (dense + moe) * core / 2 * job.causal_share
        tp_s = dense * tp_dense + moe * tp_moe
        tp_b = dense * tp_bytes_dense + moe * tp_bytes_moe
        grid = lay.tp_mode != "1d"
        calls = 0 if grid or lay.tp == 1 else tp_calls(lay, dense, moe, first, last)
        tp_s += calls * call_s
        residual = cal.residual(lay.tp) if cal is not None and not grid else None
        if residual is not None:  # repeated work, waits for the last rank (measured)
            tp_s = max(0.0, tp_s + residual.seconds(calls, tokens * model.hidden * (dense + moe)))
        if lay.tp > 1 and first and not grid:  # vocabulary-parallel embedding's all-reduce
            tp_s += collective_seconds(cluster, "all_reduce", lay.tp, act, inter_node=tp_inter)
            tp_b += 2 * (lay.tp - 1) / lay.tp * act
        if last:
            flops += 3 * 2 * model.hidden * model.vocab
            if lay.tp > 1 and grid:  # the head is one more grid linear
                head_b, head_s = _tp_head_grid(model, job, lay, cluster)
                tp_s, tp_b = tp_s + head_s, tp_b + head_b
            elif lay.tp > 1:  # column-parallel head: dX all-reduce; the loss's three
                tp_s += collective_seconds(cluster, "all_reduce", lay.tp, act, inter_node=tp_inter)
                tp_s += 3 * collective_seconds(
                    cluster, "all_reduce", lay.tp, tokens * 4, inter_node=tp_inter
                )
                tp_b += 2 * (lay.tp - 1) / lay.tp * (act + 3 * tokens * 4)
        compute = (flops * slow + whole * lay.tp / whole_div) * tokens * per_flop
        compute += dense * elementwise + moe * elementwise_moe
        if cluster.calibration is not None:  # dispatch per block, the embedding and head one
            blocks = dense + moe + (1 if (first or last) else 0)
            compute += blocks * cluster.calibration.block_overhead
        ep_s = moe * ep_one
        total = compute + (1 - ov.tp) * (tp_s + ep_s) + (dense + moe) * cp_one
        if total > worst[0]:
            worst = (total, compute, tp_s, ep_s, tp_b)
            tp_bytes_mb, ep_bytes_mb, calls_mb = tp_b, moe * ep_one_bytes, calls
            cp_mb, cp_bytes_mb = (dense + moe) * cp_one, (dense + moe) * cp_bytes_one
    _, compute_mb, tp_mb, ep_mb, _ = worst
    runtime_mb = 0.0
    if cal is not None and lay.pp > 1:  # the runtime's own work per action it runs
        runtime_mb = pipeline_actions(lay, m) * cal.pipe_action
        compute_mb += runtime_mb

    pp_s = pp_bytes_mb = 0.0
    if lay.pp > 1:
        pp_inter = spans_nodes(lay, "pp", cluster)
        # scatter/gather (PTD-P 4.1), or already sharded under SP; else the whole of it
        gathered = lay.tp > 1 and not lay.sp and job.pp_scatter_gather
        msg = act / lay.tp if (gathered or lay.sp) else act
        pp_s = 2 * lay.v * collective_seconds(cluster, "p2p", 2, msg, inter_node=pp_inter)
        pp_bytes_mb = 2 * lay.v * msg
        if gathered:  # the receiver all-gathers the t pieces over tp
            pp_s += (
                2
                * lay.v
                * collective_seconds(cluster, "all_gather", lay.tp, act, inter_node=tp_inter)
            )
            pp_bytes_mb += 2 * lay.v * (lay.tp - 1) / lay.tp * act
    per_mb = compute_mb + (1 - ov.tp) * (tp_mb + ep_mb) + cp_mb + (1 - ov.pp) * pp_s
    beta = bubble(lay.schedule, p=lay.pp, m=m, v=lay.v, simulate=simulate_bubble)
    pipeline = m * per_mb / (1 - beta)
    speedup = cluster.alone_speedup
    if speedup > 1 and lay.pp > 1:
        # ranks sharing cores: the bubble's idle share goes to the busy ranks. The step is
        # the longer of all the work at the shared speed (no idle core) and the schedule's
        # critical path with each busy rank at up to a whole core: played by the pipeline
        # simulator (messages' latency on the path) when small, else the bubble formula.
        comm_mb = (1 - ov.tp) * (tp_mb + ep_mb) + cp_mb
        one_msg = (1 - ov.pp) * pp_s / (2 * lay.v)
        figures = cal.pipeline_figures(lay.schedule, lay.pp) if cal is not None else None
        played = None
        if figures is not None:  # measured: the wake-ups and ZB's split backward
            played = shared_cores_path(
                lay,
                m,
                compute_mb,
                comm_mb,
                one_msg,
                runtime=runtime_mb,
                cores=cluster.shared_cores,
                ranks=cluster.devices_per_node,
                wake=figures[0],
                split=figures[1],
            )
        if played is not None:
            pipeline = played
        else:
            path = critical_path(lay, m, compute_mb / speedup, comm_mb, one_msg)
            if path is None:
                path = m * (compute_mb / speedup + comm_mb + (1 - ov.pp) * pp_s) / (1 - beta)
            pipeline = max(m * per_mb, path)

    grad_bytes = e if job.precision == "mixed" else 4
    zero3 = 1.5 if lay.zero == 3 else 1.0
    dense, expert = max(rank_params(model, lay), key=lambda x: x[0] + x[1])
    dp_dense_n, dp_exp_n = lay.replicas, lay.dp * lay.cp
    # ZeRO-3 / FSDP gathers and reduces per unit: each block, and the root (the rest)
    units = sum(rank_contents(model, lay)[0][:2]) + 1 if lay.zero == 3 else 1
    dp_s = dp_seconds(
        cluster, lay.zero, dp_dense_n, dense * grad_bytes, units, spans_nodes(lay, "dpep", cluster)
    )
    dp_b = zero3 * 2 * (dp_dense_n - 1) / dp_dense_n * dense * grad_bytes
    if expert and dp_exp_n > 1:
        dp_s += dp_seconds(
            cluster, lay.zero, dp_exp_n, expert * grad_bytes, units, spans_nodes(lay, "dp", cluster)
        )
        dp_b += zero3 * 2 * (dp_exp_n - 1) / dp_exp_n * expert * grad_bytes
    dp_exposed = (1 - ov.dp) * dp_s
    optimizer = 0.0
    adam = cluster.calibration.adam if cluster.calibration is not None else None
    if adam is not None and job.optimizer in ("adam", "adamw"):
        # the elements this rank's optimizer updates: ZeRO shards them over the data ranks
        updated = dense / (dp_dense_n if lay.zero else 1) + expert / (dp_exp_n if lay.zero else 1)
        optimizer = adam.seconds(updated)
    own = 0.0
    if cal is not None and lay.replicas > 1:
        tensors = max(param_tensors(model, lay, *held) for held in rank_contents(model, lay))
        grads = (dense + expert) * grad_bytes
        if lay.zero in (1, 2) and cal.zero is not None:
            own = cal.zero.seconds(tensors, grads)
        elif lay.zero == 3 and cal.fsdp is not None:
            own = cal.fsdp.seconds(tensors, grads)
        elif lay.zero == 0 and lay.tp == 1 and lay.pp == 1 and cal.ddp is not None:
            own = cal.ddp.seconds(tensors, grads)  # plait's DDP (compose has its own)
    total = pipeline + dp_exposed + optimizer + own

    model_flops = model.flops_per_iteration(batch=job.global_batch, seq=s)
    hw_flops = model.flops_per_iteration(batch=job.global_batch, seq=s, recompute=lay.recompute)
    peak = lay.world * cluster.peak_flops * total
    comm = (
        GroupComm("tp", lay.tp, spans_nodes(lay, "tp", cluster), m * tp_bytes_mb, m * tp_mb),
        GroupComm("ep", lay.ep, spans_nodes(lay, "ep", cluster), m * ep_bytes_mb, m * ep_mb),
        GroupComm("cp", lay.cp, spans_nodes(lay, "cp", cluster), m * cp_bytes_mb, m * cp_mb),
        GroupComm("pp", lay.pp, spans_nodes(lay, "pp", cluster), m * pp_bytes_mb, m * pp_s),
        GroupComm("dp", lay.replicas, spans_nodes(lay, "dpep", cluster), dp_b, dp_s),
    )
    return StepTime(
        compute_mb,
        tp_mb,
        ep_mb,
        pp_s,
        per_mb,
        m,
        beta,
        pipeline,
        dp_s,
        dp_exposed,
        total,
        model_flops,
        hw_flops,
        model_flops / peak,
        hw_flops / peak,
        comm,
        optimizer,
        runtime_mb,
        calls_mb,
        own,
        cp_mb,
    )


__all__ = [
    "GroupComm",
    "Overlap",
    "StepTime",
    "bubble",
    "collective_seconds",
    "ring_seconds",
    "spans_nodes",
    "step_time",
]
