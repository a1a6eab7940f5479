"""The ``plait`` command: ``plait run`` launches scripts, ``plait bench comm`` measures.

::

    plait run -n 4 train.py --lr 0.1          # 4 ranks on this machine
    plait run -n 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 train.py
                                              # several machines: torchrun's launcher
    plait run -n 8 --nnodes 1:4 --master-addr 10.0.0.1 train.py
                                              # elastic: torchrun's c10d rendezvous
    srun --ntasks-per-node=1 plait run -n 8 train.py
                                              # SLURM: one launcher per node
    plait bench comm -n 4                     # nccl-tests-style table + JSON
    plait bench comm -n 4 --tune              # and write the table "auto" reads
    plait bench calibrate -n 4                # this machine's constants for plait plan
    plait --version                           # plait 0.1.0
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from plait.cli_args import NONNEGATIVE, POSITIVE, real, whole

# --- plait run ----------------------------------------------------------------------------
RUN_HELP = """Launch a script on N ranks. Locally, plait run hosts a fresh store per attempt and
starts the ranks itself; with --nnodes > 1 (or MIN:MAX: torchrun's elastic c10d rendezvous)
or --master-addr it hands over to torchrun. Inside an srun step of one task per node, and in
a pod of Kubeflow's torch runtime, --nnodes, --node-rank, --master-addr and --master-port
(and -n from PET_NPROC_PER_NODE) default to what SLURM_* / PET_* say.

Ranks die with the launcher (even after kill -9). SIGTERM/SIGINT stop the job: SIGCONT,
SIGTERM, then SIGKILL after --grace seconds; exit code 128 + the signal. A failed rank's
traceback is printed once, as the root cause; the others' errors as consequences. A rank
whose heartbeat (store key plait/heartbeat/<rank>) is older than --heartbeat-timeout is
named and stopped. A rank that set plait/launch/may_exit/<rank> to "1" may exit early.

--max-restarts k: after a failure, stop every rank and start them all again (a fresh store
each time), at most k times; the script reads PLAIT_RESTART_COUNT (and
TORCHELASTIC_RESTART_COUNT) and resumes from its own last checkpoint. Under torchrun
(--nnodes > 1), restarts with gloo need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 with torchrun's
c10d rendezvous (torch 2.13: a restarted attempt against the shared store fails in
connectFullMesh); plait run sets it when it hands over with --max-restarts. torchrun's
static rendezvous keeps one store for all attempts regardless: plait.init rendezvouses
each attempt under its own key prefix (plait/attempt-<n>), so plait scripts restart
cleanly under either.

--min-nproc m (one machine, with --max-restarts): elastic world size. A failure costs the
root-cause rank's slot: the job restarts with one rank fewer (WORLD_SIZE says how many,
ranks renumbered 0..n-1), never below m (else it stops and says so); the script resumes
from its checkpoint at the new world size (plait.checkpoint.load reshards). Example:
plait run -n 4 --min-nproc 2 --max-restarts 2 train.py
"""


def _heartbeat_timeout(text: str) -> float:
    """``--heartbeat-timeout``: the same range as ``PLAIT_HEARTBEAT_TIMEOUT`` (>= 1 s; 0
    would declare every healthy rank frozen at its first look)."""
    from plait.comm.watchdog import parse_heartbeat_timeout

    try:
        return parse_heartbeat_timeout(text, "--heartbeat-timeout")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _nnodes(text: str) -> str:
    """``--nnodes``: ``N`` (>= 1) or ``MIN:MAX`` (1 <= MIN <= MAX), as torchrun takes it."""
    low, _, high = text.partition(":")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return f"{lo}:{hi}" if high else str(lo)


def _launcher_defaults(args: argparse.Namespace) -> list[str]:
    """Fill what the command line left out from the cluster's launcher: inside an ``srun``
    step of one task per node (SLURM_*), or a pod of Kubeflow's torch runtime (PET_*), as
    torchrun does for PET_*. Explicit options win. Returns what was taken, to say so."""
    from plait.launch import environment

    taken: list[str] = []
    for source, found in (
        ("srun", environment.slurm_defaults()),
        ("Kubeflow", environment.kubeflow_defaults()),
    ):
        if not found:
            continue
        most = found.get("nnodes", "1").rpartition(":")[2]
        several = most.isdigit() and int(most) > 1  # else plait run's own launcher
        keys = ("nnodes", "nproc", "node_rank", "master_addr", "master_port")
        for key in keys if several else ("nproc",):
            if key in found and getattr(args, key) is None:
                setattr(args, key, found[key] if key == "master_addr" else _cast(key, found[key]))
                taken.append(f"--{key.replace('_', '-')} {found[key]}")
        if taken:
            taken.insert(0, f"from {source}:")
        break
    return taken


def _cast(key: str, value: str) -> Any:
    return value if key == "nnodes" else int(value)


def _run(args: argparse.Namespace) -> int:
    from plait import settings
    from plait.launch.job import check_nproc

    try:
        taken = _launcher_defaults(args)
    except RuntimeError as exc:  # a recognized launcher whose variables do not suffice
        print(f"plait run: {exc}", file=sys.stderr)
        return 2
    if taken:
        print(f"plait run: {' '.join(taken)}", file=sys.stderr)
    if args.nproc is None:
        print("plait run: -n/--nproc (ranks on this machine) is required", file=sys.stderr)
        return 2
    args.nnodes = args.nnodes or "1"
    args.node_rank = args.node_rank or 0
    multinode = args.nnodes != "1" or bool(args.master_addr)
    try:
        # every PLAIT_* setting, before any rank starts: a bad value stops the job here,
        # once, instead of failing every rank (or torchrun's ranks on this machine)
        for warning in settings.check():
            print(f"plait run: {warning}", file=sys.stderr)
        check_nproc(args.nproc, nodes=2 if multinode else 1)
    except ValueError as exc:
        text = str(exc).replace("\n", "\nplait run: ")
        print(f"plait run: {text}", file=sys.stderr)
        return 2
    if not Path(args.script).exists():
        print(f"plait run: no such script: {args.script}", file=sys.stderr)
        return 2
    if args.heal is not None:
        return _run_healing(args, multinode)
    if args.replica_size != 1:
        print(
            "plait run: --replica-size is for a healing job: add --heal K (docs/healing.md)",
            file=sys.stderr,
        )
        return 2
    if multinode:
        if args.min_nproc is not None:
            print(
                "plait run: --min-nproc is for one machine (plait run's own launcher); across "
                "machines use --nnodes MIN:MAX (torchrun's elastic rendezvous)",
                file=sys.stderr,
            )
            return 2
        return _run_multinode(args)
    from plait.launch.job import check_elastic

    try:
        check_elastic(nproc=args.nproc, min_nproc=args.min_nproc, max_restarts=args.max_restarts)
    except ValueError as exc:
        print(f"plait run: {exc}", file=sys.stderr)
        return 2
    return _run_local(args)


def _run_healing(args: argparse.Namespace, multinode: bool) -> int:
    """``plait run --heal K``: the ranks heal instead of restarting (plait.heal.run: the
    store hosted by node 0's launcher, a rank that dies does not stop the others, at most
    ``K`` replacements join on each machine); the script builds
    ``HealingTrainer.from_env`` (``ReplicaTrainer.from_env`` with ``--replica-size``).
    Several machines: ``--nnodes N --node-rank r --master-addr A --master-port P`` on
    each, as without healing (no torchrun: the launchers are plait's own)."""
    clash = [
        name
        for name, on in (
            ("--nnodes MIN:MAX (elastic rendezvous)", ":" in str(args.nnodes)),
            ("--max-restarts", args.max_restarts != 0),
            ("--min-nproc", args.min_nproc is not None),
        )
        if on
    ]
    if clash:
        print(
            f"plait run: --heal does not combine with {', '.join(clash)}: a healing job "
            f"replaces its dead ranks itself (docs/healing.md)",
            file=sys.stderr,
        )
        return 2
    from plait.heal import run as heal_run  # deferred: only healing jobs need it

    argv = ["-n", str(args.nproc), "--replacements", str(args.heal)]
    argv += ["--replica-size", str(args.replica_size)]
    if multinode:
        argv += ["--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank)]
        argv += ["--master-addr", args.master_addr or "127.0.0.1"]
        argv += ["--master-port", str(args.master_port or 29500)]
    return heal_run.main(argv + [args.script] + list(args.script_args))


def _run_multinode(args: argparse.Namespace) -> int:
    """Several machines: hand over to torchrun's own launcher (same environment contract;
    ``--nnodes MIN:MAX``: its elastic c10d rendezvous at ``--master-addr:--master-port``)."""
    from plait.launch.job import run_torchrun

    return run_torchrun(
        args.script,
        args.script_args,
        nproc=args.nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr or "127.0.0.1",
        master_port=args.master_port or 29500,
        max_restarts=args.max_restarts,
        grace=args.grace,
        local_addr=args.local_addr,
        rdzv_conf=args.rdzv_conf,
    )


def _run_local(args: argparse.Namespace) -> int:
    """N local ranks (plait.launch.job.run_job): the launcher hosts the store, watches exits
    and heartbeats, reports the root cause, restarts up to --max-restarts times."""
    from plait.launch.job import run_job

    return run_job(
        args.script,
        args.script_args,
        nproc=args.nproc,
        max_restarts=args.max_restarts,
        min_nproc=args.min_nproc,
        grace=args.grace,
        timeout=args.timeout,
        heartbeat_timeout=args.heartbeat_timeout,
        master_port=args.master_port,
    )


# --- plait bench calibrate ----------------------------------------------------------------
def _bench_calibrate(args: argparse.Namespace) -> int:
    from plait import bench

    return bench.calibrate(args.nproc, out=args.json, iters=args.iters)


# --- plait bench comm ---------------------------------------------------------------------
def _bench_comm(args: argparse.Namespace) -> int:
    from plait import bench
    from plait.comm import ALGORITHMS, SUPPORTED, tuner
    from plait.launch.pool import RankPool

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
        f"plait bench comm: {args.nproc} ranks, float32, "
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
        transport = bench.table_transport(rows)  # a table measured on shm is an shm table
        backend = bench.table_backend(rows)
        table: dict[str, dict[int, list[tuple[int, str]]]] = {}
        if path.exists():
            tuner.load(path)
            if tuner._transport == transport and tuner._backend == backend:
                table = dict(tuner._table or {})
        for collective, per_world in bench.tune_table(rows).items():
            table.setdefault(collective, {}).update(per_world)
        tuner.save(table, path, backend=backend, transport=transport)
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


def _plan_tensor(args: argparse.Namespace) -> int:
    """1D, 2D, 2.5D and 3D tensor parallelism side by side for a GPT (tensor_costs)."""
    from plait.plan import tensor_costs as tc

    shape = {
        "ranks": args.nproc,
        "width": args.width,
        "layers": args.layers,
        "vocab": args.vocab,
        "depth": args.depth,
    }
    try:
        rows = tc.compare_modes(tokens=args.tokens, bytes_per_element=args.bytes, **shape)
    except ValueError as e:
        print(f"plait plan tensor: {e}", file=sys.stderr)
        return 2
    print(
        f"plait plan tensor: GPT width {args.width}, {args.layers} layers, vocabulary "
        f"{args.vocab}, {args.tokens:,} tokens per step, {args.nproc} tensor-parallel ranks "
        f"(2.5d depth {args.depth}), {args.bytes}-byte elements\n"
        "linear layers only, forward + backward, per rank; bytes as plait's ring algorithms "
        "send them (plait.plan.tensor_costs)"
    )
    print(tc.format_modes(rows))
    for r in rows:
        if r.valid and r.mode != "1d":
            t = tc.crossover_tokens(r.mode, **shape)
            when = "never" if t is None else f"above {t:,.0f} tokens per step"
            print(f"{r.mode} sends fewer bytes than 1d: {when}")
    return 0


# --- plait demo ---------------------------------------------------------------------------
def _slow_worker(text: str | None) -> tuple[int, float] | None:
    if text is None:
        return None
    try:
        rank, factor = text.split(":")
        return int(rank), float(factor)
    except ValueError:
        from plait.demo.digits import DemoOptionError

        raise DemoOptionError(
            f"--slow-worker must be RANK:FACTOR, e.g. 3:3 (rank 3 takes 3x as long per step), "
            f"got {text!r}"
        ) from None


def _demo(args: argparse.Namespace) -> int:
    if args.kill_rank is not None or args.kill_step is not None:
        from plait.demo import heal as demo_heal

        if args.kill_rank is None:
            print("plait demo: --kill-step needs --kill-rank", file=sys.stderr)
            return 2
        return demo_heal.main(args)
    if args.tour:
        from plait.demo import tour as demo_tour

        return demo_tour.main(args)
    if args.model == "gpt":
        return _demo_gpt(args)
    from plait.demo.digits import DemoOptionError, check_passed, run, validate

    gpt_only = [
        flag
        for flag, used in (
            ("--tp", args.tp is not None),
            ("--sp", args.sp),
            ("--tp-mode", args.tp_mode != "1d"),
            ("--steps", args.steps is not None),
            ("--seq-len", args.seq_len is not None),
            ("--width", args.width is not None),
            ("--layers", args.layers is not None),
            ("--heads", args.heads is not None),
            ("--pp", args.pp != 1),
            ("--schedule", args.schedule is not None),
            ("--microbatches", args.microbatches is not None),
            ("--moe", args.moe),
            ("--ep", args.ep != 1),
            ("--experts", args.experts is not None),
            ("--cp", args.cp != 1),
            ("--context", args.context is not None),
            ("--evals", args.evals is not None),
            ("--reference-steps", args.reference_steps is not None),
        )
        if used
    ]
    if gpt_only:
        print(f"plait demo: {', '.join(gpt_only)}: options of --model gpt", file=sys.stderr)
        return 2

    # --ps-mode ssp without --staleness: bound the workers' lead at 2 steps (printed)
    staleness = args.staleness
    if staleness is None and args.strategy == "ps" and args.ps_mode == "ssp":
        staleness = 2
    try:
        config = _demo_config(args, staleness)
        validate(config)  # before any rank starts: one line, exit 2
    except DemoOptionError as e:
        print(f"plait demo: {e}", file=sys.stderr)
        return 2
    report = run(config, check=args.check, out_dir=Path(args.out))
    return 0 if check_passed(report) else 1  # --check failed: say so in the exit code


def _demo_gpt(args: argparse.Namespace) -> int:
    if args.reference_steps is not None:
        print("plait demo: --reference-steps is an option of --tour", file=sys.stderr)
        return 2
    from plait.demo.gpt import check_passed, run
    from plait.demo.options import GPTDemoConfig, GPTDemoOptionError, fit_defaults, validate

    cnn_only = [
        flag
        for flag, used in (
            ("--strategy", args.strategy != "ddp"),
            ("--epochs", args.epochs is not None),
            ("--bucket-mb", args.bucket_mb != 25.0),
            ("--evals-per-epoch", args.evals_per_epoch != 1),
            ("--ps-mode", args.ps_mode != "sync"),
            ("--servers", args.servers != 1),
            ("--staleness", args.staleness is not None),
            ("--backup-workers", args.backup_workers != 0),
            ("--slow-worker", args.slow_worker is not None),
            ("--max-staleness", args.max_staleness is not None),
            ("--reproducible", args.reproducible),
            ("--microbatch-size", args.microbatch_size is not None),
        )
        if used
    ]
    if cnn_only:
        print(
            f"plait demo: {', '.join(cnn_only)}: not options of --model gpt (its layouts: "
            f"dp x tp with plait DDP over dp, --pp, --moe --ep, --cp)",
            file=sys.stderr,
        )
        return 2
    if args.context is not None and args.cp <= 1:
        print(
            f"plait demo: --context {args.context} applies to context parallelism: add --cp 2 "
            f"(or more), or drop --context",
            file=sys.stderr,
        )
        return 2
    multiple = args.pp if args.pp > 1 else args.cp * (args.tp or 1) if args.cp > 1 else 2
    nproc = args.nproc if args.nproc is not None else multiple
    base = GPTDemoConfig()
    default_tp = 1 if (args.pp > 1 or args.moe or args.cp > 1) else nproc
    try:
        config = GPTDemoConfig(
            world_size=nproc,
            tp=args.tp if args.tp is not None else default_tp,
            pp=args.pp,
            schedule=args.schedule or base.schedule,
            microbatches=args.microbatches,
            moe=args.moe,
            ep=args.ep,
            experts=args.experts if args.experts is not None else base.experts,
            cp=args.cp,
            context=args.context or base.context,
            evals=args.evals if args.evals is not None else base.evals,
            sequence_parallel=args.sp,
            tp_mode=args.tp_mode,
            tp_depth=args.tp_depth,
            steps=args.steps if args.steps is not None else base.steps,
            batch_size=args.batch_size if args.batch_size is not None else base.batch_size,
            seq_len=args.seq_len if args.seq_len is not None else base.seq_len,
            width=args.width if args.width is not None else base.width,
            layers=args.layers if args.layers is not None else base.layers,
            heads=args.heads if args.heads is not None else base.heads,
            lr=args.lr if args.lr is not None else base.lr,
            algorithm=args.algorithm,
            seed=args.seed,
            name=args.name or "",
            dtype=args.dtype or "float32",
        )
        options = ("heads", "width", "seq_len", "experts", "batch_size")
        config = fit_defaults(config, given={k for k in options if getattr(args, k) is not None})
        validate(config)
    except GPTDemoOptionError as e:
        print(f"plait demo: {e}", file=sys.stderr)
        return 2
    report = run(config, check=args.check, out_dir=Path(args.out))
    return 0 if check_passed(report) else 1  # --check failed: say so in the exit code


def _demo_config(args: argparse.Namespace, staleness: int | None) -> Any:
    from plait.demo.digits import DemoConfig

    nproc = args.nproc if args.nproc is not None else (1 if args.strategy == "none" else 4)
    return DemoConfig(
        world_size=nproc,
        strategy=args.strategy,
        epochs=args.epochs if args.epochs is not None else 10,
        batch_size=args.batch_size if args.batch_size is not None else max(64, nproc),
        lr=args.lr if args.lr is not None else 0.05,
        algorithm=args.algorithm,
        bucket_mb=args.bucket_mb,
        seed=args.seed,
        name=args.name or "",
        ps_mode=args.ps_mode,
        servers=args.servers,
        staleness=staleness,
        backup_workers=args.backup_workers,
        slow_worker=_slow_worker(args.slow_worker),
        max_staleness=args.max_staleness,
        evals_per_epoch=args.evals_per_epoch,
        dtype=args.dtype or "float32",
        reproducible=args.reproducible,
        microbatch_size=args.microbatch_size if args.microbatch_size is not None else 8,
    )


def version() -> str:
    """This plait's version: the installed distribution's metadata (``importlib.metadata``),
    else ``plait.__version__`` (a source tree run without installing it)."""
    from importlib import metadata

    try:
        return metadata.version("plait")
    except metadata.PackageNotFoundError:
        from plait import __version__

        return __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="plait", description="distributed training on PyTorch")
    parser.add_argument("--version", action="version", version=f"plait {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="launch a script on N ranks",
        description=RUN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument(
        "-n",
        "--nproc",
        type=POSITIVE,
        default=None,
        help="ranks on this machine (required; Kubeflow: PET_NPROC_PER_NODE)",
    )
    run.add_argument(
        "--nnodes",
        type=_nnodes,
        default=None,
        help="machines, or MIN:MAX for torchrun's elastic c10d rendezvous (hands over to "
        "torchrun; under srun and Kubeflow read from SLURM_*/PET_*)",
    )
    run.add_argument("--node-rank", type=NONNEGATIVE, default=None)
    run.add_argument("--master-addr", default=None)
    run.add_argument(
        "--master-port",
        type=whole(1, 65535),
        default=None,
        help="store port (local: a free one; else 29500)",
    )
    run.add_argument("--local-addr", default=None, help="this node's address (torchrun)")
    run.add_argument(
        "--rdzv-conf",
        default=None,
        help="with --nnodes MIN:MAX: torchrun's --rdzv-conf (e.g. last_call_timeout=5)",
    )
    run.add_argument(
        "--timeout", type=real(0, above=True), default=None, help="stop after this many seconds"
    )
    run.add_argument(
        "--max-restarts",
        type=NONNEGATIVE,
        default=0,
        help="restart every rank after a failure, k times",
    )
    run.add_argument(
        "--min-nproc",
        type=POSITIVE,
        default=None,
        help="elastic: after a failure restart with one rank fewer, never below this "
        "(needs --max-restarts; default -n: same size)",
    )
    run.add_argument("--grace", type=real(0), default=5.0, help="SIGTERM to SIGKILL, seconds")
    run.add_argument(
        "--heal",
        type=NONNEGATIVE,
        default=None,
        metavar="K",
        help="heal instead of restarting: a dead rank does not stop the others, up to K "
        "replacements join (the script uses HealingTrainer.from_env; docs/healing.md)",
    )
    run.add_argument(
        "--replica-size",
        type=POSITIVE,
        default=1,
        metavar="P",
        help="with --heal: ranks per model-parallel replica (PTD-P's pp x tp x cp; the "
        "script uses ReplicaTrainer.from_env): a replica heals whole",
    )
    run.add_argument(
        "--heartbeat-timeout",
        type=_heartbeat_timeout,
        default=None,
        help="a rank silent this long is frozen (default PLAIT_HEARTBEAT_TIMEOUT or 5)",
    )
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    run.set_defaults(func=_run)

    demo = sub.add_parser(
        "demo", help="train the digits CNN (or, with --model gpt, the GPT) on N local ranks"
    )
    demo.add_argument(
        "-n",
        "--nproc",
        type=int,
        default=None,
        help="ranks (default 4; 1 for --strategy none; 2 for --model gpt: pp with --pp, cp x tp "
        "with --cp)",
    )
    demo.add_argument("--model", choices=["cnn", "gpt"], default="cnn")
    demo.add_argument(
        "--tour",
        action="store_true",
        help="the GPT learns in one process, then DDP, TP, PP, PTD-P and MoE continue it on "
        "4 ranks, each checked against one process; a table and pictures",
    )
    demo.add_argument(
        "--strategy",
        default="ddp",
        choices=["ddp", "naive", "zero1", "zero2", "zero3", "fsdp", "ps", "none"],
    )
    demo.add_argument("--epochs", type=int, default=None, help="cnn: default 10")
    demo.add_argument(
        "--batch-size", type=int, default=None, help="global batch (cnn 64, gpt 16 windows)"
    )
    demo.add_argument("--lr", type=float, default=None, help="cnn 0.05 (SGD), gpt 3e-3 (Adam)")
    demo.add_argument("--algorithm", default="auto")
    demo.add_argument("--bucket-mb", type=float, default=25.0)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--name", default=None, help="run folder name under --out")
    demo.add_argument("--out", default="runs")
    demo.add_argument(
        "--dtype",
        choices=["float32", "float64"],
        default=None,
        help="of the model (default float32; --tour: the layouts' continuations, default "
        "float64); float64 makes --check exact on any CPU",
    )
    demo.add_argument(
        "--reproducible",
        action="store_true",
        help="cnn: layout-invariant training; --check then demands max diff 0 (bitwise)",
    )
    demo.add_argument(
        "--microbatch-size",
        type=int,
        default=None,
        help="with --reproducible: samples per micro-batch (default 8; batch/m and -n "
        "powers of two, -n dividing batch/m)",
    )
    gpt = demo.add_argument_group(
        "the GPT (--model gpt): Mesh(dp=n/tp, tp=tp), or Mesh(pp=n), or Mesh(ep=ep, dp=n/ep), "
        "or Mesh(dp=n/(cp*tp), cp=cp, tp=tp)"
    )
    gpt.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: n)")
    gpt.add_argument("--sp", action="store_true", help="sequence parallelism over tp")
    gpt.add_argument(
        "--tp-mode",
        choices=["1d", "2d", "2.5d", "3d"],
        default="1d",
        help="tp ranks as a q x q (2d), d x q x q (2.5d) or q^3 (3d) grid",
    )
    gpt.add_argument("--tp-depth", type=int, default=2, help="2.5d: depth d (default 2)")
    gpt.add_argument("--steps", type=int, default=None, help="default 150 (--tour: 20 per layout)")
    gpt.add_argument(
        "--reference-steps",
        type=int,
        default=None,
        help="--tour: steps the reference trains in one process before the layouts (1000)",
    )
    gpt.add_argument("--seq-len", type=int, default=None, help="default 64")
    gpt.add_argument("--width", type=int, default=None, help="default 64")
    gpt.add_argument("--layers", type=int, default=None, help="default 2")
    gpt.add_argument("--heads", type=int, default=None, help="default 4")
    gpt.add_argument("--evals", type=int, default=None, help="held-out points (default 10)")
    gpt.add_argument("--pp", type=int, default=1, help="pipeline stages: Mesh(pp=n)")
    gpt.add_argument(
        "--schedule",
        default=None,
        help="gpipe, 1f1b (default), interleaved, zb-h1, zbv, dualpipev (m >= 2p)",
    )
    gpt.add_argument("--microbatches", type=int, default=None, help="default 2 x pp")
    gpt.add_argument("--moe", action="store_true", help="GShard MoE in every second block")
    gpt.add_argument("--ep", type=int, default=1, help="expert-parallel size (with --moe)")
    gpt.add_argument("--experts", type=int, default=None, help="experts per MoE layer (4)")
    gpt.add_argument(
        "--cp", type=int, default=1, help="context-parallel size: the sequence split over cp"
    )
    gpt.add_argument(
        "--context",
        choices=["ring", "ulysses"],
        default=None,
        help="with --cp: ring attention (default) or Ulysses all-to-all",
    )
    ps = demo.add_argument_group("parameter server (--strategy ps)")
    ps.add_argument("--ps-mode", choices=["sync", "async", "ssp"], default="sync")
    ps.add_argument("--servers", type=int, default=1, help="server ranks (0..S-1)")
    ps.add_argument("--staleness", type=int, default=None, help="ssp bound s (default 2)")
    ps.add_argument("--backup-workers", type=int, default=0, help="sync: proceed after n-b")
    ps.add_argument("--slow-worker", default=None, metavar="RANK:FACTOR", help="a straggler")
    ps.add_argument(
        "--max-staleness", type=int, default=None, help="async: refuse staler gradients"
    )
    demo.add_argument(
        "--evals-per-epoch", type=int, default=1, help="test-accuracy points per epoch"
    )
    demo.add_argument(
        "--check",
        action="store_true",
        help="also train in one process on the global batch and compare",
    )
    heal = demo.add_argument_group("healing (docs/healing.md)")
    heal.add_argument("--kill-rank", type=int, default=None, help="SIGKILL this rank mid-step")
    heal.add_argument("--kill-step", type=int, default=None, help="in this step (from 0)")
    heal.add_argument("--no-rejoin", action="store_true", help="no replacement: end at n - 1")
    demo.set_defaults(func=_demo)

    bench_p = sub.add_parser("bench", help="measure")
    bench_sub = bench_p.add_subparsers(dest="what", required=True)
    comm_p = bench_sub.add_parser("comm", help="collectives, nccl-tests style")
    comm_p.add_argument("-n", "--nproc", type=POSITIVE, default=4)
    comm_p.add_argument("--collectives", default="all_reduce,reduce_scatter,all_gather,broadcast")
    comm_p.add_argument("--algorithms", default=None, help="comma-separated (default: all)")
    comm_p.add_argument("--min-size", default="4K")
    comm_p.add_argument("--max-size", default="16M")
    comm_p.add_argument("--iters", type=POSITIVE, default=20, help="at most this many timed calls")
    comm_p.add_argument("--json", default=None, help="default runs/bench_comm_n<N>.json")
    comm_p.add_argument("--tune", action="store_true", help="write the table auto reads")
    comm_p.add_argument("--tune-file", default=None)
    comm_p.set_defaults(func=_bench_comm)
    cal_p = bench_sub.add_parser("calibrate", help="this machine's constants for plait plan (cpu)")
    cal_p.add_argument("-n", "--nproc", type=POSITIVE, default=4)
    cal_p.add_argument("--json", default=None, help="default runs/plan_calibration_n<N>.json")
    cal_p.add_argument("--iters", type=POSITIVE, default=8)
    cal_p.set_defaults(func=_bench_calibrate)

    plan_p = sub.add_parser("plan", help="plan before running")
    plan_sub = plan_p.add_subparsers(dest="what", required=True)
    from plait.plan.cli import add_subcommands

    add_subcommands(plan_sub)  # memory, layouts (alias search): plait/plan/cli.py
    tensor_p = plan_sub.add_parser(
        "tensor", help="bytes and memory per rank of 1D, 2D, 2.5D and 3D tensor parallelism"
    )
    tensor_p.add_argument(
        "-n", "--nproc", type=POSITIVE, required=True, help="tensor-parallel ranks"
    )
    tensor_p.add_argument("--tokens", type=POSITIVE, required=True, help="tokens per step (b s)")
    tensor_p.add_argument("--width", type=POSITIVE, required=True)
    tensor_p.add_argument("--layers", type=POSITIVE, required=True)
    tensor_p.add_argument("--vocab", type=POSITIVE, required=True)
    tensor_p.add_argument("--depth", type=POSITIVE, default=2, help="2.5d depth (default 2)")
    tensor_p.add_argument("--bytes", type=POSITIVE, default=4, help="bytes per element (default 4)")
    tensor_p.set_defaults(func=_plan_tensor)

    doctor_p = sub.add_parser(
        "doctor", help="read the flight-recorder dumps of a failed job; name what went wrong"
    )
    doctor_p.add_argument(
        "directory",
        help="the flight-recorder folder plait run's failure report names (or a job's "
        "folder: every attempt), or PLAIT_RECORDER_DIR",
    )
    doctor_p.set_defaults(func=_doctor)

    from plait.plan.cli import default_subcommand

    args = parser.parse_args(default_subcommand(list(sys.argv[1:] if argv is None else argv)))
    return int(args.func(args))


def _doctor(args: argparse.Namespace) -> int:
    from plait.launch import doctor

    print(doctor.report(args.directory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
