"""Clusters the planner times layouts on: devices, their FLOP/s and memory, and two links.

A :class:`Cluster` is ``nodes`` machines of ``devices_per_node`` devices. Each device has a
peak ``peak_flops`` (dense, in the training dtype) of which the model's compute reaches
``efficiency`` (kernels, LayerNorms, softmax and launch gaps included: a calibrated
constant, not a datasheet number), and ``memory_bytes`` of memory of which
``memory_reserve`` is kept back for what the planner does not count (allocator
fragmentation, workspaces, communication buffers).

Communication follows the alpha-beta model: a message of ``S`` bytes between two devices
costs ``alpha + S / beta`` seconds, ``beta`` the bandwidth one device gets in one direction.
Inside a node (NVLink) that is ``intra_bandwidth`` / ``intra_latency``; between nodes
(InfiniBand, one NIC per device on DGX machines) ``inter_bandwidth`` / ``inter_latency``.
A ring collective over ``n`` devices takes ``k (n-1)`` steps of ``S/n`` bytes (``k = 2``
for an all-reduce, 1 for a reduce-scatter or an all-gather), so::

    t_all_reduce(S, n) = 2 (n-1) alpha + 2 (n-1)/n S / beta

and a group whose members sit on more than one node runs at the inter-node link's speed.

Presets: :func:`a100` (DGX A100 / Selene, the hardware of PTD-P and Korthikanti et al.),
:func:`h100` (DGX H100), and :func:`local_cpu` (this machine, from a ``plait bench comm``
JSON file and a matmul timed here). Published constants::

    A100 SXM 80GB   312 TFLOP/s bf16 dense   NVLink3 600 GB/s both ways = 300 GB/s per direction
                    HDR InfiniBand 200 Gb/s per GPU (8 NICs per DGX) = 25 GB/s
                    HBM2e 2,039 GB/s (NVIDIA A100 datasheet, 80GB SXM)
    H100 SXM 80GB   989 TFLOP/s bf16 dense   NVLink4 900 GB/s both ways = 450 GB/s per direction
                    NDR InfiniBand 400 Gb/s per GPU = 50 GB/s; HBM3 3.35 TB/s (H100 datasheet)
    H200 SXM 141GB  the H100's compute and links; HBM3e 4.8 TB/s (H200 datasheet)
    B200            HBM3e 8 TB/s per GPU (DGX B200 datasheet: 64 TB/s for 8)
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from plait.plan import calibration as calibrate

if TYPE_CHECKING:
    from plait.plan.calibration import Calibration

# The GEMMs' share of peak and the memory-bound passes of every GPU preset: fitted once
# by benchmarks/plan_validate.py on 12 published A100 step times (PTD-P, Korthikanti et
# al., torchtitan: every other row of each source) and checked on 12 others (its
# results/plan_validate.md gives both errors). H100, H200 and B200 reuse them: no
# published run on those was fitted, so their predictions are less sure.
A100_EFFICIENCY = 0.69
ELEMENTWISE_PASSES = 7.2


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Devices and links (module doc). Bandwidths in bytes/s per device and direction."""

    name: str
    nodes: int
    devices_per_node: int
    peak_flops: float
    memory_bytes: float
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    efficiency: float
    memory_reserve: float = 0.0
    # memory-bound work (norms, activations, softmax, dropout, residual adds): each block
    # moves ``elementwise_passes`` times the bytes of the activations it would save, at
    # ``hbm_bandwidth`` (bytes/s, datasheet); 0 passes: folded into ``efficiency`` instead
    hbm_bandwidth: float = 0.0
    elementwise_passes: float = 0.0
    # the devices of a node share this many cores (CPU ranks); 0: each device computes alone
    shared_cores: float = 0.0
    # measured collectives of this machine (plait.plan.measure.calibrate);
    # None: the alpha-beta links
    calibration: Calibration | None = None

    def __post_init__(self) -> None:
        for f in ("nodes", "devices_per_node"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Cluster {self.name!r}: {f} needs a whole number >= 1, got {v!r}")
        for f in ("peak_flops", "memory_bytes", "intra_bandwidth", "inter_bandwidth"):
            if getattr(self, f) <= 0:
                value = getattr(self, f)
                raise ValueError(f"Cluster {self.name!r}: {f} must be above 0, got {value!r}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(
                f"Cluster {self.name!r}: efficiency={self.efficiency} must be in (0, 1] "
                f"(the share of peak FLOP/s the model's compute reaches)"
            )
        if not 0 <= self.memory_reserve < 1:
            raise ValueError(f"Cluster {self.name!r}: memory_reserve must be in [0, 1)")
        if self.elementwise_passes < 0 or (self.elementwise_passes and self.hbm_bandwidth <= 0):
            raise ValueError(
                f"Cluster {self.name!r}: elementwise_passes={self.elementwise_passes} needs "
                f"hbm_bandwidth > 0 (got {self.hbm_bandwidth})"
            )

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def usable_memory(self) -> float:
        return self.memory_bytes * (1 - self.memory_reserve)

    def link(self, spans_nodes: bool) -> tuple[float, float]:
        """``(latency, bandwidth)`` of the link a group uses."""
        if spans_nodes:
            return self.inter_latency, self.inter_bandwidth
        return self.intra_latency, self.intra_bandwidth

    @property
    def alone_speedup(self) -> float:
        """How much faster one device computes while others of its node idle: 1 for
        devices that own their compute; ``devices / cores`` (at most) for ranks sharing
        ``shared_cores`` cores, which a rank in a pipeline bubble hands to the others."""
        if self.shared_cores <= 0 or self.shared_cores >= self.devices_per_node:
            return 1.0
        return self.devices_per_node / self.shared_cores

    def with_nodes(self, nodes: int) -> Cluster:
        return replace(self, nodes=nodes)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(replace(self, calibration=None))
        d["calibration"] = self.calibration.to_dict() if self.calibration else None
        return d


def a100(nodes: int = 1, *, efficiency: float = A100_EFFICIENCY) -> Cluster:
    """DGX A100 80GB nodes (8 GPUs, NVLink3, 8x HDR InfiniBand): PTD-P's Selene."""
    return Cluster(
        name=f"a100x8x{nodes}",
        nodes=nodes,
        devices_per_node=8,
        peak_flops=312e12,
        memory_bytes=80e9,
        intra_bandwidth=300e9,
        intra_latency=5e-6,
        inter_bandwidth=25e9,
        inter_latency=10e-6,
        efficiency=efficiency,
        memory_reserve=0.1,
        hbm_bandwidth=2.039e12,
        elementwise_passes=ELEMENTWISE_PASSES,
    )


def h100(nodes: int = 1, *, efficiency: float = A100_EFFICIENCY) -> Cluster:
    """DGX H100 80GB nodes (8 GPUs, NVLink4, 8x NDR InfiniBand). The efficiency is the
    A100's unless given: H100 runs reach a lower share of a higher peak (Megatron's README
    reports 41-48% MFU on H100 against 52-56% on A100), so this preset is optimistic."""
    return Cluster(
        name=f"h100x8x{nodes}",
        nodes=nodes,
        devices_per_node=8,
        peak_flops=989e12,
        memory_bytes=80e9,
        intra_bandwidth=450e9,
        intra_latency=5e-6,
        inter_bandwidth=50e9,
        inter_latency=10e-6,
        efficiency=efficiency,
        memory_reserve=0.1,
        hbm_bandwidth=3.35e12,
        elementwise_passes=ELEMENTWISE_PASSES,
    )


def h200(nodes: int = 1, *, efficiency: float = A100_EFFICIENCY) -> Cluster:
    """HGX/DGX H200 nodes: the H100's compute (989 TFLOP/s dense BF16) and NVLink4, with
    141 GB of HBM3e (NVIDIA H200 Tensor Core GPU datasheet); 8x 400 Gb/s NDR InfiniBand."""
    return replace(
        h100(nodes, efficiency=efficiency),
        name=f"h200x8x{nodes}",
        memory_bytes=141e9,
        hbm_bandwidth=4.8e12,
    )


def b200(nodes: int = 1, *, efficiency: float = A100_EFFICIENCY) -> Cluster:
    """DGX B200 nodes (NVIDIA DGX B200 datasheet: 8 GPUs, 1,440 GB of HBM3e in all, 72
    PFLOP/s FP8 training with sparsity, so 2.25 PFLOP/s dense BF16 per GPU; NVLink5 at 1.8
    TB/s per GPU both ways; 8x 400 Gb/s ConnectX-7). The efficiency is the A100's unless
    given (no published MFU for it here): optimistic, as for the H100."""
    return Cluster(
        name=f"b200x8x{nodes}",
        nodes=nodes,
        devices_per_node=8,
        peak_flops=2250e12,
        memory_bytes=180e9,
        intra_bandwidth=900e9,
        intra_latency=5e-6,
        inter_bandwidth=50e9,
        inter_latency=10e-6,
        efficiency=efficiency,
        memory_reserve=0.1,
        hbm_bandwidth=8e12,
        elementwise_passes=ELEMENTWISE_PASSES,
    )


# --- this machine ---------------------------------------------------------------------------
@dataclass(frozen=True)
class LinkFit:
    """``t = steps * latency + bytes_per_rank / bandwidth``, fit to measured collectives."""

    latency: float
    bandwidth: float
    points: int
    source: str


def fit_alpha_beta(rows: Sequence[dict[str, Any]], *, source: str = "") -> LinkFit:
    """Least-squares ``(alpha, beta)`` from all-reduce rows of ``plait bench comm``
    (``world_size``, ``bytes``, ``time_us``): each row is ``2(n-1)`` steps and
    ``2(n-1)/n * bytes`` sent per rank. Negative fits are clamped (latency 0, or the
    bandwidth of the largest message alone)."""
    pts = []
    for r in rows:
        n, size, t = int(r["world_size"]), float(r["bytes"]), float(r["time_us"]) * 1e-6
        if n < 2 or t <= 0:
            continue
        pts.append((2.0 * (n - 1), 2.0 * (n - 1) / n * size, t))
    if len(pts) < 2:
        raise ValueError(
            f"fit_alpha_beta: need all-reduce timings at 2 or more sizes, got {len(pts)} "
            f"({source or 'rows'}); run `plait bench comm --collectives all_reduce`"
        )
    # normal equations of t = a x + c y (x = steps, y = bytes)
    sxx = sum(x * x for x, _, _ in pts)
    syy = sum(y * y for _, y, _ in pts)
    sxy = sum(x * y for x, y, _ in pts)
    sxt = sum(x * t for x, _, t in pts)
    syt = sum(y * t for _, y, t in pts)
    det = sxx * syy - sxy * sxy
    a = (sxt * syy - syt * sxy) / det if det else 0.0
    c = (sxx * syt - sxy * sxt) / det if det else 0.0
    if a < 0 or c <= 0:
        x, y, t = max(pts, key=lambda p: p[1])
        a, c = max(a, 0.0), t / y
    return LinkFit(latency=a, bandwidth=1.0 / c, points=len(pts), source=source)


def bench_rows(path: str | Path, *, algorithm: str = "ring") -> list[dict[str, Any]]:
    """The all-reduce rows of ``algorithm`` in a ``plait bench comm --json`` file (a list of
    rows) or in ``benchmarks/results/comm.json`` (rows per world size)."""
    data = json.loads(Path(path).read_text())
    rows: list[dict[str, Any]] = []
    if isinstance(data, dict) and "worlds" in data:
        for world in data["worlds"].values():
            rows.extend(world["rows"])
    elif isinstance(data, list):
        rows = data
    else:
        raise ValueError(f"{path}: not a `plait bench comm` result")
    return [r for r in rows if r["collective"] == "all_reduce" and r["algorithm"] == algorithm]


def matmul_flops(*, size: int = 384, repeats: int = 5) -> float:
    """FLOP/s of a float32 ``size x size`` matmul on this process's threads (median)."""

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    times.sort()
    return 2.0 * size**3 / times[len(times) // 2]


def default_bench_file() -> Path | None:
    """``runs/bench_comm_n4.json`` if ``plait bench comm`` wrote one, else the committed
    ``benchmarks/results/comm.json`` of this repository, else None."""
    committed = Path(__file__).parents[2] / "benchmarks/results/comm.json"
    for p in (Path("runs/bench_comm_n4.json"), committed):
        if p.exists():
            return p
    return None


def local_cpu(
    *,
    ranks: int = 4,
    bench_file: str | Path | None = None,
    flops_per_core: float | None = None,
    efficiency: float = 0.5,
    calibration: str | Path | Calibration | None = None,
) -> Cluster:
    """This machine as ``ranks`` devices on one node, sharing its cores.

    With a calibration (``calibration``, else ``runs/plan_calibration_n<ranks>.json`` if
    ``plait bench calibrate -n <ranks>`` wrote one; :mod:`plait.plan.measure.calibrate`): every
    collective the planner times comes from that file's measured line for its group size,
    on the transport the ranks use (shared memory by default); the alpha-beta link, used
    for what was not measured (2D/3D, older files without all-to-all), is its point-to-point
    fit; a rank's speed while all compute is the file's best matmul rate per rank.

    Without one: each rank gets ``cores / ranks`` of the cores' matmul speed
    (``flops_per_core``, timed here with one thread when not given) and both links are the
    alpha-beta fit of the ring all-reduce rows of ``bench_file`` (default
    :func:`default_bench_file`; gloo on loopback, slower than the shared memory ranks use).

    ``flops_per_core``, when given, sets the speed either way. ``efficiency`` is the share
    of that speed a small GPT's step reaches on CPU (its elementwise work is not free).
    Ranks share the cores (``shared_cores``): a rank idle in a pipeline bubble lends its
    share to the others (:attr:`Cluster.alone_speedup`)."""

    cores = os.cpu_count() or 1
    cal: Calibration | None
    if isinstance(calibration, calibrate.Calibration):
        cal = calibration
    else:
        path = Path(calibration) if calibration is not None else calibrate.default_path(ranks)
        cal = calibrate.load(path) if (calibration is not None or path.exists()) else None
    if cal is not None and cal.ranks != ranks:
        raise ValueError(
            f"local_cpu(ranks={ranks}): the calibration was measured on {cal.ranks} ranks; "
            f"run `plait bench calibrate -n {ranks}`"
        )
    share = min(1.0, cores / ranks)
    if flops_per_core is not None:
        peak = flops_per_core * share
    elif cal is not None and cal.gemm:
        peak = max(r for *_, r in cal.gemm)
    else:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            peak = matmul_flops() * share
        finally:
            torch.set_num_threads(threads)
    p2p = cal.line("p2p", 2) if cal is not None else None
    if p2p is not None:
        latency, bandwidth = p2p.latency, p2p.bandwidth
    else:
        bench = Path(bench_file) if bench_file is not None else default_bench_file()
        if bench is None:
            latency, bandwidth = 500e-6, 1e9
        else:
            fit = fit_alpha_beta(bench_rows(bench), source=str(bench))
            latency, bandwidth = fit.latency, fit.bandwidth
    try:
        ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        ram = 8e9
    return Cluster(
        name=f"cpu{cores}x{ranks}",
        nodes=1,
        devices_per_node=ranks,
        peak_flops=peak,
        memory_bytes=float(ram) / ranks,
        intra_bandwidth=bandwidth,
        intra_latency=latency,
        inter_bandwidth=bandwidth,
        inter_latency=latency,
        efficiency=efficiency,
        shared_cores=float(cores),
        calibration=cal,
    )


def with_compute(base: Cluster, flops: float, seconds: float, blocks: int) -> Cluster:
    """``base`` whose rank runs ``blocks`` GPT blocks (the embedding and head one more)
    of ``flops`` in ``seconds`` with every rank busy: the calibration's dispatch cost per
    block taken out, the efficiency against its matmul rate, or, if the step ran faster
    than that rate (the matmuls were timed in a busier moment), that speed as the peak."""
    cal = base.calibration
    overhead = blocks * cal.block_overhead if cal is not None else 0.0
    rate = flops / max(seconds - overhead, 0.25 * seconds)
    if rate <= base.peak_flops:
        return replace(base, efficiency=rate / base.peak_flops)
    return replace(base, peak_flops=rate, efficiency=1.0)


PRESETS = ("a100", "h100", "h200", "b200", "cpu")


def preset(name: str, *, nodes: int = 1, ranks: int = 4) -> Cluster:
    """``"a100"`` / ``"h100"`` / ``"h200"`` / ``"b200"`` with ``nodes`` nodes, or ``"cpu"``
    with ``ranks`` ranks."""
    if name == "a100":
        return a100(nodes)
    if name == "h100":
        return h100(nodes)
    if name == "h200":
        return h200(nodes)
    if name == "b200":
        return b200(nodes)
    if name == "cpu":
        return local_cpu(ranks=ranks)
    raise ValueError(f"unknown cluster preset {name!r}; use one of {list(PRESETS)}")


__all__ = [
    "A100_EFFICIENCY",
    "ELEMENTWISE_PASSES",
    "PRESETS",
    "Cluster",
    "LinkFit",
    "a100",
    "b200",
    "bench_rows",
    "fit_alpha_beta",
    "h100",
    "h200",
    "local_cpu",
    "matmul_flops",
    "preset",
    "with_compute",
]
