"""Calibrate this machine for the planner, on the transport the ranks really use.

``plait.plan.hardware.local_cpu`` times layouts with link constants and a compute speed.
Read from the wrong transport they mislead: gloo's loopback costs ~1 ms per small
collective, while ranks of one host talk through shared memory (``PLAIT_TRANSPORT=auto``,
:mod:`plait.comm.shm`) in tens of microseconds. :func:`measure_rank` runs on every rank of a
world of ``n`` ranks and measures, with the algorithm ``"auto"`` picks (what the strategies
call) and every group of a size busy at once (as a layout runs them):

* ``all_reduce``, ``all_gather``, ``reduce_scatter`` over groups of each size ``g`` dividing
  ``n`` (``Mesh(dp=n/g, tp=g)``'s tp groups): the slowest rank's time, median of calls, at
  a few sizes; ``S`` the full tensor (the input of all-reduce and reduce-scatter, the
  gathered output of all-gather);
* ``p2p``: a send one way between the two ranks of each pair (``Mesh(pp=2, dp=n/2)``'s
  pp groups, every pair at once), half a round trip;
* ``adam``: ``torch.optim.Adam``'s step over a few sizes of parameters, every rank at once
  (the optimizer step is memory-bound; ZeRO divides it by ``dp``);
* ``block_overhead``: a tiny GPT block's forward and backward (almost no FLOPs): what a
  block costs per micro-batch whatever its size (operator dispatch), which small
  micro-batches and tensor-parallel shards pay in full;
* ``gemm``: ``M x K @ K x N`` float32 matmuls (one thread) at the shapes a GPT block's
  linears take when split over ``t`` ranks, repeated for ~20 ms on every rank at once (the
  cores shared as in a run):
  :class:`Calibration.gemm_flops` interpolates the rate by the matmul's FLOPs.

Each (collective, group size) is fit as ``t = latency + S / bandwidth`` over its sizes
(:func:`fit_line`): a measured line per collective, no ring model in between, since on a
shared-memory host a collective's cost is set by the copies and the wake-ups of ranks that
share cores, not by link hops. The file (:func:`save` / :func:`load`, default
``runs/plan_calibration_n<N>.json``) is what ``local_cpu(ranks=N)`` reads.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
BLOCK = 5  # calls timed back to back
BURST_S = 2e-3  # compute between two calls when measuring them as a step interleaves them
SIZES = (4 << 10, 64 << 10, 512 << 10, 2 << 20)
# (M, K, N): a micro-batch of 1024 tokens through linears of width 128 split 1..8 ways
GEMMS = (
    (1024, 128, 512),
    (1024, 128, 256),
    (1024, 128, 128),
    (1024, 128, 64),
    (1024, 128, 32),
    (1024, 128, 16),
    (1024, 64, 128),
    (1024, 32, 128),
    (256, 128, 128),
    (4096, 128, 512),
)


@dataclass(frozen=True)
class Line:
    """``seconds = latency + bytes / bandwidth``, fit to ``points`` measurements."""

    latency: float
    bandwidth: float
    points: int

    def seconds(self, size: float) -> float:
        return self.latency + size / self.bandwidth


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """What :func:`measure_rank` found on ``ranks`` ranks sharing ``cores`` cores."""

    ranks: int
    cores: int
    transport: str  # "shm" or "gloo": what carried the messages
    links: dict[str, dict[int, Line]]  # collective -> group size -> fit, between bursts
    idle_links: dict[str, dict[int, Line]] = field(default_factory=dict)  # back to back
    gemm: list[tuple[int, int, int, float]] = field(default_factory=list)  # M, K, N, FLOP/s
    # torch.optim.Adam's step: seconds = latency + parameter elements / bandwidth
    adam: Line | None = None
    # seconds of a GPT block's forward and backward that do not grow with its FLOPs
    # (operator dispatch): a tiny block's, every rank busy
    block_overhead: float = 0.0
    raw: list[dict[str, Any]] = field(default_factory=list)

    def line(self, collective: str, n: int) -> Line | None:
        """The fit for ``collective`` over ``n`` ranks (``p2p``: any ``n``), or the nearest
        measured group size; None if the collective was not measured."""
        per = self.links.get(collective)
        if not per:
            return None
        if collective == "p2p":
            return next(iter(per.values()))
        return per[min(per, key=lambda k: (abs(k - n), k))]

    def gemm_flops(self, flops: float) -> float:
        """FLOP/s of a matmul of ``flops`` FLOPs on one rank while every rank computes:
        log-linear between the measured shapes, clamped at the ends."""
        pts = sorted((2.0 * m * k * n, rate) for m, k, n, rate in self.gemm)
        if not pts:
            raise ValueError("Calibration has no gemm rows; rerun the calibration")
        if flops <= pts[0][0]:
            return pts[0][1]
        if flops >= pts[-1][0]:
            return pts[-1][1]
        for (f0, r0), (f1, r1) in zip(pts, pts[1:], strict=False):
            if f0 <= flops <= f1:
                if f1 == f0:
                    return max(r0, r1)
                w = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
                return r0 + w * (r1 - r0)
        return pts[-1][1]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("links", "idle_links"):
            d[key] = {
                c: {str(n): asdict(v) for n, v in per.items()}
                for c, per in getattr(self, key).items()
            }
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Calibration:
        def lines(key: str) -> dict[str, dict[int, Line]]:
            return {
                c: {int(n): Line(**v) for n, v in per.items()} for c, per in d.get(key, {}).items()
            }

        links = lines("links")
        if not links:
            raise KeyError("links")
        adam = d.get("adam")
        return Calibration(
            adam=Line(**adam) if adam else None,
            block_overhead=float(d.get("block_overhead", 0.0)),
            ranks=int(d["ranks"]),
            cores=int(d["cores"]),
            transport=str(d["transport"]),
            links=links,
            idle_links=lines("idle_links"),
            gemm=[(int(m), int(k), int(n), float(r)) for m, k, n, r in d.get("gemm", [])],
            raw=list(d.get("raw", [])),
        )


def fit_line(points: Sequence[tuple[float, float]]) -> Line:
    """Least-squares ``t = a + S / b`` over ``(S, t)`` points; a negative intercept is
    clamped to 0 (and the slope refit through the origin); a non-positive slope (noise
    larger than the sizes' cost) keeps the fastest time as the latency and the largest
    message's time over its size as the slope."""
    if len(points) < 2:
        raise ValueError(f"fit_line: need 2 or more sizes, got {len(points)}")
    n = len(points)
    sx = sum(s for s, _ in points)
    st = sum(t for _, t in points)
    sxx = sum(s * s for s, _ in points)
    sxt = sum(s * t for s, t in points)
    det = n * sxx - sx * sx
    slope = (n * sxt - sx * st) / det if det else 0.0
    a = (st - slope * sx) / n
    if a < 0:
        a, slope = 0.0, sxt / sxx
    if slope <= 0:  # noise hid the size's cost: the fastest call as latency, and the
        s, t = max(points)  # largest message's whole time as its transfer (conservative)
        a, slope = min(t for _, t in points), t / s
    return Line(latency=a, bandwidth=1.0 / slope, points=n)


def _slowest(seconds: list[float], group: Any) -> list[float]:
    import torch

    from plait import comm

    t = torch.tensor(seconds, dtype=torch.float64)
    comm.all_reduce(t, op="max", group=group)
    return [float(v) for v in t.tolist()]


def _time_calls(fn: Any, iters: int, world: Any, block: int = BLOCK) -> float:
    """Seconds per call: median over ``iters`` blocks of ``block`` back-to-back calls
    (after a barrier) of the slowest rank's time, over ``block``. Back to back, as a
    training step issues them: the barrier's uneven release is paid once per block."""
    from plait import comm

    fn()
    fn()
    times = []
    for _ in range(iters):
        comm.barrier(group=world)
        t0 = time.perf_counter()
        for _ in range(block):
            fn()
        times.append((time.perf_counter() - t0) / block)
    return statistics.median(_slowest(times, world))


def _collective(collective: str, numel: int, group: Any) -> Callable[[], object]:
    """One ``collective`` of ``numel`` float32 elements over ``group`` (algorithm auto)."""
    import torch

    from plait import comm

    full, part = torch.ones(numel), torch.ones(numel // group.size)
    if collective == "all_reduce":
        return lambda: comm.all_reduce(full, group=group)
    if collective == "all_gather":
        return lambda: comm.all_gather(full, part, group=group)
    return lambda: comm.reduce_scatter(part, full, group=group)


def _gemm_rates(
    gemms: Sequence[tuple[int, int, int]], *, rounds: int, world: Any
) -> list[tuple[int, int, int, float]]:
    """FLOP/s per rank of each shape, every rank at once; the shapes take turns round by
    round (a noisy moment of a shared machine hits them alike), median over rounds."""
    import torch

    from plait import comm

    mats = [(torch.randn(m, k), torch.randn(k, n)) for m, k, n in gemms]
    # enough repeats for ~20 ms at 50 GFLOP/s: the ranks share the cores for real
    reps = [max(1, int(1e9 / (2.0 * m * k * n))) for m, k, n in gemms]
    times: list[list[float]] = [[] for _ in gemms]
    for a, b in mats:
        a @ b
    for _ in range(rounds):
        for i, (a, b) in enumerate(mats):
            comm.barrier(group=world)
            t0 = time.perf_counter()
            for _ in range(reps[i]):
                a @ b
            times[i].append((time.perf_counter() - t0) / reps[i])
    out = []
    for (m, k, n), ts in zip(gemms, times, strict=True):
        out.append((m, k, n, 2.0 * m * k * n / statistics.median(_slowest(ts, world))))
    return out


def _adam_line(world: Any, *, iters: int) -> Line:
    """``torch.optim.Adam``'s step (PyTorch's default implementation) over 256K and 1M
    float32 parameter elements in tensors of 16K, every rank at once."""
    import torch

    pts = []
    for numel in (1 << 18, 1 << 20):
        params = [torch.nn.Parameter(torch.randn(1 << 14)) for _ in range(numel >> 14)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.Adam(params, lr=1e-3)
        pts.append((float(numel), _time_calls(opt.step, iters, world, block=2)))
    return fit_line(pts)


def _between_bursts(fn: Any, burst: Any, world: Any, *, iters: int, calls: int = 4) -> float:
    """Seconds one call of ``fn`` adds to a loop in which every rank computes ``burst``
    before each call, as a training step interleaves them: the slowest rank's loop with
    the calls minus without (rounds taking turns, medians), over ``calls``. On ranks that
    share cores this holds what back-to-back calls hide: a peer still computing, or
    asleep and waiting for a core, before the collective can finish."""
    from plait import comm

    def loop(with_calls: bool) -> float:
        comm.barrier(group=world)
        t0 = time.perf_counter()
        for _ in range(calls):
            burst()
            if with_calls:
                fn()
        return time.perf_counter() - t0

    loop(True)
    loop(False)
    on, off = [], []
    for _ in range(iters):
        on.append(loop(True))
        off.append(loop(False))
    t_on = statistics.median(_slowest(on, world))
    t_off = statistics.median(_slowest(off, world))
    return max(0.0, (t_on - t_off) / calls)


def _block_overhead(world: Any, *, iters: int) -> float:
    """Seconds per block of a tiny GPT's forward and backward (width 8, one token: almost
    no FLOPs, every operator still dispatched), every rank at once; the embedding and the
    head count as one more block."""
    import torch

    from plait.models import GPT, GPTConfig

    layers = 4
    model = GPT(GPTConfig(vocab=8, layers=layers, heads=2, width=8, seq_len=1))
    ids = torch.zeros(1, 1, dtype=torch.long)

    def step() -> None:
        model.zero_grad()
        model(ids).sum().backward()

    return _time_calls(step, iters, world, block=4) / (layers + 1)


def _burst(rate: float, seconds: float = BURST_S) -> Callable[[], None]:
    """A matmul loop of about ``seconds`` at ``rate`` FLOP/s (one thread)."""
    import torch

    a, b = torch.randn(256, 128), torch.randn(128, 128)
    reps = max(1, int(seconds * rate / (2.0 * 256 * 128 * 128)))

    def run() -> None:
        for _ in range(reps):
            a @ b

    return run


def _ping(pair: Any, buf: Any) -> Callable[[], None]:
    """A message each way between the two ranks of ``pair`` (two p2p transfers)."""
    from plait import comm

    def ping() -> None:
        if pair.rank == 0:
            comm.send(buf, 1, group=pair)
            comm.recv(buf, 1, group=pair)
        else:
            comm.recv(buf, 0, group=pair)
            comm.send(buf, 0, group=pair)

    return ping


def measure_rank(
    *, sizes: Sequence[int] = SIZES, iters: int = 8, gemms: Sequence[tuple[int, int, int]] = GEMMS
) -> dict[str, Any]:
    """Runs on every rank of the world (collective; each call blocks on the group's peers at
    most the group timeout): the rows of the module doc, as ``Calibration.to_dict()``."""
    import torch

    import plait
    from plait.comm import ops

    world = plait.world()
    n = world.size
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    raw: list[dict[str, Any]] = []
    links: dict[str, dict[int, Line]] = {}
    idle: dict[str, dict[int, Line]] = {}
    try:
        gemm = _gemm_rates(gemms, rounds=max(3, iters // 2), world=world)
        adam = _adam_line(world, iters=max(3, iters // 2))
        overhead = _block_overhead(world, iters=iters)
        burst = _burst(max(r for *_, r in gemm))
        cases: list[tuple[str, int, Any, float]] = []  # collective, n, call, bytes
        for g in (d for d in range(2, n + 1) if n % d == 0):
            group = plait.Mesh(dp=n // g, tp=g).group("tp")
            for collective in COLLECTIVES[:3]:
                for nbytes in sizes:
                    numel = max(g, nbytes // 4 // g * g)
                    call = _collective(collective, numel, group)
                    cases.append((collective, g, call, numel * 4.0))
        if n % 2 == 0:
            pair = plait.Mesh(pp=2, dp=n // 2).group("pp")
            for nbytes in sizes:
                cases.append(("p2p", 2, _ping(pair, torch.ones(nbytes // 4)), float(nbytes)))
        points: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
        for collective, g, call, size in cases:
            per = 2 if collective == "p2p" else 1  # a ping is two transfers
            back_to_back = _time_calls(call, iters, world) / per
            loaded = _between_bursts(call, burst, world, iters=max(3, iters // 2)) / per
            points.setdefault((collective, g), []).append((size, back_to_back, loaded))
            raw.append(
                {
                    "collective": collective,
                    "n": g,
                    "bytes": size,
                    "s": back_to_back,
                    "between_bursts_s": loaded,
                }
            )
        for (collective, g), pts in points.items():
            idle.setdefault(collective, {})[g] = fit_line([(s, t) for s, t, _ in pts])
            # between bursts, never below back to back
            links.setdefault(collective, {})[g] = fit_line([(s, max(t, u)) for s, t, u in pts])
    finally:
        torch.set_num_threads(threads)
    cal = Calibration(
        ranks=n,
        cores=os.cpu_count() or 1,
        transport="shm" if ops.shared(world) else "gloo",
        links=links,
        idle_links=idle,
        gemm=gemm,
        adam=adam,
        block_overhead=overhead,
        raw=raw,
    )
    return cal.to_dict()


def run(ranks: int, *, iters: int = 8, timeout: float = 600) -> Calibration:
    """Start ``ranks`` local ranks (the transport ``PLAIT_TRANSPORT`` selects, default
    shared memory) and measure (:func:`measure_rank`)."""
    from plait.launch import RankPool

    if ranks < 2:
        raise ValueError(f"calibrate: ranks={ranks}; measure links with 2 or more ranks")
    with RankPool(ranks, timeout=timeout) as pool:
        out = pool.run(measure_rank, iters=iters, timeout=timeout)[0]
    return Calibration.from_dict(out)


def default_path(ranks: int) -> Path:
    return Path(f"runs/plan_calibration_n{ranks}.json")


def save(cal: Calibration, path: str | Path | None = None) -> Path:
    p = Path(path) if path is not None else default_path(cal.ranks)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(cal.to_dict(), indent=1) + "\n")
    return p


def load(path: str | Path) -> Calibration:
    try:
        return Calibration.from_dict(json.loads(Path(path).read_text()))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{path}: not a plait plan calibration ({e}); rerun `plait bench calibrate`"
        ) from None


def format_calibration(cal: Calibration) -> str:
    """A short table of the fits and the matmul rates."""
    lines = [
        f"calibration: {cal.ranks} ranks on {cal.cores} cores, transport {cal.transport}",
        f"{'collective':<16}{'n':>3}{'latency(us)':>14}{'bandwidth(GB/s)':>18}"
        f"{'b2b lat(us)':>16}{'b2b bw(GB/s)':>18}",
        "(between 2 ms compute bursts on every rank, as a step runs them; b2b: back to back)",
    ]
    for c, per in cal.links.items():
        for n, ln in sorted(per.items()):
            row = f"{c:<16}{n:>3}{ln.latency * 1e6:>14.1f}{ln.bandwidth / 1e9:>18.3f}"
            b2b = cal.idle_links.get(c, {}).get(n)
            if b2b is not None:
                row += f"{b2b.latency * 1e6:>16.1f}{b2b.bandwidth / 1e9:>18.3f}"
            lines.append(row)
    if cal.adam is not None:
        a = cal.adam
        lines.append(
            f"{'adam step':<16}{'':>3}{a.latency * 1e6:>14.1f}{a.bandwidth / 1e9:>14.3f} G params/s"
        )
    lines.append(f"{'block overhead':<19}{cal.block_overhead * 1e6:>14.1f} us per block")
    lines.append(f"{'gemm M x K x N':<24}{'GFLOP/s per rank':>18}")
    for m, k, n, r in cal.gemm:
        lines.append(f"{f'{m}x{k}x{n}':<24}{r / 1e9:>18.2f}")
    return "\n".join(lines)


__all__ = [
    "COLLECTIVES",
    "Calibration",
    "Line",
    "default_path",
    "fit_line",
    "format_calibration",
    "load",
    "measure_rank",
    "run",
    "save",
]
