"""What healing costs: the step when nothing fails, and the seconds from a fault to
training again.

    .venv/bin/python benchmarks/heal.py            # 4 ranks, 30 steps, 3 faults
    .venv/bin/python benchmarks/heal.py --quick    # 10 steps, 1 fault
    .venv/bin/python benchmarks/heal.py --zero 1   # HealingTrainer(zero=1) against
                                                   # prepare(strategy="zero1"); heal-zero1.*
    .venv/bin/python benchmarks/heal.py --bucket-mb 2   # the healing exchange in buckets
                                                   # of 2 MiB (DDP keeps 25); heal-bucket2.*

Four local ranks (forkserver processes, one intra-op thread each), the job's store in
this process. Model: an MLP 784-1024-1024-10 (1.9M parameters, float32), Adam, global
batch 256 in micro-batches of 64 (one per rank: ``M = W = 4``).

1. **Step when nothing fails**, side by side in the same four processes, taking turns
   step by step: ``heal``: :class:`plait.heal.HealingTrainer` (tree-ordered block
   exchange, the leader's store read for replacements, two extra elements);
   ``repro ddp``: ``plait.prepare(strategy="ddp", reproducible=True)`` on the same
   micro-batches (the tree-ordered all-reduce without healing, overlapped with backward);
   the step time is the slowest rank's, medians. Also the leader's per-step store read
   alone (``pending_joins``), the only work healing adds to a step when nobody asks.
2. **Fault to training again**: rank 2 SIGKILLs itself in step 3 (after its first
   micro-batch); the seconds from the kill (the wall time it wrote just before) to the
   moment the last survivor has agreed on the new membership, built its group and starts
   redoing the step (``ended`` in its healing record). Medians over the runs.

Writes ``benchmarks/results/heal.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from plait.demo.heal import HealConfig, run  # noqa: E402
from plait.heal.launch import Ranks, start_store  # noqa: E402

WORLD, BATCH, M = 4, 256, 64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 784, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def rank_main(
    *,
    slot: int,
    world: int,
    address: str,
    join: bool,
    steps: int,
    out: str,
    zero: int = 0,
    bucket_mb: float = 25.0,
) -> None:
    import plait
    from plait.comm import ops as comm_ops
    from plait.heal import HealingTrainer

    torch.set_num_threads(1)
    model = _model()
    trainer = HealingTrainer(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-3),
        loss_fn=nn.functional.cross_entropy,
        microbatch_size=M,
        world=world,
        address=address,
        slot=slot,
        zero=zero,
        bucket_mb=bucket_mb,
    )
    host, port = address.rsplit(":", 1)
    os.environ.update(RANK=str(slot), WORLD_SIZE=str(world), MASTER_ADDR=host, MASTER_PORT=port)
    import torch.distributed as dist

    plait.init(backend="gloo", store=dist.PrefixStore("bench-ddp", trainer.store))
    ddp_model = _model()
    runner, ddp_opt = plait.prepare(
        ddp_model,
        torch.optim.Adam(ddp_model.parameters(), lr=1e-3),
        strategy=f"zero{zero}" if zero else "ddp",
        reproducible=True,
        microbatch_size=M,
        loss_fn=nn.functional.cross_entropy,
    )
    times: dict[str, list[float]] = {"heal": [], "repro ddp": []}
    world_group = plait.world()
    for step in range(steps + 3):
        x, y = _batch(step)
        order = ("heal", "repro ddp") if step % 2 else ("repro ddp", "heal")
        for name in order:
            comm_ops.barrier(group=world_group)
            t0 = time.perf_counter()
            if name == "heal":
                trainer.step(x, y)
            else:
                runner.step(runner.block(x), runner.block(y))
                ddp_opt.step()
            if step >= 3:
                times[name].append(time.perf_counter() - t0)
    store_read = []
    if slot == 0:
        for _ in range(200):
            t0 = time.perf_counter()
            trainer.membership.pending_joins(trainer.members)
            store_read.append(time.perf_counter() - t0)
    Path(out, f"rank{slot}.json").write_text(json.dumps({"times": times, "store_read": store_read}))
    plait.shutdown()
    trainer.close()


def steady(steps: int, zero: int, bucket_mb: float = 25.0) -> dict[str, Any]:
    out = tempfile.mkdtemp(prefix="plait-bench-heal-")
    store, address = start_store()
    with Ranks(preload=("plait",)) as ranks:
        for s in range(WORLD):
            ranks.spawn(
                rank_main,
                slot=s,
                world=WORLD,
                address=address,
                join=False,
                steps=steps,
                out=out,
                zero=zero,
                bucket_mb=bucket_mb,
            )
        codes = ranks.wait(600)
    if any(c != [0] for c in codes.values()):
        raise RuntimeError(f"benchmark ranks failed: exit codes {codes}")
    per_rank = [json.loads(Path(out, f"rank{s}.json").read_text()) for s in range(WORLD)]
    result: dict[str, Any] = {}
    for name in ("heal", "repro ddp"):
        slowest = [max(r["times"][name][i] for r in per_rank) for i in range(steps)]
        result[name] = statistics.median(slowest)
    result["store_read"] = statistics.median(per_rank[0]["store_read"])
    del store
    return result


def fault_seconds(runs: int, zero: int) -> list[dict[str, float]]:
    found = []
    for _ in range(runs):
        out = tempfile.mkdtemp(prefix="plait-bench-heal-fault-")
        c = HealConfig(
            world=WORLD,
            steps=6,
            batch=32,
            microbatch=4,
            faults=[[2, 3, 5, "kill"]],
            rejoin=False,
            zero=zero,
        )
        report = run(c, out, deadline=120)
        struck = float(Path(out, "fault-2-3.txt").read_text())
        ended = max(h["ended"] for r in report.records for h in r["heals"])
        agreed = max(h["seconds"] for r in report.records for h in r["heals"])
        found.append({"fault_to_training": ended - struck, "heal_seconds": agreed})
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--zero", type=int, default=0, choices=[0, 1, 2])
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    args = parser.parse_args()
    steps, runs = (10, 1) if args.quick else (30, 3)
    load_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    s = steady(steps, args.zero, args.bucket_mb)
    f = fault_seconds(runs, args.zero)
    load_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    fault = statistics.median(x["fault_to_training"] for x in f)
    result = {
        "steady": s,
        "faults": f,
        "fault_to_training_median_s": fault,
        "load_before": load_before,
        "load_after": load_after,
        "steps": steps,
    }
    results = Path(__file__).resolve().parent / "results"
    name = f"heal-zero{args.zero}" if args.zero else "heal"
    if args.bucket_mb != 25.0:
        name += f"-bucket{args.bucket_mb:g}"
    baseline = f"zero{args.zero}" if args.zero else "ddp"
    (results / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    ratio = s["heal"] / s["repro ddp"]
    md = [
        "# Healing: the step when nothing fails, and seconds from a fault to training again",
        "",
        f"Command: `.venv/bin/python benchmarks/heal.py{' --quick' if args.quick else ''}"
        f"{f' --zero {args.zero}' if args.zero else ''}"
        f"{f' --bucket-mb {args.bucket_mb:g}' if args.bucket_mb != 25.0 else ''}`; "
        f"4 local ranks, transport `{os.environ.get('PLAIT_TRANSPORT') or 'auto'}` (both "
        f"sides; `auto`: shared memory on one host); load before: `{load_before}`.",
        "",
        "| 4 ranks, MLP 1.9M params, batch 256, m 64 | median |",
        "|---|---|",
        f'| step, `prepare(strategy="{baseline}", reproducible=True)` | '
        f"{1e3 * s['repro ddp']:.1f} ms |",
        f"| step, `HealingTrainer({f'zero={args.zero}, ' if args.zero else ''}"
        f"bucket_mb={args.bucket_mb:g})` | "
        f"{1e3 * s['heal']:.1f} ms ({ratio:.2f}x) |",
        f"| of which the leader's store read for replacements | {1e6 * s['store_read']:.0f} us "
        f"({100 * s['store_read'] / s['heal']:.2f}% of the step) |",
        f"| SIGKILL of rank 2 to training again at 3 ranks ({runs} runs) | {fault:.2f} s |",
        "",
        f"Load after: `{load_after}`",
    ]
    (results / f"{name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
