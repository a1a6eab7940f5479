"""What the transport itself costs: raw ``torch.distributed`` send/recv between two local
ranks, with nothing of plait's in the path. Every plait collective is built on these
messages, so their time is the floor for any algorithm's time.

    .venv/bin/python benchmarks/transport.py                  # about 20 s
    .venv/bin/python benchmarks/transport.py --out /tmp/t     # elsewhere

Two ranks (``plait.RankPool``), gloo on loopback, one intra-op thread each. For each
message size, after a barrier:

- ``exchange``: both ranks ``isend`` to and ``irecv`` from each other at once and wait for
  both (one step of a ring with two ranks: what an all-gather or reduce-scatter of two
  ranks costs);
- ``ping-pong``: rank 0 sends, rank 1 sends the message back (two one-way trips).

The time is rank 0's, median over ``--reps`` repetitions after 3 warm-up ones. Bandwidth
= bytes one rank receives / time. Writes ``<out>/transport.json`` and
``<out>/transport.md``; ``--out`` defaults to ``benchmarks/results``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import plait  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"
SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)
WARMUP = 3


def _median_ms(fn: Any, reps: int) -> float:
    times = []
    for _ in range(WARMUP + reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[WARMUP:]) * 1e3


def _exchange(out: torch.Tensor, back: torch.Tensor, peer: int) -> None:
    sent = dist.isend(out, peer)
    got = dist.irecv(back, peer)
    assert sent is not None and got is not None  # None only for ranks outside the group
    sent.wait()
    got.wait()


def _ping_pong(out: torch.Tensor, back: torch.Tensor, rank: int, peer: int) -> None:
    if rank == 0:
        dist.send(out, peer)
        dist.recv(back, peer)
    else:
        dist.recv(back, peer)
        dist.send(back, peer)


def measure(sizes: list[int], reps: int) -> list[dict[str, float]]:
    """Runs on both ranks; rank 0's medians per message size."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    peer = 1 - rank
    rows = []
    for nbytes in sizes:
        out = torch.zeros(nbytes // 4)
        back = torch.zeros(nbytes // 4)
        rows.append(
            {
                "bytes": nbytes,
                "exchange_ms": _median_ms(partial(_exchange, out, back, peer), reps),
                "ping_pong_ms": _median_ms(partial(_ping_pong, out, back, rank, peer), reps),
            }
        )
    return rows


def markdown(rows: list[dict[str, float]], reps: int) -> str:
    lines = [
        "| message | exchange ms | exchange GB/s per direction | ping-pong ms |",
        "|---|---|---|---|",
    ]
    for r in rows:
        size = int(r["bytes"])
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        gbps = size / (r["exchange_ms"] / 1e3) / 1e9
        lines.append(f"| {label} | {r['exchange_ms']:.3f} | {gbps:.2f} | {r['ping_pong_ms']:.3f} |")
    lines.append(
        f"\nHow it was measured: `.venv/bin/python benchmarks/transport.py`. Two local ranks, "
        f"gloo on loopback, torch {torch.__version__}; raw torch.distributed isend/irecv, "
        f"rank 0's median over {reps} repetitions after {WARMUP} warm-up ones, each after a "
        f"barrier. Raw numbers: `transport.json`."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    with plait.RankPool(2) as pool:
        rows = pool.run(measure, list(SIZES), args.reps)[0]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "transport.json").write_text(
        json.dumps({"torch": torch.__version__, "reps": args.reps, "rows": rows}, indent=1)
    )
    md = markdown(rows, args.reps)
    (args.out / "transport.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
