"""What a checkpoint costs: save and load time, async save's blocking time, memory across
repeated async saves (fault row 19: "memory flat over 20 saves"), and the bytes each rank
reads when loading at another world size.

    .venv/bin/python benchmarks/checkpoint.py                   # a few minutes
    .venv/bin/python benchmarks/checkpoint.py --params 2e6 --saves 5 --out /tmp/ck
    .venv/bin/python benchmarks/checkpoint.py --only reads      # the bytes-read table only

Two ranks (``plait.RankPool``) train a stack of Linear layers with Adam under DDP and
ZeRO-1, then, per strategy: a synchronous ``checkpoint.save`` (median of ``--reps``), a
``checkpoint.load`` into a fresh model, and ``--saves`` asynchronous saves, each followed
by one training step before ``wait()``, recording the time the call blocked and the rank's
resident memory (``/proc/self/statm``) after each. Times are rank 0's. The checkpoint holds
parameters and Adam's two moments, 12 bytes per parameter, plus 4 for Adam's step.

Bytes read: four ranks save the same model under DDP, ZeRO-1 and FSDP (a unit per Linear),
once of width 512 (``--params``; 1 MiB per weight, checksummed in 16 KiB blocks) and once
of width 2048 (``--reads-params``; 16 MiB per weight, 256 KiB blocks);
W' = 2 and 4 ranks load it under the same strategy, once reading whole files
(``whole_files=True``: what every load did before per-block checksums) and once by ranges
(the default), ``--reps`` times each. Per rank: bytes read (manifest, headers and data;
``Restored.bytes_read``, the largest over the ranks) and the load time (median; rank 0's).

Writes ``<out>/checkpoint.json`` and ``<out>/checkpoint.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import plait  # noqa: E402
from plait import checkpoint  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _model(params: int, width: int = 512) -> nn.Module:
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, width: int = 512) -> None:
    optimizer.zero_grad()
    model(torch.randn(8, width)).square().mean().backward()
    optimizer.step()


def measure(strategy: str, params: int, reps: int, saves: int, root: str) -> dict[str, Any]:
    raw = _model(params)
    model, optimizer = plait.prepare(
        raw, torch.optim.Adam(raw.parameters(), lr=1e-3), strategy=strategy
    )
    _step(model, optimizer)
    save_s = []
    for i in range(reps):
        plait.comm.barrier()
        t0 = time.perf_counter()
        checkpoint.save(root, step=i, model=model, optimizer=optimizer, keep_last=2)
        save_s.append(time.perf_counter() - t0)
    fresh_raw = _model(params)
    fresh, fresh_opt = plait.prepare(
        fresh_raw, torch.optim.Adam(fresh_raw.parameters(), lr=1e-3), strategy=strategy
    )
    plait.comm.barrier()
    t0 = time.perf_counter()
    checkpoint.load(root, model=fresh, optimizer=fresh_opt)
    load_s = time.perf_counter() - t0
    blocked, rss = [], []
    for i in range(saves):
        plait.comm.barrier()
        t0 = time.perf_counter()
        handle = checkpoint.save(
            root, step=reps + i, model=model, optimizer=optimizer, keep_last=2, async_=True
        )
        blocked.append(time.perf_counter() - t0)
        _step(model, optimizer)
        handle.wait()
        rss.append(round(_rss_mb(), 1))
    nbytes = sum(p.numel() for p in raw.parameters()) * 12
    return {
        "strategy": strategy,
        "params": sum(p.numel() for p in raw.parameters()),
        "checkpoint_mb": round(nbytes / 2**20, 1),
        "save_s": round(statistics.median(save_s), 3),
        "load_s": round(load_s, 3),
        "async_blocked_s": round(statistics.median(blocked), 3),
        "rss_mb_after_each_async_save": rss,
    }


def save_for_reads(strategy: str, params: int, width: int, root: str) -> None:
    model, optimizer = _prepared(strategy, params, width)
    _step(model, optimizer, width)
    checkpoint.save(root, step=1, model=model, optimizer=optimizer)


def _prepared(strategy: str, params: int, width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    raw = _model(params, width)
    optimizer = torch.optim.Adam(raw.parameters(), lr=1e-3)
    if strategy == "fsdp":
        return plait.prepare(raw, optimizer, strategy="fsdp", wrap={nn.Linear})
    return plait.prepare(raw, optimizer, strategy=strategy)


def load_reads(strategy: str, params: int, width: int, root: str, reps: int) -> dict[str, Any]:
    """This rank's bytes read and load times, whole files vs ranges."""
    model, optimizer = _prepared(strategy, params, width)
    out: dict[str, Any] = {}
    for whole in (True, False):
        times = []
        for _ in range(reps):
            plait.comm.barrier()
            t0 = time.perf_counter()
            restored = checkpoint.load(root, model=model, optimizer=optimizer, whole_files=whole)
            times.append(time.perf_counter() - t0)
        label = "whole" if whole else "ranges"
        out[f"{label}_bytes"] = restored.bytes_read
        out[f"{label}_s"] = statistics.median(times)
        out["checkpoint_bytes"] = restored.checkpoint_bytes
    return out


def measure_reads(params: int, width: int, reps: int) -> list[dict[str, Any]]:
    rows = []
    roots = {s: tempfile.mkdtemp(prefix="plait-ck-reads-") for s in ("ddp", "zero1", "fsdp")}
    try:
        with plait.RankPool(4, timeout=600) as pool:
            for strategy, root in roots.items():
                pool.run(save_for_reads, strategy, params, width, root, timeout=1800)
        for world in (2, 4):
            with plait.RankPool(world, timeout=600) as pool:
                for strategy, root in roots.items():
                    per_rank = pool.run(
                        load_reads, strategy, params, width, root, reps, timeout=1800
                    )
                    size = per_rank[0]["checkpoint_bytes"]
                    whole = max(r["whole_bytes"] for r in per_rank)
                    ranges = max(r["ranges_bytes"] for r in per_rank)
                    rows.append(
                        {
                            "strategy": strategy,
                            "width": width,
                            "saved_world": 4,
                            "world": world,
                            "checkpoint_mb": round(size / 2**20, 2),
                            "whole_mb_per_rank": round(whole / 2**20, 2),
                            "ranges_mb_per_rank": round(ranges / 2**20, 2),
                            "ranges_fraction": round(ranges / size, 3),
                            "whole_s": round(per_rank[0]["whole_s"], 3),
                            "ranges_s": round(per_rank[0]["ranges_s"], 3),
                        }
                    )
    finally:
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)
    return rows


def _reads_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| strategy | Linear width | saved at | loaded at | checkpoint MB | read per rank "
        "before (whole files) MB | read per rank now (ranges) MB | fraction | load s before | "
        "load s now |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['strategy']} | {r['width']} | {r['saved_world']} | {r['world']} | "
            f"{r['checkpoint_mb']} | "
            f"{r['whole_mb_per_rank']} | {r['ranges_mb_per_rank']} | {r['ranges_fraction']} | "
            f"{r['whole_s']} | {r['ranges_s']} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=4e6)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--saves", type=int, default=20)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--only", choices=("save", "reads"), default=None)
    parser.add_argument("--reads-params", type=float, default=8.4e6, help="width-2048 model")
    args = parser.parse_args()
    rows = []
    reads = []
    if args.only != "save":
        for width, params in ((512, args.params), (2048, args.reads_params)):
            reads += measure_reads(int(params), width, args.reps)
    with plait.RankPool(2, timeout=600) as pool:
        for strategy in ("ddp", "zero1") if args.only != "reads" else ():
            root = tempfile.mkdtemp(prefix="plait-ck-bench-")
            try:
                rows.append(
                    pool.run(
                        measure,
                        strategy,
                        int(args.params),
                        args.reps,
                        args.saves,
                        root,
                        timeout=1800,
                    )[0]
                )
            finally:
                shutil.rmtree(root, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "checkpoint.json").write_text(json.dumps({"save": rows, "reads": reads}, indent=1))
    lines = [
        "| strategy | params | checkpoint MB | save s | load s | async call blocks s | "
        "RSS MB after async saves (first, last, max) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        rss = r["rss_mb_after_each_async_save"]
        lines.append(
            f"| {r['strategy']} | {r['params']} | {r['checkpoint_mb']} | {r['save_s']} | "
            f"{r['load_s']} | {r['async_blocked_s']} | {rss[0]}, {rss[-1]}, {max(rss)} |"
        )
    lines += ["", *_reads_table(reads)]
    (args.out / "checkpoint.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
