"""What healing FSDP holds and sends: bytes per member at rest, bytes sent per step, and the
step, against healing ZeRO-1 and plait's own FSDP and ZeRO-1 without healing.

    .venv/bin/python benchmarks/heal_fsdp.py            # 4 ranks, 12 steps each way
    .venv/bin/python benchmarks/heal_fsdp.py --quick    # 4 steps
    .venv/bin/python benchmarks/heal_fsdp.py --microbatch-size 16  # 4 micro-batches a block

Four local ranks (forkserver processes, one intra-op thread each), the job's store in this
process. Model: an MLP 784-1024-1024-10 (1.9M parameters, float32), Adam, global batch 256
in micro-batches of 64 (``M = W = 4``). Three jobs, each side by side in the same four
processes, steps taking turns:

- ``HealingTrainer(zero=3)`` (the default: one unit at a time, the three ``nn.Linear``)
  against ``plait.prepare(strategy="fsdp", reproducible=True)``;
- ``HealingTrainer(zero=3, wrap=None)`` (the whole model gathered at the step's start)
  against the same;
- ``HealingTrainer(zero=1)`` against ``plait.prepare(strategy="zero1", reproducible=True)``.

**Peak during a step** (zero=3): the most bytes of parameters held at once
(:attr:`plait.heal.fsdp.ShardedParams.peak`: the model's parameter storages allocated,
and the whole-model gather's flat buffer), the two chunks apart.

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

WORLD, BATCH = 4, 256
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


def rank_main(
    *,
    slot: int,
    world: int,
    address: str,
    steps: int,
    out: str,
    zero: int,
    wrap: str | None,
    microbatch: int,
) -> None:
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
        microbatch_size=microbatch,
        world=world,
        address=address,
        slot=slot,
        zero=zero,
        wrap=wrap,
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
        microbatch_size=microbatch,
        loss_fn=nn.functional.cross_entropy,
    )
    times: dict[str, list[float]] = {"heal": [], "base": []}
    sent: dict[str, dict[str, int]] = {}
    peak = 0
    world_group = plait.world()
    for step in range(steps + 2):
        x, y = _batch(step)
        for name in ("heal", "base") if step % 2 else ("base", "heal"):
            comm_ops.barrier(group=world_group)
            plait.comm.stats(reset=True)
            t0 = time.perf_counter()
            if name == "heal":
                if zero == 3:
                    trainer.sharded.peak = 0
                trainer.step(x, y)
                if zero == 3:
                    peak = max(peak, trainer.sharded.peak)
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
    record = {"times": times, "held": held, "sent": sent, "peak": peak}
    Path(out, f"rank{slot}.json").write_text(json.dumps(record))
    plait.shutdown()
    trainer.close()


def job(zero: int, steps: int, wrap: str | None, microbatch: int) -> dict[str, Any]:
    out = tempfile.mkdtemp(prefix="plait-bench-heal-fsdp-")
    store, address = start_store()
    with Ranks(preload=("plait",)) as ranks:
        for s in range(WORLD):
            kw = {"world": WORLD, "address": address, "steps": steps, "out": out, "zero": zero}
            kw.update(wrap=wrap if zero == 3 else "children", microbatch=microbatch)
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
    result["peak"] = max(r["peak"] for r in per_rank)
    return result


def _mb(x: float) -> str:
    return f"{x / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--microbatch-size", type=int, default=64)
    args = parser.parse_args()
    mb = args.microbatch_size
    steps = 4 if args.quick else 12
    load_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    jobs = {"3": (3, "children"), "3-whole": (3, None), "1": (1, "children")}
    results = {key: job(zero, steps, wrap, mb) for key, (zero, wrap) in jobs.items()}
    load_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    numel = sum(p.numel() for p in _model().parameters())
    md = [
        "# Healing FSDP: bytes held at rest, bytes sent, the step",
        "",
        f"Command: `.venv/bin/python benchmarks/heal_fsdp.py{' --quick' if args.quick else ''}"
        f"{'' if mb == 64 else f' --microbatch-size {mb}'}`"
        f"; 4 local ranks, gloo, MLP {numel / 1e6:.2f}M float32 parameters "
        f"(P = {_mb(4 * numel)} MiB), Adam, batch 256, m {mb} ({BATCH // mb // WORLD} "
        f"micro-batches per block); load before: `{load_before}`.",
        "",
        "At rest, rank 0, MiB (`plait.plan.memory.measure`; healing's optimizer column holds "
        "the chunks' Adam state and the copy of chunks and state made before the step):",
        "",
        "| job | parameters | gradients | optimizer | total | step (median) | sent per step |",
        "|---|---|---|---|---|---|---|",
    ]
    labels = {"3": ("FSDP", ""), "3-whole": ("FSDP", ", wrap=None"), "1": ("ZeRO-1", "")}
    for key, (label, extra) in labels.items():
        r, zero = results[key], jobs[key][0]
        for name, who in (
            ("base", f'`prepare(strategy="{BASELINE[zero]}", reproducible=True)`'),
            ("heal", f"`HealingTrainer(zero={zero}{extra})`"),
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
    unit, whole = results["3"], results["3-whole"]
    md += [
        "",
        "Healing FSDP, one unit at a time against the whole model (each job's step as a "
        "ratio of plain FSDP's in the same processes, then of each other):",
        "",
        "| zero=3 | peak parameters in a step | step / FSDP's | sent per step |",
        "|---|---|---|---|",
    ]
    for r, who in ((unit, "per unit (default)"), (whole, "whole model (`wrap=None`)")):
        md.append(
            f"| {who} | {_mb(r['peak'])} MiB | {r['step']['heal'] / r['step']['base']:.2f}x | "
            f"{_mb(sum(r['sent']['heal'].values()))} MiB |"
        )
    ratio_step = (unit["step"]["heal"] / unit["step"]["base"]) / (
        whole["step"]["heal"] / whole["step"]["base"]
    )
    md += [
        "",
        f"Per unit / whole model: peak {unit['peak'] / whole['peak']:.2f}x, step "
        f"{ratio_step:.2f}x (each against FSDP in its own run).",
        "",
        "Sent per step by collective, rank 0 (MiB):",
        "",
    ]
    for key in jobs:
        for name in ("base", "heal"):
            parts = ", ".join(
                f"{k} {_mb(v)}" for k, v in sorted(results[key]["sent"][name].items())
            )
            md.append(f"- zero={key} {name}: {parts}")
    md += ["", f"Load after: `{load_after}`"]
    folder = Path(__file__).resolve().parent / "results"
    payload = {
        "steps": steps,
        "microbatch_size": mb,
        "load_before": load_before,
        "load_after": load_after,
        "results": results,
    }
    name = "heal-fsdp" if mb == 64 else f"heal-fsdp-m{mb}"
    (folder / f"{name}.json").write_text(json.dumps(payload, indent=1) + "\n")
    (folder / f"{name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
