"""The planner's output: a table of ranked layouts, the terms of one (``--explain``), JSON."""

from __future__ import annotations

from typing import Any

from plait.plan.hardware import Cluster
from plait.plan.layout import Job
from plait.plan.model import ModelSpec
from plait.plan.search import Plan, SearchResult

GB = 1e9


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt_s(t: float) -> str:
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    return f"{t * 1e6:.1f} us"


def format_header(model: ModelSpec, job: Job, cluster: Cluster) -> str:
    return (
        f"model {model.name}: L={model.layers} h={model.hidden} a={model.heads} V={model.vocab}"
        f"{f' E={model.experts} top{model.top_k}' if model.experts else ''}, "
        f"{model.num_params / 1e9:.3g}B parameters; batch {job.global_batch} x {job.seq} "
        f"tokens, {job.precision}, {job.optimizer}\n"
        f"cluster {cluster.name}: {cluster.nodes} x {cluster.devices_per_node} devices, "
        f"{cluster.peak_flops / 1e12:.4g} TFLOP/s peak at {cluster.efficiency:.0%} efficiency, "
        f"{_fmt_bytes(cluster.usable_memory)} usable of {_fmt_bytes(cluster.memory_bytes)}"
    )


def format_table(result: SearchResult, *, top: int = 10) -> str:
    """The ``top`` fastest layouts that fit, one row each; then how many were refused."""
    lines = [format_header(result.model, result.job, result.cluster), ""]
    head = (
        f"{'#':>3}  {'layout':<54}{'mem/rank':>11}{'states':>10}{'activ.':>10}"
        f"{'step':>11}{'MFU':>7}{'bubble':>8}{'tp':>10}{'cp':>10}{'pp':>10}{'dp':>10}"
    )
    lines.append(head)
    for i, p in enumerate(result.plans[:top], 1):
        t = p.time
        comm = {c.group: c.seconds for c in t.comm}
        lines.append(
            f"{i:>3}  {p.layout.label():<54}{p.memory_bytes / GB:>8.2f} GB"
            f"{p.states.total_bytes / GB:>7.2f} GB{p.activations.total / GB:>7.2f} GB"
            f"{_fmt_s(t.total):>11}{t.mfu:>7.1%}{t.bubble:>8.1%}"
            f"{_fmt_s(comm['tp']):>10}{_fmt_s(comm['cp']):>10}{_fmt_s(comm['pp']):>10}"
            f"{_fmt_s(t.dp_exposed):>10}"
        )
    if not result.plans:
        lines.append("  (no layout fits in memory)")
        for p in result.too_big[:3]:
            lines.append(
                f"  closest: {p.layout.label()} needs {p.memory_bytes / GB:.2f} GB per rank, "
                f"{p.usable_bytes / GB:.2f} GB usable"
            )
    lines.append(
        f"\n{len(result.plans)} layouts fit, {len(result.too_big)}+ do not fit in memory, "
        f"{result.refused} refused" + (f" (e.g. {result.refusals[0]})" if result.refusals else "")
    )
    lines.append(
        "mem/rank = model states + activations + communication buffers of the rank whose "
        "sum is largest (states and activ. are that rank's); tp/cp/pp/dp: seconds of "
        "communication per step on the critical path"
    )
    return "\n".join(lines)


def explain(plan: Plan, model: ModelSpec, job: Job, cluster: Cluster) -> str:
    """Every term of one plan, with its formula (the docstrings of the modules say why)."""
    lay, t, st, ac = plan.layout, plan.time, plan.states, plan.activations
    m = t.microbatches
    lines = [
        f"layout {lay.label()}: {lay.world} ranks = dp {lay.dp} x tp {lay.tp} x cp {lay.cp}"
        f" x pp {lay.pp} x ep {lay.ep}; {m} micro-batches of {lay.microbatch} sequences per "
        "data shard",
        "",
        f"memory per rank (the largest rank, pipeline rank {plan.rank} of {lay.pp}: its own "
        "states, activations and buffers)",
        f"  parameters     {_fmt_bytes(st.params_bytes):>12}   {st.formula}",
        f"  gradients      {_fmt_bytes(st.grads_bytes):>12}",
        f"  optimizer      {_fmt_bytes(st.optimizer_bytes):>12}",
        f"  activations    {_fmt_bytes(ac.total):>12}   {ac.formula}",
        f"  buffers        {_fmt_bytes(plan.buffers):>12}   communication (plait.plan.buffers)",
        f"  total          {_fmt_bytes(plan.memory_bytes):>12}   of "
        f"{_fmt_bytes(plan.usable_bytes)} usable: {'fits' if plan.fits else 'DOES NOT FIT'}",
        "",
        "time per micro-batch (slowest pipeline rank)",
        f"  compute        {_fmt_s(t.compute_per_mb):>12}   FLOPs / (tp x "
        f"{cluster.peak_flops / 1e12:.4g} TFLOP/s x {cluster.efficiency:.2f})",
        f"  tp comm        {_fmt_s(t.tp_per_mb):>12}",
        f"  ep comm        {_fmt_s(t.ep_per_mb):>12}",
        f"  cp comm        {_fmt_s(t.cp_per_mb):>12}   exposed (ring: the transfer beyond "
        "each step's blockwise attention; Ulysses: its all-to-alls)",
        f"  pp p2p         {_fmt_s(t.pp_per_mb):>12}",
        f"  per micro-batch{_fmt_s(t.per_microbatch):>12}",
        "step",
        f"  pipeline       {_fmt_s(t.pipeline):>12}   m x t_mb / (1 - bubble) = {m} x "
        f"{_fmt_s(t.per_microbatch)} / (1 - {t.bubble:.4f})  [{lay.schedule}, v={lay.v}]",
        f"  dp reduction   {_fmt_s(t.dp):>12}   exposed {_fmt_s(t.dp_exposed)}",
        f"  optimizer      {_fmt_s(t.optimizer):>12}",
        *_own_work(t, cluster),
        f"  total          {_fmt_s(t.total):>12}",
        f"  MFU {t.mfu:.1%}  HFU {t.hfu:.1%}   model FLOPs/step {t.model_flops:.4g}, with "
        f"recomputation {t.hardware_flops:.4g}",
        "",
        "communication per step, per rank",
    ]
    for c in t.comm:
        if c.size > 1:
            where = "inter-node" if c.inter_node else "intra-node"
            lines.append(
                f"  {c.group:<3} group of {c.size:<5} {where:<11} "
                f"{_fmt_bytes(c.bytes_per_step):>12}  {_fmt_s(c.seconds):>10}"
            )
    return "\n".join(lines)


def _own_work(t: Any, cluster: Cluster) -> list[str]:
    """The strategies' own work in ``t`` (calibrated clusters only:
    plait.plan.measure.probe_runtime)."""
    cal = cluster.calibration
    if cal is None:
        return []
    tp = cal.tp_call_seconds(max(1, t.comm[0].size)) if t.comm else 0.0
    return [
        "  own work of the strategies (measured by plait bench calibrate)",
        f"    tp layers    {_fmt_s(t.tp_calls_per_mb * tp):>12}   per micro-batch, "
        f"{t.tp_calls_per_mb} collectives x {_fmt_s(tp)} (in tp comm)",
        f"    pipeline     {_fmt_s(t.runtime_per_mb):>12}   per micro-batch, actions x "
        f"{_fmt_s(cal.pipe_action)} (in compute)",
        f"    ddp/zero/fsdp{_fmt_s(t.strategy):>12}   per step, tensors x per-tensor + "
        "gradient bytes x per-byte",
    ]


def plan_dict(plan: Plan) -> dict[str, Any]:
    return {
        "layout": plan.layout.to_dict() | {"label": plan.layout.label()},
        "fits": plan.fits,
        "memory_bytes": plan.memory_bytes,
        "usable_bytes": plan.usable_bytes,
        "states": plan.states.to_dict(),
        "activations": plan.activations.to_dict(),
        "buffers": plan.buffers,
        "rank": plan.rank,
        "headroom": plan.headroom,
        "time": plan.time.to_dict(),
    }


def result_dict(result: SearchResult, *, top: int = 10) -> dict[str, Any]:
    """JSON-ready: the inputs, the ``top`` plans that fit, counts and refusal reasons."""
    return {
        "model": result.model.to_dict(),
        "job": result.job.to_dict(),
        "cluster": result.cluster.to_dict(),
        "plans": [plan_dict(p) for p in result.plans[:top]],
        "fit": len(result.plans),
        "too_big": [plan_dict(p) for p in result.too_big[:3]],
        "refused": result.refused,
        "refusals": list(result.refusals),
    }


__all__ = ["explain", "format_header", "format_table", "plan_dict", "result_dict"]
