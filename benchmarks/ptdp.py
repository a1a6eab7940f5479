"""PTD-P's 2x2 (tp x pp) step against its parts: tp 2 alone, pp 2 alone, and the planner.

    .venv/bin/python benchmarks/ptdp.py            # ~1-2 minutes on 2 cores

Measured, each the median over several steps of the slowest rank's step (zero_grad,
``step``, optimizer step) after a barrier: one process with plain PyTorch (the dense GPT,
one thread: the work every layout divides), plait's tensor parallelism alone on 2 ranks
(``prepare(strategy="tp")``) and the same through ``compose`` (Mesh(pp=1, dp=1, tp=2)),
the pipeline alone on 2 ranks (``PipelineParallel``) and through ``compose`` (Mesh(pp=2,
dp=1, tp=1)), and ``compose`` on Mesh(pp=2, dp=1, tp=2) over 4 ranks.

Predicted: ``plait.plan.evaluate`` of each layout on ``local_cpu(ranks=n)`` (the cores
shared by n ranks) after one calibration (as benchmarks/plan_local.py: the compute
efficiency from the one-thread step, the link from ``plait bench comm``'s rows); its
attribution of the step to compute, tensor-parallel communication, pipeline transfers and
the bubble is printed beside each.

"Composition adds no cost beyond its parts" is read two ways: the 2x2 step against the
planner's sum of its parts (predicted total) plus 10%, and the 2x2's measured/predicted
ratio against the parts' (if composing added work the planner does not know of, the 2x2's
ratio would exceed theirs). Writes benchmarks/results/ptdp.md and .json. The machine is
shared by other jobs and noisy: one short run.
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
M = 4  # micro-batches of the pipelined layouts
STEPS, WARMUP = 6, 2
RUNS = {  # name -> (ranks, planner Layout fields or None)
    "torch 1 process": (1, dict()),
    "plait tp2": (2, dict(tp=2, microbatch=BATCH)),
    "ptdp tp2": (2, dict(tp=2, microbatch=BATCH)),
    "plait pp2": (2, dict(pp=2, schedule="1f1b", microbatch=BATCH // M)),
    "ptdp pp2": (2, dict(pp=2, schedule="1f1b", microbatch=BATCH // M)),
    "ptdp tp2xpp2": (4, dict(tp=2, pp=2, schedule="1f1b", microbatch=BATCH // M)),
}


def config() -> Any:
    from plait.models import GPTConfig

    return GPTConfig(vocab=VOCAB, layers=LAYERS, heads=HEADS, width=WIDTH, seq_len=SEQ)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def one_process() -> float:
    """Median seconds of the dense GPT's step on the whole batch, one thread."""
    from plait.models import GPT

    torch.set_num_threads(1)
    model = GPT(config())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = batch()
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
    from plait.strategies.compose import compose
    from plait.strategies.pipeline import PipelineParallel
    from plait.strategies.tensor import loss_fn

    world = plait.world()
    model = GPT(config())
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = batch()
    if kind == "plait tp2":
        net, opt = plait.prepare(model, adam, strategy="tp", mesh=plait.Mesh(tp=world.size))
        assert opt is not None
        loss = loss_fn(net)

        def step() -> None:
            loss(net(x), y).backward()

    elif kind == "plait pp2":
        pipe = PipelineParallel(model, group=plait.Mesh(pp=2).group("pp"), microbatches=M)
        opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)

        def step() -> None:
            pipe.step(x, y)

    else:
        shape = {"ptdp tp2": (1, 2), "ptdp pp2": (2, 1), "ptdp tp2xpp2": (2, 2)}[kind]
        mesh = plait.Mesh(pp=shape[0], dp=1, tp=shape[1])
        ptdp = compose(model, adam, mesh=mesh, microbatches=M if shape[0] > 1 else 1)
        opt = ptdp.optimizer

        def step() -> None:
            ptdp.step(x, y)

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
    t1 = one_process()
    core = local_cpu(ranks=1, efficiency=1.0).peak_flops
    efficiency = min(1.0, spec.flops_per_iteration(batch=BATCH, seq=SEQ) / (t1 * core))
    print(
        f"calibration: one thread, {BATCH} sequences: {t1 * 1e3:.1f} ms -> efficiency "
        f"{efficiency:.3f} of {core / 1e9:.1f} GFLOP/s",
        flush=True,
    )
    rows = []
    pools: dict[int, RankPool] = {}
    try:
        for kind, (n, fields) in RUNS.items():
            cluster = local_cpu(ranks=n, efficiency=efficiency, flops_per_core=core)
            plan = evaluate(spec, job, Layout(**fields), cluster, overlap=Overlap())
            if n == 1:
                measured = t1
            else:
                if n not in pools:
                    pools[n] = RankPool(n, timeout=120)
                measured = pools[n].run(measure, kind, timeout=300)[0]
            t = plan.time
            m = t.microbatches
            rows.append(
                {
                    "run": kind,
                    "ranks": n,
                    "layout": plan.layout.label(),
                    "measured_s": measured,
                    "predicted_s": t.total,
                    "ratio": measured / t.total,
                    "compute_s": m * t.compute_per_mb,
                    "tp_comm_s": m * t.tp_per_mb,
                    "pp_comm_s": m * t.pp_per_mb,
                    "bubble": t.bubble,
                    "bubble_s": t.pipeline - m * t.per_microbatch,
                }
            )
            r = rows[-1]
            print(
                f"{kind:<16} measured {measured * 1e3:8.1f} ms  predicted "
                f"{t.total * 1e3:8.1f} ms  measured/predicted {r['ratio']:.2f}",
                flush=True,
            )
    finally:
        for pool in pools.values():
            pool.close()
    by = {r["run"]: r for r in rows}
    both = by["ptdp tp2xpp2"]
    parts = statistics.geometric_mean([by["ptdp tp2"]["ratio"], by["ptdp pp2"]["ratio"]])
    verdict = {
        "tp2xpp2_over_predicted": both["ratio"],
        "parts_measured_over_predicted": parts,
        "composition_overhead": both["ratio"] / parts,
        "within_sum_plus_10pct": both["measured_s"] <= 1.1 * both["predicted_s"],
    }
    ms = 1e3
    lines = [
        "# PTD-P: a 2x2 (tp x pp) step against its parts and the planner",
        "",
        f"`.venv/bin/python benchmarks/ptdp.py`: GPT L={LAYERS} h={WIDTH} a={HEADS} s={SEQ} "
        f"V={VOCAB}, global batch {BATCH}, {M} micro-batches (1F1B) where pipelined, fp32 "
        f"Adam, gloo on loopback, 2 shared cores (noisy, other jobs running). Medians of the "
        f"slowest rank over {STEPS} steps. Planner: `plait.plan.evaluate` on "
        f"`local_cpu(ranks=n)`, efficiency {efficiency:.3f} calibrated from the one-process "
        f"step ({t1 * ms:.1f} ms).",
        "",
        "| run | ranks | measured | predicted | measured / predicted | compute | tp comm | "
        "pp comm | bubble |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['run']} | {r['ranks']} | {r['measured_s'] * ms:.1f} ms | "
            f"{r['predicted_s'] * ms:.1f} ms | {r['ratio']:.2f} | {r['compute_s'] * ms:.1f} ms "
            f"| {r['tp_comm_s'] * ms:.1f} ms | {r['pp_comm_s'] * ms:.1f} ms | "
            f"{r['bubble_s'] * ms:.1f} ms ({r['bubble']:.0%}) |"
        )
    lines += [
        "",
        f"- 2x2 measured / planner's sum of its parts: {verdict['tp2xpp2_over_predicted']:.2f} "
        f"(target <= 1.10: {'met' if verdict['within_sum_plus_10pct'] else 'NOT met'})",
        f"- the parts' measured / predicted (geometric mean of ptdp tp2 and ptdp pp2): "
        f"{parts:.2f}; the 2x2's over the parts': {verdict['composition_overhead']:.2f}",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ptdp.md").write_text(text)
    payload = {"efficiency": efficiency, "one_process_s": t1, "rows": rows, "verdict": verdict}
    (RESULTS / "ptdp.json").write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
