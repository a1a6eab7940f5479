"""plait's collective algorithms against the backend's native collectives, in one run.

    python benchmarks/comm.py                 # world sizes 2 and 4, 4 KiB .. 64 MiB
    python benchmarks/comm.py --quick         # 2 sizes, for a smoke test
    python benchmarks/comm.py --check         # cost of the default-mode check, on vs off
    python benchmarks/comm.py --transport shm # plait on shared memory vs gloo's own

For each world size, three passes on one pool of ranks:

1. every algorithm and ``auto`` with the built-in rule (no table), calls interleaved
   (A, B, C, A, B, C, ...) so noise hits all alike; medians of the slowest rank's time;
2. the tuning table built from pass 1, as ``plait bench comm --tune`` writes it;
3. ``auto`` with that table against ``native``, measured again, apart from pass 1.

Then the Python overhead of one tiny all-reduce (world 1, and world 2 against
``torch.distributed.all_reduce``). Writes ``benchmarks/results/comm.json`` and
``benchmarks/results/comm.md`` (the README's table).

``--transport shm``: the ranks share memory (``PLAIT_TRANSPORT=shm``); all-reduce,
reduce-scatter and all-gather with plait's algorithms (``shm``, and the point-to-point
ones now on shared-memory messages) against gloo's own collective (``native``, which
does not use plait's transport), interleaved in one run. Writes
``benchmarks/results/comm_shm.json`` and ``comm_shm.md``: per size, gloo's time, plait's
best and the ratio, each algorithm's bus bandwidth, and the tuned ``auto`` table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
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
    # empty table: auto uses the built-in rule; gloo carries every message
    env = {"PLAIT_TUNE_FILE": str(table_file), "PLAIT_TRANSPORT": "gloo"}
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


CHECK_CASES = [  # (label, algorithm, float32 elements, calls per block)
    ("16 B all_reduce, auto", "auto", 4, 50),
    ("16 B all_reduce, native", "native", 4, 50),
    ("16 B all_reduce, ring", "ring", 4, 50),
    ("16 MiB all_reduce, auto", "auto", 4 << 20, 3),
    ("16 MiB all_reduce, ring", "ring", 4 << 20, 3),
]


def check_rank(rounds: int) -> dict:
    """Per case, us per call with the world group's check on and off, in alternating
    blocks (so noise hits both alike); medians of the slowest rank's blocks."""
    import torch
    import torch.distributed as dist

    from plait import comm

    g = comm.world()
    out = {}
    for label, algorithm, numel, block in CHECK_CASES:
        t = torch.ones(numel)
        samples: dict[bool, list[float]] = {True: [], False: []}
        for check in (True, False):  # warm up
            g.check = check
            for _ in range(3):
                comm.all_reduce(t, algorithm=algorithm)
        for _ in range(rounds):
            for check in (True, False):
                g.check = check
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(block):
                    comm.all_reduce(t, algorithm=algorithm)
                mine = torch.tensor([(time.perf_counter() - t0) / block * 1e6])
                dist.all_reduce(mine, op=dist.ReduceOp.MAX)
                samples[check].append(mine.item())
        g.check = True
        on, off = statistics.median(samples[True]), statistics.median(samples[False])
        out[label] = {"bytes": numel * 4, "check_on_us": on, "check_off_us": off}
    return out


def check_cost(worlds: list[int], rounds: int) -> dict:
    results = {}
    for world in worlds:
        with RankPool(world, timeout=600) as pool:
            results[world] = pool.run(check_rank, rounds, timeout=3600)[0]
    lines = ["| world | case | check on (us) | check off (us) | on/off |", "|---|---|---|---|---|"]
    for world, cases in results.items():
        for label, r in cases.items():
            on, off = r["check_on_us"], r["check_off_us"]
            extra = ""
            if r["bytes"] >= 1 << 20:
                extra = f" ({r['bytes'] / on / 1e3:.2f} vs {r['bytes'] / off / 1e3:.2f} GB/s)"
            lines.append(f"| {world} | {label} | {on:.0f} | {off:.0f} | {on / off:.2f}{extra} |")
    md = "\n".join(lines) + "\n"
    OUT.mkdir(exist_ok=True)
    (OUT / "comm_check.json").write_text(json.dumps(results, indent=1))
    (OUT / "comm_check.md").write_text(md)
    print(md)
    return results


SHM_COLLECTIVES = ["all_reduce", "reduce_scatter", "all_gather"]
SHM_ALGORITHMS = ["shm", "ring", "ring_tree", "tree", "naive", "native", "auto"]


def run_shm(world: int, sizes: list[int], iters: int, budget: float) -> dict:
    table_file = Path(tempfile.mkdtemp()) / "tune.json"
    env = {"PLAIT_TRANSPORT": "shm", "PLAIT_TUNE_FILE": str(table_file)}
    with RankPool(world, env=env) as pool:
        rows = pool.run(
            bench.measure_rank,
            SHM_COLLECTIVES,
            SHM_ALGORITHMS,
            sizes,
            max_iters=iters,
            budget_s=budget,
            on_row=bench.print_row,
            timeout=3600,
        )[0]
    return {"rows": bench.as_json(rows), "table": bench.tune_table(rows)}


def latency_rank(numel: int = 1024, rounds: int = 30, block: int = 25) -> dict[str, float]:
    """Microseconds per all-reduce of ``numel`` float32 in blocks of back-to-back calls
    (as a training step issues them): plait's shm and ring, gloo's own through plait
    and through torch.distributed; median block of the slowest rank."""
    import torch
    import torch.distributed as dist

    from plait import comm

    t = torch.ones(numel)
    fns = {
        "plait_shm": lambda: comm.all_reduce(t, algorithm="shm"),
        "plait_ring": lambda: comm.all_reduce(t, algorithm="ring"),
        "plait_auto": lambda: comm.all_reduce(t),
        "gloo_native": lambda: comm.all_reduce(t, algorithm="native"),
        "torch": lambda: dist.all_reduce(t),
    }
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(10):
            fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(block):
                fn()
            mine = torch.tensor([(time.perf_counter() - t0) / block * 1e6])
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            samples[name].append(mine.item())
    return {k: statistics.median(v) for k, v in samples.items()}


def shm_markdown(results: dict) -> str:
    lines = []
    for world, res in results["worlds"].items():
        by: dict = {}
        for r in res["rows"]:
            by.setdefault((r["collective"], r["bytes"]), {})[r["algorithm"]] = r
        algos = [a for a in SHM_ALGORITHMS if a not in ("native", "auto")]
        lines.append(
            f"\n**World size {world}**, shared-memory transport (float32; gloo = gloo's own "
            f"collective; busbw in GB/s; ratio = gloo time / plait's best time)\n"
        )
        lines.append(
            "| collective | size | gloo us | gloo busbw | best plait | plait us | plait busbw "
            "| ratio | " + " | ".join(f"{a} busbw" for a in algos) + " |"
        )
        lines.append("|---" * (8 + len(algos)) + "|")
        for (collective, nbytes), per in by.items():
            gloo = per["native"]
            mine = {a: per[a] for a in algos if a in per}
            best = min(mine.values(), key=lambda r: r["time_us"])
            cells = [f"{mine[a]['busbw_gbps']:.2f}" if a in mine else "-" for a in algos]
            lines.append(
                f"| {collective} | {_human(nbytes)} | {gloo['time_us']:.0f} | "
                f"{gloo['busbw_gbps']:.2f} | {best['algorithm']} | {best['time_us']:.0f} | "
                f"{best['busbw_gbps']:.2f} | {gloo['time_us'] / best['time_us']:.1f}x | "
                + " | ".join(cells)
                + " |"
            )
    lines.append("\n**4 KiB all-reduce, back to back** (us per call, median block of 25)\n")
    lines.append(
        "| world | plait shm | plait ring | plait auto | gloo via plait | torch.distributed |"
    )
    lines.append("|---|---|---|---|---|---|")
    for world, v in results.get("latency", {}).items():
        lines.append(
            f"| {world} | {v['plait_shm']:.1f} | {v['plait_ring']:.1f} | {v['plait_auto']:.1f} "
            f"| {v['gloo_native']:.1f} | {v['torch']:.1f} |"
        )
    return "\n".join(lines) + "\n"


ROOTED = ["broadcast", "reduce", "all_to_all"]


def main_rooted(args: argparse.Namespace) -> None:
    """The rooted collectives and all-to-all on shared memory (what ``tuner.shm_rule``
    reads): plait's point-to-point algorithms on shm messages vs gloo's own."""
    sizes = [4 << 10, 256 << 10, 16 << 20]
    tables = []
    for world in [int(w) for w in args.worlds.split(",")]:
        with RankPool(world, env={"PLAIT_TRANSPORT": "shm"}) as pool:
            rows = pool.run(
                bench.measure_rank,
                ROOTED,
                ["ring", "tree", "naive", "native", "auto"],
                sizes,
                max_iters=args.iters,
                budget_s=args.budget,
                timeout=3600,
            )[0]
        tables.append(bench.format_rows(rows))
    md = (
        "Rooted collectives and all-to-all on the shared-memory transport "
        "(`python benchmarks/comm.py --transport shm --rooted`; `native` is gloo's own; "
        "median of the slowest rank's calls)\n\n```\n" + "\n".join(tables) + "\n```\n"
    )
    OUT.mkdir(exist_ok=True)
    (OUT / "comm_shm_rooted.md").write_text(md)
    print(md)


def main_shm(args: argparse.Namespace, sizes: list[int]) -> None:
    if args.rooted:
        main_rooted(args)
        return
    if args.latency_only:  # measure the 4 KiB latency again, keep the size sweep
        results = json.loads((OUT / "comm_shm.json").read_text())
        results["latency"] = {}
        for world in [int(w) for w in args.worlds.split(",")]:
            with RankPool(world, env={"PLAIT_TRANSPORT": "shm"}) as pool:
                results["latency"][str(world)] = pool.run(latency_rank, timeout=600)[0]
        (OUT / "comm_shm.json").write_text(json.dumps(results, indent=1))
        md = shm_markdown(results)
        (OUT / "comm_shm.md").write_text(md)
        print(md)
        return
    results: dict = {"cores": os.cpu_count(), "sizes": sizes, "worlds": {}}
    print(bench.format_rows([]))
    results["latency"] = {}
    for world in [int(w) for w in args.worlds.split(",")]:
        results["worlds"][world] = run_shm(world, sizes, args.iters, args.budget)
        with RankPool(world, env={"PLAIT_TRANSPORT": "shm"}) as pool:
            results["latency"][world] = pool.run(latency_rank, timeout=600)[0]
    OUT.mkdir(exist_ok=True)
    (OUT / "comm_shm.json").write_text(json.dumps(results, indent=1))
    md = shm_markdown(results)
    (OUT / "comm_shm.md").write_text(md)
    print(md)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--min-size", default="4K")
    parser.add_argument("--max-size", default="64M")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--budget", type=float, default=1.5, help="seconds per size, at most")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--check", action="store_true", help="only the default-mode check's cost, on vs off"
    )
    parser.add_argument("--rounds", type=int, default=15, help="with --check")
    parser.add_argument("--transport", choices=["gloo", "shm"], default="gloo")
    parser.add_argument(
        "--rooted", action="store_true", help="with --transport shm: broadcast/reduce/all_to_all"
    )
    parser.add_argument(
        "--latency-only", action="store_true", help="with --transport shm: redo the 4 KiB row"
    )
    args = parser.parse_args()
    if args.check:
        check_cost([int(w) for w in args.worlds.split(",")], args.rounds)
        return
    if args.quick:
        args.min_size, args.max_size, args.iters, args.budget = "4K", "64K", 5, 0.2
    sizes = bench.size_range(bench.parse_size(args.min_size), bench.parse_size(args.max_size))
    if args.transport == "shm":
        main_shm(args, sizes)
        return
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
