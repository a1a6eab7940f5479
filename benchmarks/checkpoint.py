"""What a checkpoint costs: save and load time, async save's blocking time, and memory
across repeated async saves (fault row 19: "memory flat over 20 saves").

    .venv/bin/python benchmarks/checkpoint.py                   # about a minute
    .venv/bin/python benchmarks/checkpoint.py --params 2e6 --saves 5 --out /tmp/ck

Two ranks (``plait.RankPool``) train a stack of Linear layers with Adam under DDP and
ZeRO-1, then, per strategy: a synchronous ``checkpoint.save`` (median of ``--reps``), a
``checkpoint.load`` into a fresh model, and ``--saves`` asynchronous saves, each followed
by one training step before ``wait()``, recording the time the call blocked and the rank's
resident memory (``/proc/self/statm``) after each. Times are rank 0's. The checkpoint holds
parameters and Adam's two moments, 12 bytes per parameter, plus 4 for Adam's step.
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


def _model(params: int) -> nn.Module:
    width = 512
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(8, 512)).square().mean().backward()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=4e6)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--saves", type=int, default=20)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    rows = []
    with plait.RankPool(2, timeout=600) as pool:
        for strategy in ("ddp", "zero1"):
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
    (args.out / "checkpoint.json").write_text(json.dumps(rows, indent=1))
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
    (args.out / "checkpoint.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
