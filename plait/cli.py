"""The ``plait`` command: ``plait run`` launches scripts, ``plait bench comm`` measures.

::

    plait run -n 4 train.py --lr 0.1          # 4 ranks on this machine
    plait run -n 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 train.py
                                              # several machines: torchrun's launcher
    plait bench comm -n 4                     # nccl-tests-style table + JSON
    plait bench comm -n 4 --tune              # and write the table "auto" reads
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


# --- plait run ----------------------------------------------------------------------------
def _run(args: argparse.Namespace) -> int:
    if args.nproc < 1:
        print(f"plait run: -n must be at least 1, got {args.nproc}", file=sys.stderr)
        return 2
    if not Path(args.script).exists():
        print(f"plait run: no such script: {args.script}", file=sys.stderr)
        return 2
    if args.nnodes > 1 or args.master_addr:
        return _run_multinode(args)
    return _run_local(args)


def _run_multinode(args: argparse.Namespace) -> int:
    """Several machines: hand over to torchrun's own launcher (same environment contract)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={args.nnodes}",
        f"--node-rank={args.node_rank}",
        f"--nproc-per-node={args.nproc}",
        f"--master-addr={args.master_addr or '127.0.0.1'}",
        f"--master-port={args.master_port}",
        args.script,
        *args.script_args,
    ]
    return subprocess.call(cmd)


def _run_local(args: argparse.Namespace) -> int:
    """N local ranks. The launcher hosts the rendezvous store, so ports never race; if a
    rank fails, the others are stopped and its exit code is returned."""
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1",
        0,
        None,
        True,
        timeout=datetime.timedelta(seconds=300),
        wait_for_workers=False,
    )
    procs = []
    for rank in range(args.nproc):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(args.nproc),
            LOCAL_WORLD_SIZE=str(args.nproc),
            GROUP_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(store.port),
            TORCHELASTIC_USE_AGENT_STORE="True",  # ranks join the launcher's store
        )
        if "OMP_NUM_THREADS" not in os.environ:  # N ranks share the cores (as torchrun does)
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.nproc))
        procs.append(subprocess.Popen([sys.executable, args.script, *args.script_args], env=env))
    deadline = time.monotonic() + args.timeout if args.timeout else None
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                print(
                    f"plait run: rank {rank} exited with code {code}; stopping the others",
                    file=sys.stderr,
                )
                _stop(procs)
                return code if code > 0 else 1
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                late = [r for r, c in enumerate(codes) if c is None]
                print(
                    f"plait run: ranks {late} still running after {args.timeout}s; stopping",
                    file=sys.stderr,
                )
                _stop(procs)
                return 124
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs)
        return 130


def _stop(procs: list[subprocess.Popen[Any]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    end = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


# --- plait bench comm ---------------------------------------------------------------------
def _bench_comm(args: argparse.Namespace) -> int:
    from plait import bench
    from plait.comm import ALGORITHMS, SUPPORTED, tuner
    from plait.launch import RankPool

    collectives = args.collectives.split(",")
    for c in collectives:
        if c not in SUPPORTED:
            print(
                f"plait bench comm: unknown collective {c!r}; use {list(SUPPORTED)}",
                file=sys.stderr,
            )
            return 2
    algorithms = args.algorithms.split(",") if args.algorithms else [*ALGORITHMS, "auto"]
    if args.tune:
        algorithms = [a for a in algorithms if a != "auto"]
    sizes = bench.size_range(bench.parse_size(args.min_size), bench.parse_size(args.max_size))
    print(
        f"plait bench comm: {args.nproc} ranks, gloo on loopback, float32, "
        f"{len(sizes)} sizes {sizes[0]}..{sizes[-1]} B, median of timed calls",
        flush=True,
    )
    env = {"PLAIT_TUNE_FILE": args.tune_file} if args.tune_file else None
    with RankPool(args.nproc, env=env) as pool:
        rows: list[bench.Row] = []
        print(bench.format_rows([]), flush=True)
        rows = pool.run(
            bench.measure_rank,
            collectives,
            algorithms,
            sizes,
            max_iters=args.iters,
            on_row=bench.print_row,
            timeout=3600,
        )[0]
    out = Path(args.json or f"runs/bench_comm_n{args.nproc}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(bench.as_json(rows), indent=1))
    print(f"\nwrote {out}")
    _summary(rows)
    if args.tune:
        path = Path(args.tune_file) if args.tune_file else tuner.table_path()
        table: dict[str, dict[int, list[tuple[int, str]]]] = {}
        if path.exists():
            tuner.load(path)
            table = dict(tuner._table or {})
        for collective, per_world in bench.tune_table(rows).items():
            table.setdefault(collective, {}).update(per_world)
        tuner.save(table, path, backend="gloo")
        print(f"wrote the tuning table for world size {args.nproc} to {path}")
    return 0


def _summary(rows: list[Any]) -> None:
    """Per collective and size: the fastest plait algorithm and its speed-up over native."""
    by_key: dict[tuple[str, int], dict[str, float]] = {}
    resolved: dict[tuple[str, int], str] = {}
    for r in rows:
        by_key.setdefault((r.collective, r.bytes), {})[r.algorithm] = r.time_us
        if r.algorithm == "auto":
            resolved[(r.collective, r.bytes)] = r.resolved
    print("\nfastest plait algorithm vs the backend's own (native time / plait time;")
    print("auto->native against native is the same call twice: its spread is the noise):")
    for (collective, nbytes), times in sorted(by_key.items()):
        native = times.get("native")
        mine = {a: t for a, t in times.items() if a not in ("native", "auto")}
        if native is None or not mine:
            continue
        best = min(mine, key=lambda a: mine[a])
        auto = ""
        if "auto" in times:
            picked = resolved[(collective, nbytes)]
            auto = f"   auto->{picked} {native / times['auto']:.2f}x"
        print(f"  {collective:<15}{nbytes:>11} B   {best:<17}{native / mine[best]:6.2f}x{auto}")


# --- plait plan memory --------------------------------------------------------------------
def _plan_memory(args: argparse.Namespace) -> int:
    """Model-state GB per rank for each strategy (ZeRO paper, section 3 and Figure 1)."""
    from plait.plan import memory

    try:
        estimates = memory.compare(
            num_params=args.params,
            world_size=args.nproc,
            optimizer=args.optimizer,
            precision=args.precision,
            shard_rounding=args.shard_rounding,
        )
    except ValueError as e:
        print(f"plait plan memory: {e}", file=sys.stderr)
        return 2
    print(
        f"plait plan memory: P = {estimates[0].num_params:,} parameters, n = {args.nproc} "
        f"ranks, {args.optimizer}, {args.precision} precision\n"
        "model state per rank (GB = 1e9 bytes, MB = 1e6); activations and buffers come on top"
    )
    print(memory.format_table(estimates))
    return 0


def _parameter_count(text: str) -> float:
    """'7.5e9', '7500000000', '7.5B', '350M', '1.2T' -> a number of parameters."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(text[-1:].upper(), 1.0)
    try:
        value = float(text[:-1] if scale != 1.0 else text) * scale
        whole = round(value)  # 1.1B is 1100000000.0000002 in floating point
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(
            f"not a parameter count: {text!r} (write 7.5e9, 7500000000 or 7.5B)"
        ) from None
    return whole if abs(value - whole) < 1e-6 * max(1.0, value) else value


# --- plait demo ---------------------------------------------------------------------------
def _slow_worker(text: str | None) -> tuple[int, float] | None:
    if text is None:
        return None
    try:
        rank, factor = text.split(":")
        return int(rank), float(factor)
    except ValueError:
        raise SystemExit(
            f"plait demo: --slow-worker {text!r}: expected RANK:FACTOR, e.g. 3:3 (rank 3 takes "
            f"3x as long per step)"
        ) from None


def _demo(args: argparse.Namespace) -> int:
    from plait.demo import DemoConfig, run

    if args.strategy == "none" and args.nproc != 1:
        print("plait demo: --strategy none trains in one process; use -n 1", file=sys.stderr)
        return 2
    config = DemoConfig(
        world_size=args.nproc,
        strategy=args.strategy,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        algorithm=args.algorithm,
        bucket_mb=args.bucket_mb,
        seed=args.seed,
        name=args.name or "",
        ps_mode=args.ps_mode,
        servers=args.servers,
        staleness=args.staleness,
        backup_workers=args.backup_workers,
        slow_worker=_slow_worker(args.slow_worker),
        evals_per_epoch=args.evals_per_epoch,
    )
    run(config, check=args.check, out_dir=Path(args.out))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="plait", description="distributed training on PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="launch a script on N ranks")
    run.add_argument("-n", "--nproc", type=int, required=True, help="ranks on this machine")
    run.add_argument("--nnodes", type=int, default=1, help="machines (hands over to torchrun)")
    run.add_argument("--node-rank", type=int, default=0)
    run.add_argument("--master-addr", default=None)
    run.add_argument("--master-port", type=int, default=29500)
    run.add_argument("--timeout", type=float, default=None, help="stop after this many seconds")
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    run.set_defaults(func=_run)

    demo = sub.add_parser("demo", help="train a CNN on digits with N local ranks")
    demo.add_argument("-n", "--nproc", type=int, default=4)
    demo.add_argument(
        "--strategy",
        default="ddp",
        choices=["ddp", "naive", "zero1", "zero2", "zero3", "fsdp", "ps", "none"],
    )
    demo.add_argument("--epochs", type=int, default=10)
    demo.add_argument("--batch-size", type=int, default=64, help="global batch")
    demo.add_argument("--lr", type=float, default=0.05)
    demo.add_argument("--algorithm", default="auto")
    demo.add_argument("--bucket-mb", type=float, default=25.0)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--name", default=None, help="run folder name under --out")
    demo.add_argument("--out", default="runs")
    ps = demo.add_argument_group("parameter server (--strategy ps)")
    ps.add_argument("--ps-mode", choices=["sync", "async", "ssp"], default="sync")
    ps.add_argument("--servers", type=int, default=1, help="server ranks (0..S-1)")
    ps.add_argument("--staleness", type=int, default=None, help="ssp bound s")
    ps.add_argument("--backup-workers", type=int, default=0, help="sync: proceed after n-b")
    ps.add_argument("--slow-worker", default=None, metavar="RANK:FACTOR", help="a straggler")
    demo.add_argument(
        "--evals-per-epoch", type=int, default=1, help="test-accuracy points per epoch"
    )
    demo.add_argument(
        "--check",
        action="store_true",
        help="also train in one process on the global batch and compare",
    )
    demo.set_defaults(func=_demo)

    bench_p = sub.add_parser("bench", help="measure")
    bench_sub = bench_p.add_subparsers(dest="what", required=True)
    comm_p = bench_sub.add_parser("comm", help="collectives, nccl-tests style")
    comm_p.add_argument("-n", "--nproc", type=int, default=4)
    comm_p.add_argument("--collectives", default="all_reduce,reduce_scatter,all_gather,broadcast")
    comm_p.add_argument("--algorithms", default=None, help="comma-separated (default: all)")
    comm_p.add_argument("--min-size", default="4K")
    comm_p.add_argument("--max-size", default="16M")
    comm_p.add_argument("--iters", type=int, default=20, help="at most this many timed calls")
    comm_p.add_argument("--json", default=None, help="default runs/bench_comm_n<N>.json")
    comm_p.add_argument("--tune", action="store_true", help="write the table auto reads")
    comm_p.add_argument("--tune-file", default=None)
    comm_p.set_defaults(func=_bench_comm)

    plan_p = sub.add_parser("plan", help="plan before running")
    plan_sub = plan_p.add_subparsers(dest="what", required=True)
    mem_p = plan_sub.add_parser("memory", help="model-state memory per rank, per strategy")
    mem_p.add_argument("--params", type=_parameter_count, required=True, help="e.g. 7.5e9")
    mem_p.add_argument("-n", "--nproc", type=int, required=True, help="data-parallel ranks")
    mem_p.add_argument("--optimizer", default="adam", help="adam, adamw, sgd, sgd_momentum")
    mem_p.add_argument("--precision", default="mixed", help="mixed or fp32")
    mem_p.add_argument(
        "--shard-rounding", action="store_true", help="ceil(P/n) per rank instead of P/n"
    )
    mem_p.set_defaults(func=_plan_memory)

    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
