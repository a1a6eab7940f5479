"""Context parallelism: ring attention and Ulysses against one process's attention, step
time and peak memory per rank, and the causal work per rank with and without the load
balancer.

    PYTHONPATH=. .venv/bin/python benchmarks/context.py                 # seq 1k, 4k; cp 1, 2, 4
    PYTHONPATH=. .venv/bin/python benchmarks/context.py --seqs 1024 --cps 1 2
    PLAIT_TRANSPORT=gloo PYTHONPATH=. .venv/bin/python benchmarks/context.py --model \
        --seqs 1024 2048 4096                                   # plait's GPT, 8 layers
    PLAIT_TRANSPORT=gloo PYTHONPATH=. .venv/bin/python benchmarks/context.py --model \
        --seqs 1024 2048 --zero 3 --name context_model_zero3    # parameters sharded over cp

``--model``: plait's GPT (``--layers``, ``--heads`` (4) x ``--head-dim``, ``--vocab``,
batch 1, float32, causal, balanced), the peak per rank of one training step (forward,
backward with the gradient average; gradients allocated before it), the part above the
parameters and gradients, and the bytes autograd saves (parameters left out), against 1/cp
of one process's. Then the longest sequence within the budget of one process's peak at
``--budget-seq`` (the largest ``--layers``): a least-squares line of the peak against the
length, solved for the budget, rounded down to a multiple of ``--quantum``, measured there
(one quantum down while over). Writes ``context_model.{json,md}``. ``--zero 3``: the cp runs
use ``plait.prepare(strategy="cp", zero=3)`` (FSDP over cp, each block a unit), so the
parameters and gradients held are 1/cp shards and the blocks gathered during the step count
in its peak; the saved-for-backward column then includes the gathered weights autograd
saves (freed after each block's forward, so an upper bound).

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


def _model_step(
    model: Any, ids: torch.Tensor, targets: torch.Tensor, saved: dict[int, int], params: set[int]
) -> None:
    """Forward + backward of one training step (the loss on this rank's tokens); the bytes
    autograd saves for backward (each storage once, parameters left out) go into ``saved``."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    del logits
    loss.backward()


def measure_model(
    seqs: list[int],
    layers: list[int],
    width: int,
    heads: int,
    vocab: int,
    kinds: list[str] | None = None,
    zero: int = 0,
) -> list[dict[str, Any]]:
    """On every rank of a cp group of the world's size: one training step of plait's GPT
    (``layers`` blocks, causal, float32, batch 1) at each length, under MemTracker.
    ``zero=3``: the cp runs shard parameters and gradients over cp (FSDP, each block a unit),
    so "parameters + gradients" is this rank's shards and the gathered blocks count in the
    step's peak."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from plait.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    mesh = plait.Mesh(cp=plait.world().size)
    group = mesh.group("cp")
    if kinds is None:
        kinds = ["sdpa"] if group.size == 1 else ["ring", "ulysses"]
    rows = []
    for n_layers in layers:
        for seq in seqs:
            g = torch.Generator().manual_seed(seq)
            tokens = torch.randint(0, vocab, (1, seq + 1), generator=g)
            for kind in kinds:
                cfg = GPTConfig(vocab=vocab, layers=n_layers, heads=heads, width=width, seq_len=seq)
                model = GPT(cfg)
                ids, targets = tokens[:, :-1], tokens[:, 1:]
                runner: Any = model
                if kind != "sdpa":
                    runner, _ = plait.prepare(
                        model,
                        None,
                        strategy="cp",
                        mesh=mesh,
                        context=kind,
                        balanced=True,
                        zero=zero,
                    )
                    ids, _ = shard_sequence(ids, mesh)
                    targets, _ = shard_sequence(targets, mesh)
                for p in model.parameters():  # resident from the start, as in training
                    p.grad = torch.zeros_like(p)
                params = {p.untyped_storage().data_ptr() for p in model.parameters()}
                saved: dict[int, int] = {}
                tracker = MemTracker()
                tracker.track_external(model)
                comm.barrier(group=group)
                t0 = time.perf_counter()
                with tracker:
                    _model_step(runner, ids, targets, saved, params)
                seconds = _slowest(time.perf_counter() - t0, group)
                snap = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
                total = float(snap["Total"])
                resident = float(snap.get("Parameter", 0) + snap.get("Gradient", 0))
                values = torch.tensor([total, total - resident, float(sum(saved.values()))])
                comm.all_reduce(values, "max", group=group)
                rows.append(
                    {
                        "cp": group.size,
                        "seq": seq,
                        "layers": n_layers,
                        "kernel": "one process (SDPA)" if kind == "sdpa" else kind,
                        "zero": zero if kind != "sdpa" else 0,
                        "step_s": seconds,
                        "peak_mib": float(values[0]) / 2**20,
                        "step_peak_mib": float(values[1]) / 2**20,
                        "params_grads_mib": resident / 2**20,
                        "saved_mib": float(values[2]) / 2**20,
                    }
                )
                del model, runner, tracker
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


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ``peak = a + b * seq`` over ``(seq, peak)``."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def _model_table(rows: list[dict[str, Any]]) -> str:
    base = {
        (r["layers"], r["seq"]): r for r in rows if r["cp"] == 1 and r["kernel"].startswith("one")
    }
    lines = [
        "| layers | seq | cp | kernel | zero | step (s) | peak per rank (MiB) "
        "| peak / (cp 1 / cp) | parameters + gradients held (MiB) "
        "| peak above parameters + gradients (MiB) | its / (cp 1 / cp) "
        "| saved for backward (MiB) | saved / (cp 1 / cp) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["layers"], r["seq"], r["cp"], r["kernel"])):
        b = base.get((r["layers"], r["seq"]))
        cp = r["cp"]

        def ratio(key: str, row: dict[str, Any] = r, one: Any = b, c: int = cp) -> str:
            return f"{row[key] / (one[key] / c):.2f}" if one else "-"

        lines.append(
            f"| {r['layers']} | {r['seq']} | {cp} | {r['kernel']} | {r.get('zero', 0)} | "
            f"{r['step_s']:.1f} | {r['peak_mib']:.1f} | {ratio('peak_mib')} | "
            f"{r['params_grads_mib']:.1f} | {r['step_peak_mib']:.1f} | "
            f"{ratio('step_peak_mib')} | {r['saved_mib']:.1f} | {ratio('saved_mib')} |"
        )
    return "\n".join(lines)


def model_main(args: argparse.Namespace) -> None:
    """``--model``: plait's GPT, the peak of one training step per rank at each length and
    cp; then the longest sequence whose measured peak fits the cp-1 peak at
    ``--budget-seq`` (fitted line of peak vs length, then measured at the prediction)."""
    heads = args.heads or 4
    width = heads * args.head_dim
    model_args = (args.layers, width, heads, args.vocab)
    rows: list[dict[str, Any]] = []
    for cp in args.cps:
        with plait.RankPool(cp, timeout=1800) as pool:
            rows += pool.run(measure_model, args.seqs, *model_args, zero=args.zero, timeout=1800)[0]
        print(f"cp {cp} done", flush=True)
    text = (
        f"# Context parallelism: plait's GPT, one training step (forward + backward), heads "
        f"{heads} x {args.head_dim}, vocab {args.vocab}, batch 1, float32, causal, balanced; "
        f"cp runs with zero={args.zero}; transport "
        f"{os.environ.get('PLAIT_TRANSPORT', 'auto')}\n\n" + _model_table(rows) + "\n"
    )
    fits: list[dict[str, Any]] = []
    layers = max(args.layers)
    budget_row = [
        r for r in rows if r["cp"] == 1 and r["layers"] == layers and r["seq"] == args.budget_seq
    ]
    if budget_row and len(args.seqs) > 1:
        budget = budget_row[0]["peak_mib"]
        q = args.quantum
        for cp in args.cps:
            kinds = ["sdpa"] if cp == 1 else ["ring", "ulysses"]
            with plait.RankPool(cp, timeout=1800) as pool:
                for kind in kinds:
                    name = "one process (SDPA)" if kind == "sdpa" else kind
                    pts = [
                        (r["seq"], r["peak_mib"])
                        for r in rows
                        if r["cp"] == cp and r["layers"] == layers and r["kernel"] == name
                    ]
                    a, b = _fit(pts)
                    seq = int((budget - a) / b) // q * q
                    predicted = seq
                    tried = []
                    while seq >= q:  # measured: step down while over the budget
                        got = pool.run(
                            measure_model,
                            [seq],
                            [layers],
                            *model_args[1:],
                            [kind],
                            zero=args.zero,
                            timeout=1800,
                        )[0][0]
                        tried.append((seq, got["peak_mib"]))
                        if got["peak_mib"] <= budget or len(tried) == 3:
                            break
                        seq -= q
                    fits.append(
                        {
                            "cp": cp,
                            "kernel": name,
                            "layers": layers,
                            "budget_mib": budget,
                            "fit_mib": [a, b],
                            "predicted_seq": predicted,
                            "measured": tried,
                            "longest_seq": tried[-1][0] if tried[-1][1] <= budget else None,
                        }
                    )
            print(f"budget cp {cp} done", flush=True)
        base = next(f["longest_seq"] for f in fits if f["cp"] == 1)
        lines = [
            "| cp | kernel | fit: peak MiB = a + b * seq | predicted longest | measured at it "
            "(MiB) | longest that fits (measured) | / cp 1's |",
            "|---|---|---|---|---|---|---|",
        ]
        for f in fits:
            a, b = f["fit_mib"]
            steps = ", ".join(f"{s}: {m:.1f}" for s, m in f["measured"])
            longest = f["longest_seq"]
            lines.append(
                f"| {f['cp']} | {f['kernel']} | {a:.1f} + {b * 1024:.2f} per 1k | "
                f"{f['predicted_seq']} | {steps} | {longest} | "
                f"{longest / base:.2f} |"
                if longest and base
                else f"| {f['cp']} | {f['kernel']} | {a:.1f} + {b * 1024:.2f} per 1k | "
                f"{f['predicted_seq']} | {steps} | none | - |"
            )
        text += (
            f"\nLongest sequence within a budget of {budget:.1f} MiB per rank (the cp-1 peak "
            f"at seq {args.budget_seq}, {layers} layers; lengths multiples of {q}; the line "
            f"fitted to the peaks above, then measured there, one step of {q} down while "
            f"over):\n\n" + "\n".join(lines) + "\n"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(
        json.dumps({"args": vars(args), "rows": rows, "budget": fits}, indent=1)
    )
    (out / f"{args.name}.md").write_text(text)
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--heads", type=int, default=None, help="8; --model: 4")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default=None, help="files <out>/<name>.json and .md")
    parser.add_argument("--model", action="store_true", help="plait's GPT, one training step")
    parser.add_argument("--layers", type=int, nargs="+", default=[8], help="--model: blocks")
    parser.add_argument("--vocab", type=int, default=256, help="--model: vocabulary")
    parser.add_argument("--budget-seq", type=int, default=4096, help="--model: the budget")
    parser.add_argument("--quantum", type=int, default=256, help="--model: length step")
    parser.add_argument(
        "--zero",
        type=int,
        choices=[0, 3],
        default=0,
        help="--model: 3 shards parameters and gradients over cp (FSDP, a unit per block)",
    )
    args = parser.parse_args()
    if args.model:
        args.name = args.name or "context_model"
        model_main(args)
        return
    args.name = args.name or "context"
    args.heads = args.heads or 8
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
