"""What healing FSDP holds and sends: bytes per member at rest, bytes sent per step, and the
step, against healing ZeRO-1 and plait's own FSDP and ZeRO-1 without healing.

    .venv/bin/python benchmarks/heal_fsdp.py            # 4 ranks, 12 steps each way
    .venv/bin/python benchmarks/heal_fsdp.py --quick    # 4 steps

Four local ranks (forkserver processes, one intra-op thread each), the job's store in this
process. Model: an MLP 784-1024-1024-10 (1.9M parameters, float32), Adam, global batch 256
in micro-batches of 64 (``M = W = 4``). Two jobs, each side by side in the same four
processes, steps taking turns:

- ``HealingTrainer(zero=3)`` against ``plait.prepare(strategy="fsdp", reproducible=True)``;
- ``HealingTrainer(zero=1)`` against ``plait.prepare(strategy="zero1", reproducible=True)``.

**At rest** (after a step, gradients set to None): bytes of the storages each rank holds,
by :func:`plait.plan.memory.measure` (each storage once; a freed one counts 0), split as
parameters (the model's and, healing, the chunks), gradients and optimizer state (healing:
the chunks' Adam state and the copy of chunks and state made before the step). **Sent per
step**: the bytes this rank handed to the transport in one step (``plait.comm.stats``),
per collective. The step time is the slowest rank's, medians.

Writes ``benchmarks/results/heal-fsdp.json`` and ``.md``.
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

from plait.heal.launch import Ranks, start_store  # noqa: E402

WORLD, BATCH, M = 4, 256, 64
BASELINE = {3: "fsdp", 1: "zero1"}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 784, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def _held(model: Any, optimizer: Any) -> dict[str, float]:
    from plait.plan.memory import measure

    m = measure(model, optimizer)
    return {"params": m.params_bytes, "grads": m.grads_bytes, "optimizer": m.optimizer_bytes}


def _sent(stats: dict[Any, Any]) -> dict[str, int]:
    return {f"{c}/{a}": s.bytes_sent for (c, a), s in stats.items() if s.bytes_sent}


def rank_main(*, slot: int, world: int, address: str, steps: int, out: str, zero: int) -> None:
    import torch.distributed as dist

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
    )
    host, port = address.rsplit(":", 1)
    os.environ.update(RANK=str(slot), WORLD_SIZE=str(world), MASTER_ADDR=host, MASTER_PORT=port)
    plait.init(backend="gloo", store=dist.PrefixStore("bench-base", trainer.store))
    base_model = _model()
    runner, base_opt = plait.prepare(
        base_model,
        torch.optim.Adam(base_model.parameters(), lr=1e-3),
        strategy=BASELINE[zero],
        reproducible=True,
        microbatch_size=M,
        loss_fn=nn.functional.cross_entropy,
    )
    times: dict[str, list[float]] = {"heal": [], "base": []}
    sent: dict[str, dict[str, int]] = {}
    world_group = plait.world()
    for step in range(steps + 2):
        x, y = _batch(step)
        for name in ("heal", "base") if step % 2 else ("base", "heal"):
            comm_ops.barrier(group=world_group)
            plait.comm.stats(reset=True)
            t0 = time.perf_counter()
            if name == "heal":
                trainer.step(x, y)
            else:
                runner.step(runner.block(x), runner.block(y))
                base_opt.step()
                base_opt.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - t0
            sent[name] = _sent(plait.comm.stats())
            if step >= 2:
                times[name].append(elapsed)
    held = {
        "heal": _held(trainer.sharded, None),
        "base": _held(base_model, base_opt),
    }
    record = {"times": times, "held": held, "sent": sent}
    Path(out, f"rank{slot}.json").write_text(json.dumps(record))
    plait.shutdown()
    trainer.close()


def job(zero: int, steps: int) -> dict[str, Any]:
    out = tempfile.mkdtemp(prefix="plait-bench-heal-fsdp-")
    store, address = start_store()
    with Ranks(preload=("plait",)) as ranks:
        for s in range(WORLD):
            kw = {"world": WORLD, "address": address, "steps": steps, "out": out, "zero": zero}
            ranks.spawn(rank_main, slot=s, **kw)
        codes = ranks.wait(900)
    del store
    if any(c != [0] for c in codes.values()):
        raise RuntimeError(f"benchmark ranks failed: exit codes {codes}")
    per_rank = [json.loads(Path(out, f"rank{s}.json").read_text()) for s in range(WORLD)]
    result: dict[str, Any] = {"held": {}, "sent": {}, "step": {}}
    for name in ("heal", "base"):
        slowest = [max(r["times"][name][i] for r in per_rank) for i in range(steps)]
        result["step"][name] = statistics.median(slowest)
        result["held"][name] = per_rank[0]["held"][name]  # every rank's within a chunk's rounding
        result["sent"][name] = per_rank[0]["sent"][name]
    result["held_per_rank"] = [r["held"] for r in per_rank]
    return result


def _mb(x: float) -> str:
    return f"{x / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    steps = 4 if args.quick else 12
    load_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    results = {zero: job(zero, steps) for zero in (3, 1)}
    load_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    numel = sum(p.numel() for p in _model().parameters())
    md = [
        "# Healing FSDP: bytes held at rest, bytes sent, the step",
        "",
        f"Command: `.venv/bin/python benchmarks/heal_fsdp.py{' --quick' if args.quick else ''}`"
        f"; 4 local ranks, gloo, MLP {numel / 1e6:.2f}M float32 parameters "
        f"(P = {_mb(4 * numel)} MiB), Adam, batch 256, m 64; load before: `{load_before}`.",
        "",
        "At rest, rank 0, MiB (`plait.plan.memory.measure`; healing's optimizer column holds "
        "the chunks' Adam state and the copy of chunks and state made before the step):",
        "",
        "| job | parameters | gradients | optimizer | total | step (median) | sent per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for zero, label in ((3, "FSDP"), (1, "ZeRO-1")):
        r = results[zero]
        for name, who in (
            ("base", f'`prepare(strategy="{BASELINE[zero]}", reproducible=True)`'),
            ("heal", f"`HealingTrainer(zero={zero})`"),
        ):
            h = r["held"][name]
            total = h["params"] + h["grads"] + h["optimizer"]
            sent = sum(r["sent"][name].values())
            ratio = "" if name == "base" else f" ({r['step']['heal'] / r['step']['base']:.2f}x)"
            md.append(
                f"| {label}: {who} | {_mb(h['params'])} | {_mb(h['grads'])} | "
                f"{_mb(h['optimizer'])} | {_mb(total)} | {1e3 * r['step'][name]:.1f} ms{ratio} | "
                f"{_mb(sent)} MiB |"
            )
    md += ["", "Sent per step by collective, rank 0 (MiB):", ""]
    for zero in (3, 1):
        for name in ("base", "heal"):
            parts = ", ".join(
                f"{k} {_mb(v)}" for k, v in sorted(results[zero]["sent"][name].items())
            )
            md.append(f"- zero={zero} {name}: {parts}")
    md += ["", f"Load after: `{load_after}`"]
    folder = Path(__file__).resolve().parent / "results"
    payload = {
        "steps": steps,
        "load_before": load_before,
        "load_after": load_after,
        "results": {str(k): v for k, v in results.items()},
    }
    (folder / "heal-fsdp.json").write_text(json.dumps(payload, indent=1) + "\n")
    (folder / "heal-fsdp.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
