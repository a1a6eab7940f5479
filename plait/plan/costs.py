"""What one collective, one data-parallel synchronisation and one pipeline's critical path
cost on a :class:`~plait.plan.hardware.Cluster`: the pieces :mod:`plait.plan.time` adds up.

- :func:`ring_seconds`: the alpha-beta time of a ring collective (the GPU presets);
- :func:`collective_seconds`: the cluster's measured line for that collective and group size
  when it has a calibration (:mod:`plait.plan.measure.calibrate`), else :func:`ring_seconds`;
- :func:`gemm_slowdown`: how much slower tensor-parallel shards' matmuls run (measured);
- :func:`dp_seconds`: the data-parallel group's collectives per ZeRO stage;
- :func:`context_layer`: context parallelism's bytes and exposed seconds per attention layer
  (the ring's transfers against its blockwise attention, Ulysses' four all-to-alls);
- :func:`critical_path`: a pipeline schedule played by the pipeline simulator with
  per-action costs (used on ranks that share cores);
- :func:`tp_calls`, :func:`pipeline_actions`, :func:`param_tensors`: what a rank has of the
  things whose own cost the calibration measures (:mod:`plait.plan.measure.probe_runtime`): its
  tensor-parallel collectives, its pipeline actions, its parameter tensors.
"""

from __future__ import annotations

from dataclasses import replace

from plait.plan.hardware import Cluster
from plait.plan.layout import Layout
from plait.plan.model import ModelSpec
from plait.strategies.pipeline.cores import run_on_cores
from plait.strategies.pipeline.schedules import build
from plait.strategies.pipeline.simulate import Costs, _needs, _split, simulate


def ring_seconds(collective: str, n: int, size: float, latency: float, bandwidth: float) -> float:
    """Alpha-beta time of a ring ``collective`` of ``size`` bytes over ``n`` ranks."""
    if n <= 1:
        return 0.0
    steps = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}
    if collective == "p2p":
        return latency + size / bandwidth
    if collective not in steps:
        raise ValueError(f"ring_seconds: unknown collective {collective!r}")
    k = steps[collective]
    return k * (n - 1) * latency + k * (n - 1) / n * size / bandwidth


def collective_seconds(
    cluster: Cluster, collective: str, n: int, size: float, *, inter_node: bool
) -> float:
    """Seconds of ``collective`` of ``size`` bytes over ``n`` ranks on ``cluster``: the
    measured line of the cluster's calibration for that collective and group size when it
    has one (a group inside a node), else :func:`ring_seconds` on the group's link."""
    if n <= 1:
        return 0.0
    if cluster.calibration is not None and not inter_node:
        line = cluster.calibration.line(collective, n)
        if line is not None:
            return line.seconds(size)
    lat, bw = cluster.link(inter_node)
    return ring_seconds(collective, n, size, lat, bw)


def gemm_slowdown(cluster: Cluster, tokens: int, hidden: int, t: int) -> float:
    """How much slower a rank's matmuls run when ``t`` tensor-parallel ranks split them:
    the calibration's measured rate of the MLP's ``tokens x h @ h x 4h`` over that of
    ``tokens x h @ h x 4h/t`` (1 without a calibration or with ``t = 1``)."""
    cal = cluster.calibration
    if cal is None or not cal.gemm or t == 1:
        return 1.0
    whole = 2.0 * tokens * hidden * 4 * hidden
    return max(1.0, cal.gemm_flops(whole) / cal.gemm_flops(whole / t))


SIMULATE_ACTIONS = 4096  # pipelines with at most this many compute actions are simulated


def critical_path(lay: Layout, m: int, compute: float, comm: float, message: float) -> float | None:
    """Seconds of ``lay``'s schedule played by :mod:`plait.strategies.pipeline.simulate`
    with a micro-batch's ``compute`` (forward a third, backward two thirds; ZB's input and
    weight gradients a third each) and tensor-parallel ``comm`` (half forward, half with
    the input gradient) per rank, cut into ``v`` chunks, and ``message`` seconds per
    pipeline message; None when the schedule is larger than :data:`SIMULATE_ACTIONS`."""
    if lay.pp * m * lay.v * 3 > SIMULATE_ACTIONS:
        return None

    v = lay.v
    f, b = (compute / 3 + comm / 2) / v, (2 * compute / 3 + comm / 2) / v
    i, w = (compute / 3 + comm / 2) / v, compute / 3 / v
    sched = build(lay.schedule, p=lay.pp, m=m, v=v)
    return simulate(sched, Costs(f=f, b=b, i=i, w=w, comm=message)).makespan


def shared_cores_path(
    lay: Layout,
    m: int,
    compute: float,
    comm: float,
    message: float,
    *,
    runtime: float,
    cores: float,
    ranks: int,
    split: float,
    wake: float,
) -> float | None:
    """Seconds of ``lay``'s schedule when ``ranks`` ranks share ``cores`` cores: played by
    :func:`plait.strategies.pipeline.cores.run_on_cores` (processor sharing) on the
    pipeline's share of the cores (``cores pp / ranks``: the other pipelines and
    tensor-parallel ranks run alike). A micro-batch's ``compute`` (with every rank busy,
    the runtime's ``runtime`` seconds included) and tensor-parallel ``comm`` per rank are
    cut as in :func:`critical_path`, a backward cut into I and W times ``split``,
    the runtime spread over the compute actions, and each compute action that reads a
    message ``wake`` seconds more (``split`` and ``wake`` measured by
    :mod:`plait.plan.measure.probe_pipeline`); work is that time times ``shared = cores / ranks``.
    None when the schedule is larger than :data:`SIMULATE_ACTIONS`."""
    if lay.pp * m * lay.v * 3 > SIMULATE_ACTIONS:
        return None

    shared = min(1.0, cores / ranks)
    v, zb = lay.v, lay.schedule in ("zb-h1", "zbv", "dualpipev")
    action = runtime / ((3 if zb else 2) * v)
    base = compute - runtime
    f = (base / 3 + comm / 2) / v + action
    back = 2 * base / 3 / v
    b = back + comm / 2 / v + action  # a whole B (DualPipeV mixes them with I and W)
    i, w = back * split / 2 + comm / 2 / v + action, back * split / 2 + action
    costs = Costs(f=f * shared, b=b * shared, i=i * shared, w=w * shared, comm=message)
    sched = build(lay.schedule, p=lay.pp, m=m, v=lay.v)
    if wake:
        halves = _split(sched)
        woken = {
            a: costs.of(a) + wake * shared
            for r, acts in enumerate(sched.ranks)
            for a in acts
            if a.kind.is_compute and _needs(sched, r, a, halves)[0] is not None
        }
        costs = replace(costs, per_action=woken)
    slots = run_on_cores(sched, costs, cores * lay.pp / ranks)
    return max(s.end for s in slots)


def dp_seconds(
    cluster: Cluster, zero: int, n: int, size: float, units: int, inter_node: bool
) -> float:
    """The data-parallel group's seconds per step for ``size`` bytes of gradients: an
    all-reduce (ZeRO 0), a reduce-scatter and an all-gather (ZeRO-1/2), or per unit of
    ``size / units`` two all-gathers (forward, backward) and a reduce-scatter (ZeRO-3)."""
    if n <= 1:
        return 0.0

    def cost(collective: str, nbytes: float) -> float:
        return collective_seconds(cluster, collective, n, nbytes, inter_node=inter_node)

    if zero == 0:
        return cost("all_reduce", size)
    if zero in (1, 2):
        return cost("reduce_scatter", size) + cost("all_gather", size)
    unit = size / units
    return units * (2 * cost("all_gather", unit) + cost("reduce_scatter", unit))


def context_layer(
    cluster: Cluster,
    *,
    context: str,
    c: int,
    tokens: float,
    q_width: float,
    kv_width: float,
    element_bytes: int,
    step_seconds: float,
    passes: int,
    inter_node: bool,
) -> tuple[float, float]:
    """(bytes one rank sends, seconds on the critical path) of one attention layer under
    context parallelism over ``c`` ranks, for one micro-batch of ``tokens`` tokens per rank,
    forward and backward; ``passes`` is 2 (forward, backward) or 3 (full recomputation runs
    the forward again). ``q_width``, ``kv_width``: this rank's query and key/value widths
    (heads x head_dim, over tp).

    Ring (:mod:`plait.strategies.context.ring_attention`): ``KV = 2 tokens kv e`` bytes, a
    rank's keys and values. Forward: ``c - 1`` steps, each sends KV to the next rank while
    the block of the step is computed: ``(c-1)/c * 2 s kv e`` per sequence and layer.
    Backward: ``c - 1`` steps, each sends K/V again and the running dK/dV (2 KV). The
    transfer of a step is assumed to overlap fully with that step's blockwise attention,
    ``step_seconds`` forward (twice that backward), on separate engines (copy and compute),
    so a step costs ``max(transfer, compute)`` and the exposed part is::

        (c - 1) [max(0, p2p(KV) - f) + max(0, p2p(2 KV) - 2 f)]      (+ forward again)

    Ulysses (:mod:`plait.strategies.context.ulysses`): forward all-to-alls of q, k, v to
    head-split and of the output back (``tokens (2 q + 2 kv) e`` bytes, ``(c-1)/c`` of it
    sent), backward the same four on the gradients; not overlapped (the attention needs
    them)."""
    if c <= 1:
        return 0.0, 0.0
    e = element_bytes
    if context == "ring":
        kv = 2 * tokens * kv_width * e
        fwd = collective_seconds(cluster, "p2p", 2, kv, inter_node=inter_node)
        bwd = collective_seconds(cluster, "p2p", 2, 2 * kv, inter_node=inter_node)
        exposed = max(0.0, fwd - step_seconds) + max(0.0, bwd - 2 * step_seconds)
        exposed += (passes - 2) * max(0.0, fwd - step_seconds)
        return (c - 1) * kv * (passes + 1), (c - 1) * exposed
    sizes = (q_width, kv_width, kv_width, q_width)
    one = sum(
        collective_seconds(cluster, "all_to_all", c, tokens * w * e, inter_node=inter_node)
        for w in sizes
    )
    sent = (c - 1) / c * tokens * sum(sizes) * e
    return passes * sent, passes * one


def tp_calls(lay: Layout, dense: int, moe: int, first: bool, last: bool) -> int:
    """Tensor-parallel (1D) collectives one rank calls per micro-batch, forward and
    backward, holding ``dense`` and ``moe`` blocks (and the embedding if ``first``, the
    head if ``last``): per dense block 4 all-reduces (2 in an MoE block; +2, +1 with full
    recomputation), each a reduce-scatter and an all-gather under SP (2 calls); the
    embedding 1, the head 1 and the vocab-parallel loss 3. 0 when ``lay.tp == 1``."""
    if lay.tp == 1:
        return 0
    full = lay.recompute == "full"
    per = dense * (4 + (2 if full else 0)) + moe * (2 + (1 if full else 0))
    if lay.sp:
        per *= 2
    return per + (1 if first else 0) + (4 if last else 0)


def pipeline_actions(lay: Layout, m: int) -> float:
    """Actions per micro-batch on the busiest rank of ``lay``'s schedule (compute, sends,
    receives): counted in the schedule built with ``m`` micro-batches when it has at most
    :data:`SIMULATE_ACTIONS` compute actions (and a name), else ``v (c + 4)``, ``c`` the
    compute actions of a micro-batch per chunk (2: F and B; 3 for the zero-bubble
    schedules: F, I, W)."""
    if lay.pp == 1:
        return 0.0
    if lay.schedule != "none" and lay.pp * m * lay.v * 3 <= SIMULATE_ACTIONS:
        sched = build(lay.schedule, p=lay.pp, m=m, v=lay.v)
        return max(len(actions) for actions in sched.ranks) / m
    compute = 3 if lay.schedule in ("zb-h1", "zbv", "dualpipev") else 2
    return lay.v * (compute + 4.0)


def param_tensors(
    model: ModelSpec, lay: Layout, dense: int, moe: int, first: bool, last: bool
) -> int:
    """Parameter tensors of a rank holding ``dense`` and ``moe`` blocks (and the embedding
    if ``first``, the head if ``last``), as :class:`plait.models.GPT` has them: 12 per
    dense block (2 LayerNorms, qkv, proj, fc1, fc2: weight and bias each); an MoE block 8,
    the gate, and 4 per local expert (``experts / ep``); token and position embeddings 2;
    the final LayerNorm 2 and the head 1 (0 when tied)."""
    experts = model.experts // lay.ep if model.experts else 0
    n = 12 * dense + moe * (9 + 4 * experts)
    if first:
        n += 2
    if last:
        n += 2 + (0 if model.tied else 1)
    return n


__all__ = [
    "SIMULATE_ACTIONS",
    "collective_seconds",
    "context_layer",
    "critical_path",
    "dp_seconds",
    "gemm_slowdown",
    "param_tensors",
    "pipeline_actions",
    "ring_seconds",
    "shared_cores_path",
    "tp_calls",
]
