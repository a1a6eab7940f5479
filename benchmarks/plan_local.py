"""The planner's step time against measured steps of the reference GPT on 4 local ranks.

    .venv/bin/python benchmarks/plan_local.py            # ~1-2 minutes on 2 cores

Calibration, once: the link's alpha and beta come from the ring all-reduce rows of
``plait bench comm`` (``runs/bench_comm_n4.json`` if present, else the committed
``benchmarks/results/comm.json``); the compute efficiency from one process with one
thread running the same GPT step on one rank's share of the batch (model FLOPs / (time x
the single-thread matmul speed)). Then every layout is predicted with
``plait.plan.hardware.local_cpu(ranks=4)`` (half a core per rank on this 2-core machine)
and measured: median of the slowest rank's step (zero_grad, forward, backward, optimizer
step) after a barrier, over several steps after warm-up.

Writes benchmarks/results/plan_local.md and .json. The machine is shared and noisy.
"""

from __future__ import annotations

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
STEPS, WARMUP = 6, 2
LAYOUTS = {  # name -> plait.plan Layout fields
    "ddp": dict(dp=4),
    "zero1": dict(dp=4, zero=1),
    "zero2": dict(dp=4, zero=2),
    "fsdp": dict(dp=4, zero=3),
    "tp": dict(tp=4, microbatch=16),
    "dp2tp2": dict(dp=2, tp=2, microbatch=8),
    "pp 1f1b": dict(pp=4, schedule="1f1b", microbatch=2),
    "pp2 gpipe": dict(pp=2, dp=2, schedule="gpipe", microbatch=2),
}


def config() -> Any:
    from plait.models import GPTConfig

    return GPTConfig(vocab=VOCAB, layers=LAYERS, heads=HEADS, width=WIDTH, seq_len=SEQ)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def one_process_step_seconds(share: int) -> float:
    """Median seconds of a plain GPT step on ``share`` sequences, one thread."""
    from plait.models import GPT

    torch.set_num_threads(1)
    model = GPT(config())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = batch()
    x, y = x[:share], y[:share]
    times = []
    for i in range(WARMUP + STEPS):
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        opt.step()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(kind: str) -> float:
    """On every rank: build ``kind``, run steps; the median of the slowest rank's steps."""
    import plait
    from plait.models import GPT
    from plait.models.gpt import tp_plan
    from plait.strategies.pipeline.parallel import prepare_pipeline
    from plait.strategies.tensor import loss_fn, parallelize

    world = plait.world()
    cfg = config()
    x, y = batch()
    model = GPT(cfg)
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)

    def ce(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1))

    if kind in ("ddp", "zero1", "zero2", "fsdp"):
        extra = {"wrap": {type(model.blocks[0])}} if kind == "fsdp" else {}
        net, opt = plait.prepare(model, adam, strategy=kind, **extra)
        share = BATCH // world.size
        xs, ys = x[world.rank * share :][:share], y[world.rank * share :][:share]

        def step() -> None:
            ce(net(xs), ys).backward()

    elif kind == "tp":
        net, opt = plait.prepare(model, adam, strategy="tp", mesh=plait.Mesh(tp=world.size))
        loss = loss_fn(net)

        def step() -> None:
            loss(net(x), y).backward()

    elif kind == "dp2tp2":
        mesh = plait.Mesh(dp=2, tp=2)
        tp_model = parallelize(model, mesh, tp_plan(layers=cfg.layers))
        net = plait.DistributedDataParallel(tp_model, group=mesh.group("dp"))
        opt = torch.optim.Adam(tp_model.parameters(), lr=1e-3)
        loss = loss_fn(tp_model)
        d, half = mesh.rank("dp"), BATCH // 2
        xs, ys = x[d * half : (d + 1) * half], y[d * half : (d + 1) * half]

        def step() -> None:
            loss(net(xs), ys).backward()

    elif kind.startswith("pp"):
        p = 4 if kind == "pp 1f1b" else 2
        mesh = plait.Mesh(pp=p) if p == world.size else plait.Mesh(pp=p, dp=world.size // p)
        schedule = kind.split()[1]
        if p == world.size:
            pipe, opt = prepare_pipeline(model, adam, mesh=mesh, schedule=schedule, microbatches=8)
            xs, ys = x, y
        else:
            pipe, opt = prepare_pipeline(model, adam, mesh=mesh, schedule=schedule, microbatches=4)
            d, half = mesh.rank("dp"), BATCH // 2
            xs, ys = x[d * half : (d + 1) * half], y[d * half : (d + 1) * half]

        def step() -> None:
            pipe.step(xs, ys)

    else:
        raise ValueError(kind)
    assert opt is not None
    times = []
    for i in range(WARMUP + STEPS):
        plait.comm.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        step()
        opt.step()
        elapsed = torch.tensor([time.perf_counter() - t0])
        plait.comm.all_reduce(elapsed, op="max")
        if i >= WARMUP:
            times.append(float(elapsed))
    return statistics.median(times)


def main() -> int:
    from plait.launch import RankPool
    from plait.plan.hardware import local_cpu
    from plait.plan.layout import Job, Layout
    from plait.plan.model import from_gpt_config
    from plait.plan.search import evaluate
    from plait.plan.time import Overlap

    spec = from_gpt_config(config())
    job = Job(global_batch=BATCH, seq=SEQ, precision="fp32", dropout=False)
    share = BATCH // 4
    t1 = one_process_step_seconds(share)
    cluster = local_cpu(ranks=4, efficiency=1.0)
    core = cluster.peak_flops * 2  # local_cpu gives half a core per rank on 2 cores
    efficiency = spec.flops_per_iteration(batch=share, seq=SEQ) / (t1 * core)
    cluster = local_cpu(ranks=4, efficiency=min(1.0, efficiency), flops_per_core=core)
    print(
        f"calibration: one thread, {share} sequences: {t1 * 1e3:.1f} ms -> efficiency "
        f"{efficiency:.3f} of {core / 1e9:.1f} GFLOP/s per core; link alpha "
        f"{cluster.intra_latency * 1e6:.0f} us, beta {cluster.intra_bandwidth / 1e9:.2f} GB/s",
        flush=True,
    )
    rows = []
    with RankPool(4, timeout=120) as pool:
        for kind, fields in LAYOUTS.items():
            plan = evaluate(spec, job, Layout(**fields), cluster, overlap=Overlap())
            measured = pool.run(measure, kind, timeout=300)[0]
            rows.append(
                {
                    "layout": kind,
                    "planner_layout": plan.layout.label(),
                    "measured_s": measured,
                    "predicted_s": plan.time.total,
                    "ratio": plan.time.total / measured,
                    "compute_s": plan.time.pipeline
                    - plan.time.microbatches
                    * (plan.time.tp_per_mb + plan.time.pp_per_mb)
                    / (1 - plan.time.bubble),
                    "comm_s": plan.time.total
                    - plan.time.microbatches * plan.time.compute_per_mb / (1 - plan.time.bubble),
                    "bubble": plan.time.bubble,
                }
            )
            r = rows[-1]
            print(
                f"{kind:<10} measured {r['measured_s'] * 1e3:8.1f} ms  predicted "
                f"{r['predicted_s'] * 1e3:8.1f} ms  ratio {r['ratio']:.2f}",
                flush=True,
            )
    lines = [
        "# plait plan: predicted vs measured step time, reference GPT on 4 local ranks",
        "",
        f"`.venv/bin/python benchmarks/plan_local.py`: GPT L={LAYERS} h={WIDTH} a={HEADS} "
        f"s={SEQ} V={VOCAB}, global batch {BATCH}, fp32 Adam, gloo on loopback, 4 ranks on "
        "2 shared cores (noisy). Calibration: efficiency "
        f"{efficiency:.3f} from a one-thread step on {share} sequences ({t1 * 1e3:.1f} ms); "
        f"link alpha {cluster.intra_latency * 1e6:.0f} us, beta "
        f"{cluster.intra_bandwidth / 1e9:.2f} GB/s from `plait bench comm` all-reduce rows. "
        "Medians of the slowest rank over "
        f"{STEPS} steps.",
        "",
        "| layout | planner layout | measured | predicted | predicted / measured | bubble |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['planner_layout']} | {r['measured_s'] * 1e3:.1f} ms | "
            f"{r['predicted_s'] * 1e3:.1f} ms | {r['ratio']:.2f} | {r['bubble']:.1%} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "plan_local.md").write_text(text)
    payload = {"efficiency": efficiency, "one_thread_s": t1, "rows": rows}
    (RESULTS / "plan_local.json").write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
