"""Context parallelism: ring attention and Ulysses against one process's attention, step
time and peak memory per rank, and the causal work per rank with and without the load
balancer.

    PYTHONPATH=. .venv/bin/python benchmarks/context.py                 # seq 1k, 4k; cp 1, 2, 4
    PYTHONPATH=. .venv/bin/python benchmarks/context.py --seqs 1024 --cps 1 2

PyTorch's ``torch.distributed.tensor.experimental.context_parallel`` does not run on CPU in
torch 2.13: its SDPA dispatcher has sharding rules for the CUDA kernels (flash, efficient,
cuDNN) only, and the CPU kernel fails inside it with "Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered" (then "cannot resize variables that require grad" while restoring the
buffers). So the anchor here is one process's ``scaled_dot_product_attention`` on the whole
sequence (the fused CPU flash kernel), at cp 1.

One attention layer (no projections), causal, load-balanced layout, batch 1, ``--heads``
heads of ``--head-dim``, float32, local ranks (``plait.RankPool``) with one intra-op thread
each (so cp 4 shares this machine's cores). A step is forward + backward of
``(out * g).sum()`` after a barrier, its time the slowest rank's; medians of ``--steps``
after one warm-up. Peak memory: one more step under
``torch.distributed._tools.mem_tracker.MemTracker`` (every tensor the step allocates on
this rank, inputs and their gradients included; on the shared-memory transport also its
staging buffers, about 9 MiB at seq 1024: ``PLAIT_TRANSPORT=gloo`` leaves them out), the
largest rank's. Writes ``<out>/<name>.json`` and ``<out>/<name>.md``. Step times on a shared
2-core machine vary by 2-4x between runs; the memory is stable.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

import plait
from plait import comm
from plait.strategies.context import (
    imbalance,
    ring_attention,
    ring_work,
    shard_sequence,
    ulysses_attention,
)


def _inputs(seq: int, heads: int, dim: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, heads, seq, dim, generator=g) for _ in range(4)]


def _step(kind: str, tensors: list[torch.Tensor], group: Any) -> None:
    q, k, v, g = tensors
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    if kind == "sdpa":
        out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    else:
        fn = ring_attention if kind == "ring" else ulysses_attention
        out = fn(*leaves, group=group, causal=True, balanced=True)
    (out * g).sum().backward()


def _saved_bytes(kind: str, tensors: list[torch.Tensor], group: Any) -> int:
    """Bytes autograd keeps for the backward of one step's attention (each storage once):
    what a model keeps per attention layer, whatever the transient buffers of the step."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    q, k, v, _ = tensors
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if kind == "sdpa":
            out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        else:
            fn = ring_attention if kind == "ring" else ulysses_attention
            out = fn(*leaves, group=group, causal=True, balanced=True)
    del out
    return sum(storages.values())


def _slowest(seconds: float, group: Any) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    comm.all_reduce(t, "max", group=group)
    return float(t)


def measure(seqs: list[int], steps: int, heads: int, dim: int) -> list[dict[str, Any]]:
    """On every rank of a cp group of the world's size: each kernel at each length."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.set_num_threads(1)
    mesh = plait.Mesh(cp=plait.world().size)
    group = mesh.group("cp")
    kinds = ["sdpa", "ring", "ulysses"] if group.size == 1 else ["ring", "ulysses"]
    rows = []
    for seq in seqs:
        full = _inputs(seq, heads, dim)
        local = [shard_sequence(t, mesh, dim=2)[0].contiguous() for t in full]
        for kind in kinds:
            tensors = full if kind == "sdpa" else local
            _step(kind, tensors, group)  # warm-up
            times = []
            for _ in range(steps):
                comm.barrier(group=group)
                t0 = time.perf_counter()
                _step(kind, tensors, group)
                times.append(_slowest(time.perf_counter() - t0, group))
            tracker = MemTracker()
            with tracker:
                _step(kind, tensors, group)
            peak = torch.tensor(
                [float(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])]
            )
            comm.all_reduce(peak, "max", group=group)
            saved = torch.tensor([float(_saved_bytes(kind, tensors, group))])
            comm.all_reduce(saved, "max", group=group)
            rows.append(
                {
                    "cp": group.size,
                    "seq": seq,
                    "kernel": "one process (SDPA)" if kind == "sdpa" else kind,
                    "step_ms": statistics.median(times) * 1e3,
                    "peak_mib": float(peak) / 2**20,
                    "saved_mib": float(saved) / 2**20,
                }
            )
    return rows


def _table(rows: list[dict[str, Any]], base: dict[int, float], saved: dict[int, float]) -> str:
    lines = [
        "| seq | cp | kernel | step (ms) | peak memory per rank (MiB) | peak / (cp 1 SDPA / cp) "
        "| saved for backward (MiB) | saved / (cp 1 SDPA / cp) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["seq"], r["cp"], r["kernel"])):
        ratio = r["peak_mib"] / (base[r["seq"]] / r["cp"])
        kept = r["saved_mib"] / (saved[r["seq"]] / r["cp"])
        lines.append(
            f"| {r['seq']} | {r['cp']} | {r['kernel']} | {r['step_ms']:.1f} | "
            f"{r['peak_mib']:.1f} | {ratio:.2f} | {r['saved_mib']:.2f} | {kept:.2f} |"
        )
    return "\n".join(lines)


def _work(cps: list[int]) -> str:
    lines = [
        "| cp | layout | chunk pairs per rank | max / mean | ring critical path / mean |",
        "|---|---|---|---|---|",
    ]
    for cp in cps:
        for balanced in (True, False):
            work = ring_work(cp, causal=True, balanced=balanced)
            stats = imbalance(work)
            lines.append(
                f"| {cp} | {'balanced' if balanced else 'contiguous'} | "
                f"{[sum(r) for r in work]} | {stats['max_over_mean']:.2f} | "
                f"{stats['critical_over_mean']:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="context", help="files <out>/<name>.json and .md")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for cp in args.cps:
        with plait.RankPool(cp, timeout=1800) as pool:
            rows += pool.run(
                measure, args.seqs, args.steps, args.heads, args.head_dim, timeout=1800
            )[0]
        print(f"cp {cp} done", flush=True)
    base = {r["seq"]: r["peak_mib"] for r in rows if r["cp"] == 1 and r["kernel"].startswith("one")}
    saved = {
        r["seq"]: r["saved_mib"] for r in rows if r["cp"] == 1 and r["kernel"].startswith("one")
    }
    if not base:
        base = {r["seq"]: r["peak_mib"] for r in rows if r["cp"] == min(args.cps)}
        saved = {r["seq"]: r["saved_mib"] for r in rows if r["cp"] == min(args.cps)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    text = (
        f"# Context parallelism: one causal attention layer, heads {args.heads} x "
        f"{args.head_dim}, batch 1, float32, forward + backward; transport "
        f"{os.environ.get('PLAIT_TRANSPORT', 'auto')}\n\n"
        + _table(rows, base, saved)
        + "\n\nCausal work per rank (chunk pairs of 2cp chunks, `ring_work`):\n\n"
        + _work(sorted(set(args.cps) | {8}))
        + "\n"
    )
    (out / f"{args.name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
