"""The planner's step time against measured steps of the reference GPT on 4 local ranks.

    .venv/bin/python benchmarks/plan_local.py            # ~1-2 minutes on 2 cores
    .venv/bin/python benchmarks/plan_local.py --reuse    # the saved calibration

Calibration, before the rounds and again after them, figure by figure the faster of the
two (``plait.plan.measure.calibrate.fastest``; each is what ``plait bench calibrate -n 4`` runs):
every collective over groups of 2 and 4 ranks and the point-to-point latency and bandwidth
on the transport the ranks use (shared memory by default), and matmul rates with every rank
busy; saved to ``runs/plan_calibration_n4.json`` (``local_cpu(ranks=4)`` reads it) and to
``benchmarks/results/plan_calibration_n4.json``. The compute efficiency: the plain GPT's
forward and backward on one rank's share of the batch, run by the 4 ranks at once without
communication (model FLOPs / (time x the calibrated matmul rate)), taking its turn in
every round with the layouts below; the optimizer step is the calibration's Adam rate;
the strategies' own work (DDP's and ZeRO's per step, the tensor-parallel layers' per
collective, the pipeline runtime's per action) the calibration's probes
(``plait.plan.measure.probe_runtime``), charged by what each layout has of them.

Then every layout is predicted with ``local_cpu(ranks=4)`` and built by
``plait.plan.measure.execute.build`` (plait's strategies; PTD-P layouts through ``compose``) and
measured: median of the slowest rank's step (zero_grad, forward and backward of every
micro-batch, optimizer step) after a barrier, over several steps after warm-up; the
layouts (and the compute calibration) take turns for a few rounds and the table keeps each
one's fastest round: on a machine shared with other jobs their load only slows a round,
so the fastest is the least disturbed (on a quiet machine the rounds agree). The
"gloo links" column is the same planner and efficiency without the calibration: the
previous link constants (the ring fit of ``plait bench comm``'s gloo rows), ranks not
lending idle cores, no dispatch or optimizer terms; what the table showed before the
calibration read the transport in use.

Writes benchmarks/results/plan_local.md and .json. The machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

RESULTS = Path(__file__).parent / "results"
LAYERS, WIDTH, HEADS, SEQ, VOCAB, BATCH = 4, 128, 4, 64, 96, 16
STEPS, WARMUP, ROUNDS = 6, 2, 5
LAYOUTS: dict[str, dict[str, Any]] = {  # name -> plait.plan Layout fields
    "ddp": dict(dp=4, microbatch=4),
    "zero1": dict(dp=4, zero=1, microbatch=4),
    "zero2": dict(dp=4, zero=2, microbatch=4),
    "fsdp": dict(dp=4, zero=3, microbatch=4),
    "tp4": dict(tp=4, microbatch=16),
    "dp2xtp2": dict(dp=2, tp=2, microbatch=8),
    "pp4 1f1b": dict(pp=4, schedule="1f1b", microbatch=2),
    "pp4 zb-h1": dict(pp=4, schedule="zb-h1", microbatch=2),
    "dp2xpp2 gpipe": dict(pp=2, dp=2, schedule="gpipe", microbatch=2),
    "dp2xpp2 interleaved": dict(pp=2, dp=2, schedule="interleaved", v=2, microbatch=2),
    "pp2xtp2 1f1b": dict(pp=2, tp=2, schedule="1f1b", microbatch=4),
    "dp2xpp2 zbv": dict(pp=2, dp=2, schedule="zbv", v=2, microbatch=2),
    "dp2xpp2 dualpipev": dict(pp=2, dp=2, schedule="dualpipev", v=2, microbatch=2),
    # the same GPT with MoE blocks (every second block, 4 experts, top-2): expert parallel
    "ep4 moe": dict(ep=4, microbatch=4, model="moe"),
}
EXPERTS = 4  # the MoE model's experts


def model_of(fields: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The GPT config a layout row trains (dense, or ``model="moe"``) and its Layout fields."""
    rest = dict(fields)
    return config(moe=rest.pop("model", "dense") == "moe"), rest


def config(*, moe: bool = False) -> Any:
    from plait.models import GPTConfig
    from plait.models.gpt import MoEConfig

    return GPTConfig(
        vocab=VOCAB,
        layers=LAYERS,
        heads=HEADS,
        width=WIDTH,
        seq_len=SEQ,
        moe=MoEConfig(num_experts=EXPERTS) if moe else None,
    )


def batch(cfg: Any, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab, (size, cfg.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _slowest_median(times: list[float]) -> float:
    import plait

    t = torch.tensor(times, dtype=torch.float64)
    plait.comm.all_reduce(t, op="max")
    return statistics.median(t.tolist())


def busy_share_step(cfg: Any, share: int, steps: int = STEPS, warmup: int = WARMUP) -> float:
    """On every rank at once, no communication: the plain GPT's forward and backward on
    ``share`` sequences (one thread; the optimizer step is calibrated apart); the slowest
    rank's median seconds."""
    import plait
    from plait.models import GPT

    torch.set_num_threads(1)
    model = GPT(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = batch(cfg, share)
    times = []
    for i in range(warmup + steps):
        plait.comm.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x).reshape(-1, cfg.vocab), y.reshape(-1)).backward()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return _slowest_median(times)


def measure(
    cfg: Any, fields: dict[str, Any], global_batch: int, steps: int = STEPS, warmup: int = WARMUP
) -> float:
    """On every rank: build ``Layout(**fields)``, run steps; the slowest rank's median."""
    import plait
    from plait.models import GPT
    from plait.plan.layout import Job, Layout
    from plait.plan.measure import execute

    torch.set_num_threads(1)
    job = Job(global_batch=global_batch, seq=cfg.seq_len, precision="fp32", dropout=False)
    x, y = batch(cfg, global_batch)
    built = execute.build(GPT(cfg), Layout(**fields), job, x, y)
    times = []
    for i in range(warmup + steps):
        plait.comm.barrier()
        t0 = time.perf_counter()
        built.optimizer.zero_grad()
        built.step()
        built.optimizer.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return _slowest_median(times)


def calibrated(ranks: int, reuse: bool, pool: Any, *, keep: str | None = None) -> Any:
    """The calibration of ``ranks`` ranks: measured now on ``pool`` (or the saved file);
    saved to runs/ and, named ``keep``, to benchmarks/results/."""
    from plait.plan.measure import calibrate

    path = calibrate.default_path(ranks)
    if reuse and path.exists():
        return calibrate.load(path)
    cal = calibrate.Calibration.from_dict(pool.run(calibrate.measure_rank, timeout=600)[0])
    calibrate.save(cal)
    if keep is not None:
        calibrate.save(cal, RESULTS / keep)
    return cal


def own_text(cal: Any) -> str:
    """The calibration's own-work figures in a sentence."""
    parts = []
    for name, ov in (("DDP", cal.ddp), ("ZeRO-1/2", cal.zero), ("FSDP", cal.fsdp)):
        if ov is not None:
            parts.append(
                f"{name} {ov.per_tensor * 1e6:.0f} us per tensor + "
                f"{ov.per_byte * 1e9:.2f} ns per gradient byte"
            )
    for g, sec in sorted(cal.tp_call.items()):
        parts.append(f"{sec * 1e6:.0f} us per tensor-parallel collective over {g}")
    parts.append(f"{cal.pipe_action * 1e6:.0f} us per pipeline action")
    return ", ".join(parts)


def without_own_work(cluster: Any) -> Any:
    """``cluster`` whose calibration has none of the strategies' own work (DDP's, ZeRO's,
    the tensor-parallel layers' and the pipeline runtime's): the planner before it."""
    cal = dataclasses.replace(cluster.calibration, ddp=None, zero=None, tp_call={}, pipe_action=0.0)
    return dataclasses.replace(cluster, calibration=cal)


def own_work(t: Any, cal: Any, tp: int) -> float:
    """Seconds of the strategies' own work in the prediction ``t`` (before the bubble)."""
    per_mb = t.runtime_per_mb + t.tp_calls_per_mb * cal.tp_call_seconds(tp)
    return float(t.strategy + t.microbatches * per_mb)


def without_sharing(cluster: Any) -> Any:
    """``cluster`` whose calibration has none of the shared-core figures (the pipelines'
    wake-ups and ZB split, tensor parallelism's residual): the planner before them."""
    cal = dataclasses.replace(cluster.calibration, wake={}, zb_split={}, tp_residual={})
    return dataclasses.replace(cluster, calibration=cal)


def gloo_links(cluster: Any) -> Any:
    """``cluster`` with the previous constants: gloo ring fit, no calibration, no lending."""
    from plait.plan.hardware import bench_rows, default_bench_file, fit_alpha_beta

    path = default_bench_file()
    if path is None:
        return None
    fit = fit_alpha_beta(bench_rows(path), source=str(path))
    return dataclasses.replace(
        cluster,
        calibration=None,
        shared_cores=0.0,
        intra_latency=fit.latency,
        intra_bandwidth=fit.bandwidth,
        inter_latency=fit.latency,
        inter_bandwidth=fit.bandwidth,
    )


def main() -> int:
    from plait.launch.pool import RankPool
    from plait.plan.hardware import local_cpu, with_compute
    from plait.plan.layout import Job, Layout
    from plait.plan.measure import calibrate
    from plait.plan.model import from_gpt_config
    from plait.plan.search import evaluate

    ap = argparse.ArgumentParser()
    ap.add_argument("--reuse", action="store_true", help="reuse runs/plan_calibration_n4.json")
    args = ap.parse_args()
    cfg = config()
    spec = from_gpt_config(cfg)
    job = Job(global_batch=BATCH, seq=SEQ, precision="fp32", dropout=False, pp_scatter_gather=False)
    share = BATCH // 4
    rows = []
    with RankPool(4, timeout=120) as pool:
        first = calibrated(4, args.reuse, pool)
        # the compute calibration takes its turn in every round with the layouts
        runs: dict[str, list[float]] = {name: [] for name in LAYOUTS}
        shares: list[float] = []
        for _ in range(ROUNDS):
            shares.append(pool.run(busy_share_step, cfg, share, timeout=300)[0])
            for name, fields in LAYOUTS.items():
                row_cfg, lay_fields = model_of(fields)
                runs[name].append(pool.run(measure, row_cfg, lay_fields, BATCH, timeout=300)[0])
        # the calibration, like the layouts, keeps its least disturbed measurement: run
        # again after the rounds, figure by figure the faster of the two
        if args.reuse:
            cal = first
        else:
            again = calibrate.Calibration.from_dict(
                pool.run(calibrate.measure_rank, timeout=600)[0]
            )
            cal = calibrate.fastest([first, again])
            calibrate.save(cal)
            calibrate.save(cal, RESULTS / "plan_calibration_n4.json")
        print(calibrate.format_calibration(cal), flush=True)
        t_share = min(shares)
        base = local_cpu(ranks=4, calibration=cal, efficiency=1.0)
        flops = spec.flops_per_iteration(batch=share, seq=SEQ)
        cluster = with_compute(base, flops, t_share, LAYERS + 1)
        efficiency = cluster.efficiency
        old = gloo_links(cluster)
        bare = without_own_work(cluster)
        unshared = without_sharing(cluster)
        print(
            f"efficiency {efficiency:.3f}: the GPT step on {share} sequences on every rank "
            f"at once took {t_share * 1e3:.1f} ms at {base.peak_flops / 1e9:.1f} GFLOP/s",
            flush=True,
        )
        for name, fields in LAYOUTS.items():
            row_cfg, lay_fields = model_of(fields)
            row_spec = from_gpt_config(row_cfg)
            layout = Layout(**lay_fields)
            plan = evaluate(row_spec, job, layout, cluster)
            before = evaluate(row_spec, job, layout, old).time.total if old is not None else None
            no_own = evaluate(row_spec, job, layout, bare).time.total
            no_sharing = evaluate(row_spec, job, layout, unshared).time.total
            measured = min(runs[name])
            t = plan.time
            rows.append(
                {
                    "layout": name,
                    "planner_layout": layout.label(),
                    "measured_s": measured,
                    "rounds_s": runs[name],
                    "predicted_s": t.total,
                    "ratio": t.total / measured,
                    "gloo_links_s": before,
                    "gloo_links_ratio": before / measured if before else None,
                    "without_own_work_s": no_own,
                    "without_own_work_ratio": no_own / measured,
                    "without_sharing_s": no_sharing,
                    "without_sharing_ratio": no_sharing / measured,
                    "own_work_s": own_work(t, cal, layout.tp),
                    "compute_s": t.microbatches * t.compute_per_mb,
                    "tp_s": t.microbatches * t.tp_per_mb,
                    "pp_s": t.microbatches * t.pp_per_mb,
                    "dp_s": t.dp_exposed,
                    "optimizer_s": t.optimizer,
                    "bubble": t.bubble,
                }
            )
            r = rows[-1]
            print(
                f"{name:<20} measured {measured * 1e3:7.1f} ms  predicted "
                f"{t.total * 1e3:7.1f} ms  ratio {r['ratio']:.2f}  "
                f"(without own work {r['without_own_work_ratio']:.2f}, without the "
                f"shared-core figures {r['without_sharing_ratio']:.2f})",
                flush=True,
            )
    within = sum(1 for r in rows if abs(r["ratio"] - 1) <= 0.2)
    within_before = sum(1 for r in rows if abs(r["without_own_work_ratio"] - 1) <= 0.2)
    within_unshared = sum(1 for r in rows if abs(r["without_sharing_ratio"] - 1) <= 0.2)
    lines = [
        "# plait plan: predicted vs measured step time, reference GPT on 4 local ranks",
        "",
        f"`.venv/bin/python benchmarks/plan_local.py`: GPT L={LAYERS} h={WIDTH} a={HEADS} "
        f"s={SEQ} V={VOCAB}, global batch {BATCH}, fp32 Adam, 4 ranks on 2 shared cores "
        f"(noisy: other jobs ran), transport {cal.transport}. Calibration "
        f"(`plait.plan.measure.calibrate`, measured in this run before and after the rounds, "
        f"figure by figure the faster: `calibrate.fastest`): collectives per group size, p2p, "
        f"matmul {base.peak_flops / 1e9:.1f} GFLOP/s per rank with every rank busy, "
        f"{cal.block_overhead * 1e3:.2f} ms per block of dispatch; the strategies' own work "
        f"({own_text(cal)}); efficiency "
        f"{efficiency:.3f} (against {cluster.peak_flops / 1e9:.1f} GFLOP/s) from the plain "
        f"GPT's forward and backward on {share} sequences on every rank at once "
        f"({t_share * 1e3:.1f} ms). Medians of the slowest rank over {STEPS} "
        f"steps, the fastest of {ROUNDS} rounds. Within 20%: {within} of {len(rows)} "
        f"({within_before} of {len(rows)} without the own-work terms, {within_unshared} of "
        f"{len(rows)} without the shared-core figures).",
        "",
        "| layout | planner layout | measured | predicted | predicted / measured | "
        "without own work | without shared-core figures | compute | tp | pp | dp | "
        "optimizer | own work | bubble | gloo links |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ms = 1e3
    for r in rows:
        gl = f"{r['gloo_links_ratio']:.2f}" if r["gloo_links_ratio"] else "-"
        lines.append(
            f"| {r['layout']} | {r['planner_layout']} | {r['measured_s'] * ms:.1f} ms | "
            f"{r['predicted_s'] * ms:.1f} ms | {r['ratio']:.2f} | "
            f"{r['without_own_work_ratio']:.2f} | {r['without_sharing_ratio']:.2f} | "
            f"{r['compute_s'] * ms:.1f} | "
            f"{r['tp_s'] * ms:.1f} | {r['pp_s'] * ms:.1f} | {r['dp_s'] * ms:.1f} | "
            f"{r['optimizer_s'] * ms:.1f} | {r['own_work_s'] * ms:.1f} | "
            f"{r['bubble']:.1%} | {gl} |"
        )
    lines += [
        "",
        "compute, tp, pp, dp, optimizer: the planner's terms in ms (tp and pp summed over the "
        "micro-batches of the slowest pipeline rank; the bubble on top as shown). own work: "
        "the strategies' own work inside them (`plait.plan.measure.probe_runtime`: DDP's, ZeRO's "
        "or FSDP's "
        "per step, the tensor-parallel layers' per collective (in tp), the pipeline "
        "runtime's per action (in compute)). without own work: predicted / measured with "
        "those terms at 0 (the planner before them). without shared-core figures: "
        "predicted / measured without the pipelines' measured wake-ups and ZB split and "
        "tensor parallelism's measured residual (`plait.plan.measure.probe_pipeline`, "
        "`plait.plan.measure.probe_tensor`; the planner before them). gloo links: predicted / "
        "measured "
        "with the previous link constants (the ring fit of `plait bench comm`'s gloo rows, "
        "no calibration).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "plan_local.md").write_text(text)
    payload = {
        "efficiency": efficiency,
        "busy_share_step_s": t_share,
        "busy_share_rounds_s": shares,
        "calibration": cal.to_dict(),
        "rows": rows,
    }
    (RESULTS / "plan_local.json").write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
