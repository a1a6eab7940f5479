"""What the transport itself costs: raw ``torch.distributed`` send/recv between two local
ranks, with nothing of plait's in the path. Every plait collective is built on these
messages, so their time is the floor for any algorithm's time.

    .venv/bin/python benchmarks/transport.py                  # about 20 s
    .venv/bin/python benchmarks/transport.py --out /tmp/t     # elsewhere
    .venv/bin/python benchmarks/transport.py --shm            # and plait's shared memory

Two ranks (``plait.RankPool``), gloo on loopback, one intra-op thread each. For each
message size, after a barrier:

- ``exchange``: both ranks ``isend`` to and ``irecv`` from each other at once and wait for
  both (one step of a ring with two ranks: what an all-gather or reduce-scatter of two
  ranks costs);
- ``ping-pong``: rank 0 sends, rank 1 sends the message back (two one-way trips).

The time is rank 0's, median over ``--reps`` repetitions after 3 warm-up ones. Bandwidth
= bytes one rank receives / time. Writes ``<out>/transport.json`` and
``<out>/transport.md``; ``--out`` defaults to ``benchmarks/results``.

``--shm``: the same two measurements side by side, in one run on ranks whose world group
has plait's shared-memory link (``PLAIT_TRANSPORT=shm``): raw gloo as above, and plait's
``Channel`` on shared memory (``plait.comm.send/recv``, and ``isend``/``irecv`` of one
channel for the exchange). Writes ``<out>/comm_transport_shm.json`` and ``comm_transport_shm.md``.
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


def _shm_exchange(ch: Any, out: torch.Tensor, back: torch.Tensor, peer: int) -> None:
    r = ch.irecv(back, peer)
    s = ch.isend(out, peer)
    ch.wait(r, s)


def _shm_ping_pong(out: torch.Tensor, back: torch.Tensor, rank: int, peer: int) -> None:
    from plait import comm

    if rank == 0:
        comm.send(out, peer)
        comm.recv(back, peer)
    else:
        comm.recv(back, peer)
        comm.send(back, peer)


def measure_shm(sizes: list[int], reps: int) -> list[dict[str, float]]:
    """Runs on both ranks: raw gloo and plait's shared-memory channel, size by size."""
    from plait import comm
    from plait.comm.group import Call, Channel

    torch.set_num_threads(1)
    g = comm.world()
    assert g.shm is not None, "no shared-memory link: run with PLAIT_TRANSPORT=shm"
    rank = dist.get_rank()
    peer = 1 - rank
    ch = Channel(Call(g, "bench", "p2p", seq=0))
    rows = []
    for nbytes in sizes:
        out = torch.zeros(nbytes // 4)
        back = torch.zeros(nbytes // 4)
        rows.append(
            {
                "bytes": nbytes,
                "gloo_exchange_ms": _median_ms(partial(_exchange, out, back, peer), reps),
                "shm_exchange_ms": _median_ms(partial(_shm_exchange, ch, out, back, peer), reps),
                "gloo_ping_pong_ms": _median_ms(partial(_ping_pong, out, back, rank, peer), reps),
                "shm_ping_pong_ms": _median_ms(
                    partial(_shm_ping_pong, out, back, rank, peer), reps
                ),
            }
        )
    return rows


def markdown_shm(rows: list[dict[str, float]], reps: int) -> str:
    lines = [
        "| message | exchange ms gloo | exchange ms shm | GB/s per direction gloo | shm "
        "| ping-pong ms gloo | ping-pong ms shm |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        size = int(r["bytes"])
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        g_bw = size / (r["gloo_exchange_ms"] / 1e3) / 1e9
        s_bw = size / (r["shm_exchange_ms"] / 1e3) / 1e9
        lines.append(
            f"| {label} | {r['gloo_exchange_ms']:.3f} | {r['shm_exchange_ms']:.3f} | "
            f"{g_bw:.2f} | {s_bw:.2f} | {r['gloo_ping_pong_ms']:.3f} | "
            f"{r['shm_ping_pong_ms']:.3f} |"
        )
    lines.append(
        f"\nHow it was measured: `.venv/bin/python benchmarks/transport.py --shm`. Two local "
        f"ranks in one run, torch {torch.__version__}: raw torch.distributed (gloo) isend/"
        f"irecv, and plait's channel on its shared-memory link; rank 0's median over {reps} "
        f"repetitions after {WARMUP} warm-up ones, each after a barrier."
    )
    return "\n".join(lines) + "\n"


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
    parser.add_argument("--shm", action="store_true", help="gloo vs plait's shared memory")
    args = parser.parse_args()
    if args.shm:
        with plait.RankPool(2, env={"PLAIT_TRANSPORT": "shm"}) as pool:
            rows = pool.run(measure_shm, list(SIZES), args.reps)[0]
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "comm_transport_shm.json").write_text(
            json.dumps({"torch": torch.__version__, "reps": args.reps, "rows": rows}, indent=1)
        )
        md = markdown_shm(rows, args.reps)
        (args.out / "comm_transport_shm.md").write_text(md)
        print(md)
        return
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
