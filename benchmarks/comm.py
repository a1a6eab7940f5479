"""plait's collective algorithms against the backend's native collectives, in one run.

    python benchmarks/comm.py                 # world sizes 2 and 4, 4 KiB .. 64 MiB
    python benchmarks/comm.py --quick         # 2 sizes, for a smoke test

For each world size, three passes on one pool of ranks:

1. every algorithm and ``auto`` with the built-in rule (no table), calls interleaved
   (A, B, C, A, B, C, ...) so noise hits all alike; medians of the slowest rank's time;
2. the tuning table built from pass 1, as ``plait bench comm --tune`` writes it;
3. ``auto`` with that table against ``native``, measured again, apart from pass 1.

Then the Python overhead of one tiny all-reduce (world 1, and world 2 against
``torch.distributed.all_reduce``). Writes ``benchmarks/results/comm.json`` and
``benchmarks/results/comm.md`` (the README's table).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plait import RankPool, bench  # noqa: E402
from plait.comm import tuner  # noqa: E402

COLLECTIVES = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all"]
OUT = Path(__file__).resolve().parent / "results"


def _measure(
    world: int, env: dict, algorithms: list[str], sizes: list[int], iters: int, budget: float
) -> list:
    with RankPool(world, env=env) as pool:
        return pool.run(
            bench.measure_rank,
            COLLECTIVES,
            algorithms,
            sizes,
            max_iters=iters,
            budget_s=budget,
            on_row=bench.print_row,
            timeout=3600,
        )[0]


def run_world(world: int, sizes: list[int], iters: int, budget: float) -> dict:
    table_file = Path(tempfile.mkdtemp()) / "tune.json"
    env = {"PLAIT_TUNE_FILE": str(table_file)}  # empty: auto uses the built-in rule
    everything = ["ring", "tree", "halving_doubling", "naive", "hierarchical", "native", "auto"]
    rows = _measure(world, env, everything, sizes, iters, budget)
    table = bench.tune_table(rows)
    tuner.save(table, table_file, backend="gloo")
    tuned = _measure(world, env, ["native", "auto"], sizes, iters, budget)
    return {
        "rows": bench.as_json(rows),
        "tuned": bench.as_json(tuned),
        "table": {c: {str(w): r for w, r in t.items()} for c, t in table.items()},
    }


def overhead() -> dict:
    with RankPool(1) as pool:
        one = pool.run(bench.overhead_rank, timeout=600)[0]
    with RankPool(2) as pool:
        two = pool.run(bench.overhead_rank, timeout=600)[0]
    return {"world1": one, "world2": two}


def _human(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def markdown(results: dict) -> str:
    lines = []
    for world, res in results["worlds"].items():
        rows = res["rows"]
        tuned = {(r["collective"], r["bytes"], r["algorithm"]): r for r in res["tuned"]}
        algos = ["ring", "tree", "halving_doubling", "naive", "hierarchical"]
        lines.append(
            f"\n**World size {world}** (gloo on loopback, float32; time in us, and "
            f"speed-up over native = native time / algorithm time)\n"
        )
        lines.append(
            "| collective | size | native us | "
            + " | ".join(algos)
            + " | auto (rule) | auto (tuned) |"
        )
        lines.append("|---" * (len(algos) + 5) + "|")
        by = {}
        for r in rows:
            by.setdefault((r["collective"], r["bytes"]), {})[r["algorithm"]] = r
        for (collective, nbytes), per in by.items():
            native = per["native"]["time_us"]
            cells = []
            for a in algos:
                cells.append(f"{native / per[a]['time_us']:.2f}x" if a in per else "-")
            auto = per["auto"]
            t_native = tuned[(collective, nbytes, "native")]["time_us"]
            t_auto = tuned[(collective, nbytes, "auto")]
            lines.append(
                f"| {collective} | {_human(nbytes)} | {native:.0f} | "
                + " | ".join(cells)
                + f" | {native / auto['time_us']:.2f}x ({auto['resolved']})"
                + f" | {t_native / t_auto['time_us']:.2f}x ({t_auto['resolved']}) |"
            )
    o = results["overhead"]
    lines.append("\n**Python overhead of one all-reduce of 4 floats** (us per call)\n")
    lines.append(
        "| world | plait auto | plait ring | plait native | torch.distributed.all_reduce |"
    )
    lines.append("|---|---|---|---|---|")
    for w in ("world1", "world2"):
        v = o[w]
        lines.append(
            f"| {w[-1]} | {v['plait_auto']:.1f} | {v['plait_ring']:.1f} | "
            f"{v['plait_native']:.1f} | {v['torch']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--min-size", default="4K")
    parser.add_argument("--max-size", default="64M")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--budget", type=float, default=1.5, help="seconds per size, at most")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.min_size, args.max_size, args.iters, args.budget = "4K", "64K", 5, 0.2
    sizes = bench.size_range(bench.parse_size(args.min_size), bench.parse_size(args.max_size))
    results: dict = {"cores": os.cpu_count(), "sizes": sizes, "worlds": {}}
    print(bench.format_rows([]))
    for world in [int(w) for w in args.worlds.split(",")]:
        results["worlds"][world] = run_world(world, sizes, args.iters, args.budget)
    results["overhead"] = overhead()
    OUT.mkdir(exist_ok=True)
    (OUT / "comm.json").write_text(json.dumps(results, indent=1))
    md = markdown(results)
    (OUT / "comm.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
