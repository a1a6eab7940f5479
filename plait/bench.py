"""Measuring collectives, the way nccl-tests reports them.

For each (collective, algorithm, size) every rank runs a few warm-up calls, then timed
calls, each after a barrier; a call's time is the slowest rank's, and the row reports the
median over calls. ``algbw = S / time`` with S the full buffer (the gathered output for
all-gather, the input for reduce-scatter), and ``busbw = algbw * factor`` with nccl-tests'
factors, which make every collective comparable to the link speed:

==============  ===========
all_reduce      2 (n-1) / n
reduce_scatter  (n-1) / n
all_gather      (n-1) / n
all_to_all      (n-1) / n
broadcast       1
reduce          1
==============  ===========
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from plait import comm
from plait.comm import ops, tuner
from plait.plan.measure import calibrate as cal

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all")


def bus_factor(collective: str, n: int) -> float:
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    return 1.0


@dataclass
class Row:
    collective: str
    algorithm: str
    world_size: int
    bytes: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    iters: int
    resolved: str  # what "auto" picked; the algorithm itself otherwise
    transport: str = "gloo"  # "shm" when every rank of the world shares memory
    backend: str = "gloo"  # the world group's backend


def _call(
    collective: str, algorithm: str, nbytes: int, n: int, device: torch.device | str = "cpu"
) -> Callable[[], object]:
    """A closure running one collective of about ``nbytes`` float32 bytes on ``device``."""
    numel = max(n, (nbytes // 4) // n * n)
    buf = torch.ones(numel, device=device)
    part = torch.ones(numel // n, device=device)
    out = torch.empty(numel, device=device)
    if collective == "all_reduce":
        return lambda: comm.all_reduce(buf, algorithm=algorithm)
    if collective == "reduce_scatter":
        return lambda: comm.reduce_scatter(part, buf, algorithm=algorithm)
    if collective == "all_gather":
        return lambda: comm.all_gather(out, part, algorithm=algorithm)
    if collective == "broadcast":
        return lambda: comm.broadcast(buf, 0, algorithm=algorithm)
    if collective == "reduce":
        return lambda: comm.reduce(buf, 0, algorithm=algorithm)
    if collective == "all_to_all":
        return lambda: comm.all_to_all(out, buf, algorithm=algorithm)
    raise ValueError(f"unknown collective {collective!r}; use one of {COLLECTIVES}")


def _slowest(seconds: list[float], device: torch.device | str = "cpu") -> list[float]:
    t = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(t, dist.ReduceOp.MAX)
    return t.tolist()


def measure_rank(
    collectives: Sequence[str],
    algorithms: Sequence[str],
    sizes: Sequence[int],
    *,
    max_iters: int = 20,
    budget_s: float = 0.4,
    warmup: int = 2,
    on_row: Callable[[Row], None] | None = None,
) -> list[Row]:
    """Runs on every rank of the world: measure each supported combination.

    For one collective and size, the algorithms take turns call by call (A, B, C, A, B,
    C, ...), so a noisy moment on a shared machine hits them all alike; each row is the
    median over its calls of the slowest rank's time.
    """

    g = comm.world()
    shared = ops.shared(g)
    # NCCL takes tensors of this rank's GPU only (a table for it is measured there)
    device = torch.device("cuda", torch.cuda.current_device()) if g.backend == "nccl" else "cpu"
    rows = []
    for collective in collectives:
        algos = [
            a
            for a in algorithms
            if a == "auto" or (a in comm.SUPPORTED[collective] and (shared or a != "shm"))
        ]
        for nbytes in sizes:
            fns = {a: _call(collective, a, nbytes, g.size, device) for a in algos}
            for fn in fns.values():
                for _ in range(warmup):
                    fn()
            dist.barrier()
            t0 = time.perf_counter()
            for fn in fns.values():
                fn()
            first = _slowest([time.perf_counter() - t0], device)[0]
            iters = int(min(max_iters, max(3, budget_s / max(first, 1e-6))))
            times: dict[str, list[float]] = {a: [] for a in algos}
            for _ in range(iters):
                for a, fn in fns.items():
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    if device != "cpu":  # NCCL's work waits on the stream, not the host
                        torch.cuda.synchronize(device)
                    times[a].append(time.perf_counter() - t0)
            real = max(g.size, (nbytes // 4) // g.size * g.size) * 4
            for a in algos:
                median = statistics.median(_slowest(times[a], device))
                algbw = real / median / 1e9
                resolved = (
                    tuner.choose(collective, real, g.size, shm=shared, backend=g.backend)
                    if a == "auto"
                    else a
                )
                row = Row(
                    collective,
                    a,
                    g.size,
                    real,
                    median * 1e6,
                    algbw,
                    algbw * bus_factor(collective, g.size),
                    iters,
                    resolved,
                    "shm" if shared else "gloo",
                    g.backend,
                )
                rows.append(row)
                if on_row is not None and g.rank == 0:
                    on_row(row)
    return rows


def print_row(row: Row) -> None:
    print(format_rows([row]).splitlines()[1], flush=True)


def overhead_rank(rounds: int = 40, block: int = 25, numel: int = 4) -> dict[str, float]:
    """Microseconds per tiny all-reduce: plait (auto, ring, native) and torch.distributed.

    ``plait_native`` minus ``torch`` is plait's own cost per call on top of the backend's.

    Blocks of ``block`` calls of each take turns for ``rounds`` rounds; the median block
    of each is reported (the slowest rank's).
    """
    t = torch.ones(numel)
    fns = {
        "plait_auto": lambda: comm.all_reduce(t),
        "plait_ring": lambda: comm.all_reduce(t, algorithm="ring"),
        "plait_native": lambda: comm.all_reduce(t, algorithm="native"),
        "torch": lambda: dist.all_reduce(t),
    }
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        for _ in range(20):
            fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(block):
                fn()
            samples[name].append((time.perf_counter() - t0) / block * 1e6)
    return {name: statistics.median(_slowest(v)) for name, v in samples.items()}


def format_rows(rows: Sequence[Row]) -> str:
    lines = [
        f"{'collective':<15}{'algorithm':<18}{'n':>3}{'size(B)':>12}{'time(us)':>12}"
        f"{'algbw(GB/s)':>13}{'busbw(GB/s)':>13}"
    ]
    for r in rows:
        algo = r.algorithm if r.algorithm != "auto" else f"auto->{r.resolved}"
        lines.append(
            f"{r.collective:<15}{algo:<18}{r.world_size:>3}{r.bytes:>12}{r.time_us:>12.1f}"
            f"{r.algbw_gbps:>13.3f}{r.busbw_gbps:>13.3f}"
        )
    return "\n".join(lines)


def as_json(rows: Sequence[Row]) -> list[dict[str, object]]:
    return [asdict(r) for r in rows]


def table_transport(rows: Sequence[Row]) -> str:
    """The transport a tuning table built from ``rows`` was measured on."""
    return "shm" if rows and all(r.transport == "shm" for r in rows) else "gloo"


def table_backend(rows: Sequence[Row]) -> str:
    """The backend a tuning table built from ``rows`` was measured on."""
    return rows[0].backend if rows else "gloo"


def tune_table(rows: Sequence[Row]) -> dict[str, dict[int, list[tuple[int, str]]]]:
    """The fastest algorithm per (collective, world size, size), as tuner rows: each
    measured size covers messages up to it; the largest also covers everything above."""
    best: dict[tuple[str, int, int], Row] = {}
    for r in rows:
        if r.algorithm == "auto":
            continue
        key = (r.collective, r.world_size, r.bytes)
        if key not in best or r.time_us < best[key].time_us:
            best[key] = r
    table: dict[str, dict[int, list[tuple[int, str]]]] = {}
    for (collective, world, nbytes), r in sorted(best.items()):
        rows_for = table.setdefault(collective, {}).setdefault(world, [])
        if rows_for and rows_for[-1][1] == r.algorithm:
            rows_for[-1] = (nbytes, r.algorithm)  # extend the run
        else:
            rows_for.append((nbytes, r.algorithm))
    for per_world in table.values():
        for rows_for in per_world.values():
            rows_for[-1] = (1 << 62, rows_for[-1][1])
    return table


def parse_size(text: str) -> int:
    """``"4K"``, ``"16M"``, ``"1G"`` or plain bytes."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def calibrate(nproc: int, *, out: str | None = None, iters: int = 8) -> int:
    """``plait bench calibrate -n N``: measure what the planner's CPU preset reads (the
    collectives per group size, point-to-point, matmul and Adam rates, on the transport
    the ranks use: :mod:`plait.plan.measure.calibrate`) on ``nproc`` local ranks, print the table
    and write ``out`` (default ``runs/plan_calibration_n<N>.json``, which
    ``plait plan layouts --cluster cpu --ranks N`` reads)."""

    result = cal.run(nproc, iters=iters)
    print(cal.format_calibration(result), flush=True)
    path = cal.save(result, out)
    print(f"wrote {path}")
    return 0


def size_range(lo: int, hi: int, factor: int = 4) -> list[int]:
    sizes = []
    s = lo
    while s <= hi:
        sizes.append(s)
        s *= factor
    return sizes
