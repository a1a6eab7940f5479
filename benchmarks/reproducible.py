"""What ``reproducible=True`` costs: step time against the default, and partial-sum memory.

    .venv/bin/python benchmarks/reproducible.py            # worlds 2, 4; DDP and FSDP
    .venv/bin/python benchmarks/reproducible.py --quick    # MLP, world 2, few steps

Local ranks (``plait.RankPool``), one intra-op thread per rank. The two models of
``benchmarks/ddp.py`` at its sizes (2.9M-parameter MLP, batch 64 per rank; 2.0M-parameter
transformer, batch 16 per rank), Adam, fp32, under ``plait.prepare(strategy="ddp")`` and
``plait.prepare(strategy="fsdp", wrap=...)`` (one unit per ``nn.Linear`` /
``nn.TransformerEncoderLayer``). Variants, built on every rank from the same seed:

- ``default``: the strategy as it is: one forward and backward on the rank's batch;
- ``repro M/W=1``: reproducible mode with micro-batches of the whole local batch (M = W:
  the cost of the tree-ordered collectives alone);
- ``accumulate M/W=4``: the default strategy fed 4 micro-batches per rank by plain gradient
  accumulation (DDP under ``no_sync`` but the last; FSDP reduce-scatters every backward):
  the cost of micro-batching without the tree;
- ``repro M/W=4``: reproducible mode with those 4 micro-batches.

The variants take turns step by step in a rotating order; a step is zero_grad + forward(s)
+ backward(s) + ``optimizer.step()`` after a barrier; the step time is the slowest rank's;
the table shows medians and the ratio to ``default``. Memory: the most bytes of partial
sums the runner held at once (``runner.partial_sum_bytes``), beside the parameter bytes.
Writes ``benchmarks/results/reproducible.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from ddp import build_model, loss_of, make_batches  # noqa: E402
from torch import nn  # noqa: E402

import plait  # noqa: E402
from plait import comm  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"
VARIANTS = ("default", "repro M/W=1", "accumulate M/W=4", "repro M/W=4")


def _build(strategy: str, model_name: str, variant: str, local: int) -> dict[str, Any]:
    model = build_model(model_name)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    options: dict[str, Any] = {"mesh": plait.world()}
    if strategy == "fsdp":
        options["wrap"] = {nn.Linear} if model_name == "mlp" else {nn.TransformerEncoderLayer}
    if variant.startswith("repro"):
        per = 1 if variant.endswith("=1") else 4
        runner, opt = plait.prepare(
            model,
            opt,
            strategy=strategy,
            reproducible=True,
            microbatch_size=local // per,
            loss_fn=loss_of,
            **options,
        )
        return {"runner": runner, "opt": opt, "per": per}
    wrapped, opt = plait.prepare(model, opt, strategy=strategy, **options)
    return {"model": wrapped, "opt": opt, "per": 1 if variant == "default" else 4}


def _step(v: dict[str, Any], strategy: str, x: torch.Tensor, y: torch.Tensor) -> None:
    opt = v["opt"]
    if "runner" in v:
        v["runner"].step(x, y)
        opt.step()
        return
    model, per = v["model"], v["per"]
    opt.zero_grad(set_to_none=True)
    m = x.shape[0] // per
    for j in range(per):
        last = j == per - 1
        if strategy == "ddp":
            model.require_backward_grad_sync = last
        loss = loss_of(model(x[j * m : (j + 1) * m]), y[j * m : (j + 1) * m]) / per
        loss.backward()
    opt.step()


def bench_rank(strategy: str, model_name: str, warmup: int, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    g = plait.world()
    batches = make_batches(model_name, g.rank, 4)
    local = batches[0][0].shape[0]
    built = {name: _build(strategy, model_name, name, local) for name in VARIANTS}
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for i in range(warmup + steps):
        order = VARIANTS[i % len(VARIANTS) :] + VARIANTS[: i % len(VARIANTS)]
        for name in order:
            x, y = batches[i % len(batches)]
            comm.barrier(group=g)
            t0 = time.perf_counter()
            _step(built[name], strategy, x, y)
            took = torch.tensor([time.perf_counter() - t0])
            comm.all_reduce(took, "max", group=g)
            if i >= warmup:
                times[name].append(float(took))
    params = sum(p.numel() * p.element_size() for p in build_model(model_name).parameters())
    peaks = {
        name: built[name]["runner"].partial_sum_bytes
        for name in VARIANTS
        if "runner" in built[name]
    }
    return {"times": times, "param_bytes": params, "partial_sum_bytes": peaks}


def markdown(rows: list[dict[str, Any]], load: str) -> str:
    lines = [
        "# reproducible=True: step time and partial-sum memory",
        "",
        f"Command: `.venv/bin/python benchmarks/reproducible.py`; machine load before: `{load}`.",
        "Medians of the slowest rank's step time (ms); ratio to the default in brackets.",
        "",
        "| strategy | model | world | " + " | ".join(VARIANTS) + " | partial sums (M/W=4) |",
        "|---|---|---|" + "---|" * len(VARIANTS) + "---|",
    ]
    for r in rows:
        med = {n: statistics.median(r["times"][n]) * 1e3 for n in VARIANTS}
        cells = [f"{med[n]:.1f} ({med[n] / med['default']:.2f})" for n in VARIANTS]
        peak = r["partial_sum_bytes"].get("repro M/W=4", 0)
        mem = f"{peak / 2**20:.1f} MiB ({peak / r['param_bytes']:.1f}x params)"
        lines.append(
            f"| {r['strategy']} | {r['model']} | {r['world']} | "
            + " | ".join(cells)
            + f" | {mem} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--strategies", default="ddp,fsdp")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.worlds, args.models, args.steps = "2", "mlp", 3
    load = os.popen("uptime").read().strip()
    rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        pool = plait.RankPool(world, timeout=120)
        try:
            for strategy in args.strategies.split(","):
                for model_name in args.models.split(","):
                    res = pool.run(
                        bench_rank, strategy, model_name, args.warmup, args.steps, timeout=900
                    )[0]
                    rows.append({"strategy": strategy, "model": model_name, "world": world, **res})
                    print(markdown(rows[-1:], load).splitlines()[-1], flush=True)
        finally:
            pool.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reproducible.json").write_text(json.dumps({"load": load, "rows": rows}, indent=1))
    (args.out / "reproducible.md").write_text(
        markdown(rows, load) + f"\nLoad after: `{os.popen('uptime').read().strip()}`\n"
    )
    print(markdown(rows, load))


if __name__ == "__main__":
    main()
