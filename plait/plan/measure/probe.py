"""The measurements :mod:`plait.plan.measure.calibrate` runs on every rank of a local world.

Each function here is collective over the world (it blocks on the other ranks through
barriers and the collectives it times, at most the groups' timeout) and returns the
slowest rank's figures, so every rank gets the same answer. :func:`measure_rank` is the
whole calibration (the list in :mod:`plait.plan.measure.calibrate`'s docstring).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

import plait
from plait import comm
from plait.comm import ops
from plait.models import GPT, GPTConfig
from plait.plan.calibration import COLLECTIVES, Calibration, Line, fit_line
from plait.plan.measure import probe_pipeline, probe_runtime, probe_tensor

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


def _slowest(seconds: list[float], group: Any) -> list[float]:

    t = torch.tensor(seconds, dtype=torch.float64)
    comm.all_reduce(t, op="max", group=group)
    return [float(v) for v in t.tolist()]


def _time_calls(fn: Any, iters: int, world: Any, block: int = BLOCK) -> float:
    """Seconds per call: median over ``iters`` blocks of ``block`` back-to-back calls
    (after a barrier) of the slowest rank's time, over ``block``. Back to back, as a
    training step issues them: the barrier's uneven release is paid once per block."""

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

    full, part = torch.ones(numel), torch.ones(numel // group.size)
    if collective == "all_reduce":
        return lambda: comm.all_reduce(full, group=group)
    if collective == "all_gather":
        return lambda: comm.all_gather(full, part, group=group)
    if collective == "all_to_all":  # equal blocks: each rank keeps 1/g of its input
        received = torch.empty(numel)
        return lambda: comm.all_to_all(received, full, group=group)
    return lambda: comm.reduce_scatter(part, full, group=group)


def _gemm_rates(
    gemms: Sequence[tuple[int, int, int]], *, rounds: int, world: Any
) -> list[tuple[int, int, int, float]]:
    """FLOP/s per rank of each shape, every rank at once; the shapes take turns round by
    round (a noisy moment of a shared machine hits them alike), median over rounds."""

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

    layers = 4
    model = GPT(GPTConfig(vocab=8, layers=layers, heads=2, width=8, seq_len=1))
    ids = torch.zeros(1, 1, dtype=torch.long)

    def step() -> None:
        model.zero_grad()
        model(ids).sum().backward()

    return _time_calls(step, iters, world, block=4) / (layers + 1)


def _burst(rate: float, seconds: float = BURST_S) -> Callable[[], None]:
    """A matmul loop of about ``seconds`` at ``rate`` FLOP/s (one thread)."""

    a, b = torch.randn(256, 128), torch.randn(128, 128)
    reps = max(1, int(seconds * rate / (2.0 * 256 * 128 * 128)))

    def run() -> None:
        for _ in range(reps):
            a @ b

    return run


def _ping(pair: Any, buf: Any) -> Callable[[], None]:
    """A message each way between the two ranks of ``pair`` (two p2p transfers)."""

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
            for collective in COLLECTIVES[:4]:
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
    base = Calibration(
        ranks=n,
        cores=1,
        transport="",
        links=links,
        idle_links=idle,
        adam=adam,
        block_overhead=overhead,
    )
    cores = os.cpu_count() or 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        own, own_raw = probe_runtime.measure(base, world, iters=max(3, iters // 2))
        if n > cores and n % 2 == 0:  # ranks share cores: how a pipeline runs on them
            rows = probe_pipeline.measure_rank(iters=iters)
            own["wake"], own["zb_split"] = probe_pipeline.fit(
                rows,
                cores=cores,
                ranks=n,
                p2p=links["p2p"][2],
                pipe_action=own.get("pipe_action", 0.0),
            )
            own_raw += [{"probe": "pipeline_sharing", **r} for r in rows]
        tp_rows = probe_tensor.measure_rank(iters=iters)  # whether or not cores are shared
        own_raw += [{"probe": "tensor_sharing", **r} for r in tp_rows]
    finally:
        torch.set_num_threads(threads)
    cal = Calibration(
        **own,
        ranks=n,
        cores=cores,
        transport="shm" if ops.shared(world) else "gloo",
        links=links,
        idle_links=idle,
        gemm=gemm,
        adam=adam,
        block_overhead=overhead,
        raw=raw + own_raw,
    )
    if tp_rows:  # against the planner with everything above (local_cpu reads the gemm rates)
        cal = replace(cal, tp_residual=probe_tensor.fit(tp_rows, cal=cal, ranks=n))
    return cal.to_dict()


__all__ = ["BURST_S", "GEMMS", "SIZES", "measure_rank"]
