"""The planner against published runs: Korthikanti et al.'s iteration times, PTD-P's layout
rules on the 1T / 3072-GPU case, and the ZeRO paper's Figure 1.

    .venv/bin/python benchmarks/plan_validate.py        # ~10 s, pure arithmetic

Writes benchmarks/results/plan_validate.md and .json. Hardware constants are the A100
preset of plait.plan.hardware (published datasheet numbers, efficiency 0.60 fit once on the
175B run); nothing here is measured on this machine.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from plait.plan import memory
from plait.plan.hardware import a100
from plait.plan.layout import Job, Layout
from plait.plan.model import published
from plait.plan.search import SearchSpace, evaluate, search
from plait.plan.time import spans_nodes

RESULTS = Path(__file__).parent / "results"

# Korthikanti et al. 2022 (arXiv 2205.05198), Table 4 / calculon's validation files:
# model, GPUs, t, p, global batch, micro-batch, v, seconds (full recompute, SP + selective)
KORTHIKANTI = [
    ("22B", 8, 8, 1, 4, 4, 1, 1.42, 1.10),
    ("175B", 64, 8, 8, 64, 1, 3, 18.13, 13.75),
    ("530B", 280, 8, 35, 280, 1, 3, 49.05, 37.83),
    ("1T", 512, 8, 64, 512, 1, 1, 94.42, 71.49),
]
# Megatron-LM README (2022): MFU of the SP + selective runs
PUBLISHED_MFU = {"22B": 0.415, "175B": 0.514, "530B": 0.560, "1T": 0.563}


def korthikanti() -> list[dict[str, Any]]:
    rows = []
    for name, n, t, p, batch, b, v, full, selective in KORTHIKANTI:
        sched = "none" if p == 1 else ("interleaved" if v > 1 else "1f1b")
        for rc, sp, ref in (("full", False, full), ("selective", True, selective)):
            lay = Layout(
                dp=n // (t * p),
                tp=t,
                pp=p,
                v=v,
                schedule=sched,
                microbatch=b,
                recompute=rc,
                sp=sp,
            )
            plan = evaluate(published(name), Job(global_batch=batch, seq=2048), lay, a100(n // 8))
            st = plan.time
            rows.append(
                {
                    "model": name,
                    "gpus": n,
                    "layout": lay.label(),
                    "recompute": "full" if rc == "full" else "SP + selective",
                    "published_s": ref,
                    "predicted_s": st.total,
                    "error": st.total / ref - 1,
                    "mfu": st.mfu,
                    "published_mfu": PUBLISHED_MFU[name] if rc == "selective" else None,
                    "compute_s": st.compute_per_mb * st.microbatches,
                    "tp_s": st.tp_per_mb * st.microbatches,
                    "pp_s": st.pp_per_mb * st.microbatches,
                    "bubble": st.bubble,
                    "memory_gb": plan.memory_bytes / 1e9,
                }
            )
    return rows


def ptdp() -> dict[str, Any]:
    """1T (L=128, h=25600, a=160) on 3072 A100s, batch 3072 (PTD-P Table 1's row)."""
    model, job, cluster = published("1T"), Job(global_batch=3072, seq=2048), a100(384)
    t0 = time.perf_counter()
    result = search(model, job, cluster, space=SearchSpace())
    seconds = time.perf_counter() - t0
    top = []
    for p in result.plans[:5]:
        lay = p.layout
        top.append(
            {
                "layout": lay.label(),
                "step_s": p.time.total,
                "mfu": p.time.mfu,
                "hfu": p.time.hfu,
                "memory_gb": p.memory_bytes / 1e9,
                "tp_in_node": not spans_nodes(lay, "tp", cluster),
                "pp_across_nodes": spans_nodes(lay, "pp", cluster),
            }
        )
    theirs = Layout(dp=6, tp=8, pp=64, schedule="1f1b", microbatch=1, recompute="full")
    plan = evaluate(model, job, theirs, cluster)
    return {
        "search_seconds": seconds,
        "fit": len(result.plans),
        "refused": result.refused,
        "top": top,
        "ptdp_layout": {
            "layout": theirs.label(),
            "step_s": plan.time.total,
            "hfu": plan.time.hfu,
            "published_hfu": 163 / 312,
            "memory_gb": plan.memory_bytes / 1e9,
            "rank": 1 + sum(p.time.total < plan.time.total for p in result.plans),
        },
    }


def zero_figure_1() -> list[dict[str, Any]]:
    paper = {"ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}
    return [
        {"strategy": e.strategy, "paper_gb": paper[e.strategy], "planner_gb": e.total_gb}
        for e in memory.compare(num_params=7.5e9, world_size=64)
    ]


def markdown(k: list[dict[str, Any]], p: dict[str, Any], z: list[dict[str, Any]]) -> str:
    out = [
        "# plait plan against published runs",
        "",
        "`.venv/bin/python benchmarks/plan_validate.py` (pure arithmetic; A100 preset: 312 "
        "TFLOP/s, NVLink 300 GB/s, IB 25 GB/s per GPU, efficiency 0.60 fit once on the 175B run).",
        "",
        "## Korthikanti et al. 2022: iteration times (s), A100, s = 2048, V = 51200",
        "",
        "| model | GPUs | layout | recomputation | published | predicted | error | MFU pred."
        " | MFU publ. | compute | tp | pp p2p | bubble | mem/GPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in k:
        pub = f"{r['published_mfu']:.1%}" if r["published_mfu"] else ""
        out.append(
            f"| {r['model']} | {r['gpus']} | {r['layout']} | {r['recompute']} | "
            f"{r['published_s']:.2f} | {r['predicted_s']:.2f} | {r['error']:+.1%} | "
            f"{r['mfu']:.1%} | {pub} | {r['compute_s']:.2f} | {r['tp_s']:.2f} | "
            f"{r['pp_s']:.2f} | {r['bubble']:.1%} | {r['memory_gb']:.1f} GB |"
        )
    worst = max(k, key=lambda r: abs(r["error"]))
    out += [
        "",
        f"Largest miss: {worst['model']} {worst['recompute']}, {worst['error']:+.1%}. One "
        "efficiency for every GEMM size: the 22B model's GEMMs (h/t = 768) run below it, the "
        "530B and 1T models' (h/t = 2560, 3200) above it, so the small model is predicted "
        "too fast and the large ones too slow. Not modelled: kernel fusion differences, the "
        "optimizer step, the data-parallel all-reduce (d = 1 in these runs).",
        "",
        "## PTD-P: the 1T model on 3072 A100s (384 nodes x 8), batch 3072",
        "",
        f"Search: {p['fit']} layouts fit, {p['refused']} refused, {p['search_seconds']:.1f} s.",
        "",
        "| # | layout | step | MFU | HFU | mem/GPU | tp inside a node | pp across nodes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(p["top"], 1):
        out.append(
            f"| {i} | {r['layout']} | {r['step_s']:.1f} s | {r['mfu']:.1%} | {r['hfu']:.1%} | "
            f"{r['memory_gb']:.1f} GB | {'yes' if r['tp_in_node'] else 'no'} | "
            f"{'yes' if r['pp_across_nodes'] else 'no'} |"
        )
    t = p["ptdp_layout"]
    out += [
        "",
        f"PTD-P's t, p, d with 1F1B and full recomputation ({t['layout']}; the schedule of "
        "their row is not re-verified here): predicted {t['step_s']:.1f} s, HFU "
        f"{t['hfu']:.1%} against the published 163 TFLOP/s = {t['published_hfu']:.1%} "
        f"(PTD-P counts FLOPs with recomputation); it ranks {t['rank']} of {p['fit']}. "
        "The planner prefers sequence parallelism with selective recomputation (which PTD-P "
        "did not have yet) and a shorter pipeline with more data parallelism.",
        "",
        "## ZeRO paper, Figure 1: 7.5B parameters, Adam, 64 GPUs (GB per GPU)",
        "",
        "| strategy | paper | planner |",
        "|---|---|---|",
    ]
    for r in z:
        out.append(f"| {r['strategy']} | {r['paper_gb']:.1f} | {r['planner_gb']:.1f} |")
    return "\n".join(out) + "\n"


def main() -> int:
    k, p, z = korthikanti(), ptdp(), zero_figure_1()
    text = markdown(k, p, z)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "plan_validate.md").write_text(text)
    payload = {"korthikanti": k, "ptdp": p, "zero_figure_1": z}
    (RESULTS / "plan_validate.json").write_text(json.dumps(payload, indent=1) + "\n")
    ok = all(abs(r["error"]) <= 0.25 for r in k) and all(
        r["tp_in_node"] and r["pp_across_nodes"] for r in p["top"][:1]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
