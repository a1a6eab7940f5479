"""plait's tensor parallelism against PyTorch's DTensor tensor parallelism on the same GPT.

    .venv/bin/python benchmarks/tensor.py                        # tp 2 and 4, a few minutes
    .venv/bin/python benchmarks/tensor.py --quick --out /tmp/tp  # small GPT, tp 2: smoke test

Local ranks (``plait.RankPool``, gloo on loopback), one intra-op thread per rank. The model
is ``plait.models.GPT`` (default 4 layers, width 256, 4 heads, sequence 128, vocabulary 96,
untied head, fp32), batch 4 sequences, Adam (lr 1e-3). Every rank builds it from the same
seed; variants:

- ``plait tp``: ``plait.parallelize(model, Mesh(tp=t), tp_plan(...))`` (attention heads and
  MLP split column-then-row, embedding and head split by vocabulary), loss
  ``vocab_parallel_cross_entropy``; collectives ``auto``;
- ``plait tp+sp``: the same with sequence parallelism (LayerNorms and position embedding on
  sequence slices);
- ``torch tp``: ``torch.distributed.tensor.parallel.parallelize_module`` over
  ``init_device_mesh("cpu", (t,))`` with ``ColwiseParallel`` on qkv/fc1, ``RowwiseParallel``
  on proj/fc2, ``RowwiseParallel(input_layouts=Replicate())`` on the token embedding,
  ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)`` on the head and
  ``loss_parallel()`` around the loss and backward, as PyTorch documents it. (PyTorch's
  ``SequenceParallel`` is not run: the GPT's learned position embedding, added to a
  sequence-sharded DTensor, has no ready-made style there.)

Step time: warm-up steps, then the variants take turns step by step (rotating order); a
step is ``zero_grad`` + forward + loss + ``backward`` + ``step`` after a barrier, its time
the slowest rank's; tables show medians. Fairness: every variant's losses over its first two
steps equal a one-process run of the same GPT (relative 1e-4), and its gathered state dict
has the dense keys and shapes. (The tests compare parameters exactly, in float64.)

Bytes: one more step of ``plait tp`` / ``tp+sp`` with ``algorithm="ring"`` counts what the
rank sent (``plait.comm.stats``); the formula per step (elements, ring, per rank) is
``(t-1)/t * (8 L b s h  +  4 b s h  +  8 b s)``: four all-reduces of ``b s h`` per layer,
the embedding's forward all-reduce and the head input's backward all-reduce, and the loss's
two all-reduces (``b s`` maxima, ``3 b s`` sums); with sequence parallelism add ``2 (t-1)/t``
times the replicated parameters that see a slice (LayerNorms, row-parallel biases, position
embedding). Parameter bytes: the sum of each rank's local parameters, split ones apart.

Writes ``<out>/tensor.json`` and ``<out>/tensor.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

import plait
from plait import checkpoint, comm
from plait.models import GPT, GPTConfig
from plait.models.gpt import tp_plan
from plait.strategies.tensor import loss_fn, parallelize


def _config(args: dict[str, Any]) -> GPTConfig:
    return GPTConfig(
        vocab=96,
        layers=args["layers"],
        heads=args["heads"],
        width=args["width"],
        seq_len=args["seq"],
        seed=0,
    )


def _batch(step: int, cfg: GPTConfig, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, cfg.vocab, (batch, cfg.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _plait(cfg: GPTConfig, sp: bool, algorithm: str) -> tuple[Any, Any, Any, Any]:
    mesh = plait.Mesh(tp=plait.world().size)
    model = parallelize(GPT(cfg), mesh, tp_plan(cfg, sequence_parallel=sp), algorithm=algorithm)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = loss_fn(model)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad()
        value = loss(model(x), y)
        value.backward()
        opt.step()
        return value.item()

    return model, opt, step, lambda: checkpoint.full_state_dict(model)


def _torch(cfg: GPTConfig) -> tuple[Any, Any, Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (plait.world().size,))
    plan: dict[str, Any] = {
        "tok": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(cfg.layers):
        plan |= {
            f"blocks.{i}.attn.qkv": ColwiseParallel(),
            f"blocks.{i}.attn.proj": RowwiseParallel(),
            f"blocks.{i}.mlp.fc1": ColwiseParallel(),
            f"blocks.{i}.mlp.fc2": RowwiseParallel(),
        }
    model = parallelize_module(GPT(cfg), mesh, plan)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad()
        logits = model(x)
        with loss_parallel():
            value = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            value.backward()
        opt.step()
        return value.full_tensor().item()

    def full() -> dict[str, torch.Tensor]:
        return {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
            for k, v in model.state_dict().items()
        }

    return model, opt, step, full


def _param_bytes(model: torch.nn.Module) -> dict[str, int]:
    split = replicated = 0
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        n = local.numel() * local.element_size()
        if any(k in name for k in ("qkv", "fc1", "tok", "head")) or name.endswith(
            ("proj.weight", "fc2.weight")
        ):
            split += n
        else:
            replicated += n
    return {"split": split, "replicated": replicated}


def run_rank(args: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    cfg = _config(args)
    world = plait.world()
    builders = {
        "plait tp": lambda: _plait(cfg, False, "auto"),
        "plait tp+sp": lambda: _plait(cfg, True, "auto"),
        "torch tp": lambda: _torch(cfg),
    }
    variants = {name: build() for name, build in builders.items()}
    # fairness: the losses of two steps against one process (parameters after an Adam step
    # are no fair test in fp32: where a gradient is ~0 its sign, so the step, is rounding)
    dense = GPT(cfg)
    opt = torch.optim.Adam(dense.parameters(), lr=1e-3)
    want = []
    for i in range(2):
        x, y = _batch(i, cfg, args["batch"])
        opt.zero_grad()
        value = F.cross_entropy(dense(x).flatten(0, 1), y.flatten())
        value.backward()
        opt.step()
        want.append(value.item())
    for name, (_, _, step, full) in variants.items():
        got = [step(*_batch(i, cfg, args["batch"])) for i in range(2)]
        if not all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(got, want, strict=True)):
            raise AssertionError(f"{name}: losses {got} differ from one process's {want}")
        shapes = {k: tuple(v.shape) for k, v in full().items()}
        if shapes != {k: tuple(v.shape) for k, v in dense.state_dict().items()}:
            raise AssertionError(f"{name}: the gathered state dict is not the dense model's")
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args["warmup"] + args["steps"]):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            x, y = _batch(i + 1, cfg, args["batch"])
            comm.barrier(group=world)
            t0 = time.perf_counter()
            variants[name][2](x, y)
            dt = torch.tensor([time.perf_counter() - t0])
            comm.all_reduce(dt, "max", group=world)
            if i >= args["warmup"]:
                times[name].append(float(dt))
    memory = {n: _param_bytes(v[0]) for n, v in variants.items()}
    memory["dense"] = _param_bytes(GPT(cfg))
    sent: dict[str, int] = {}
    for name, sp in (("plait tp", False), ("plait tp+sp", True)):
        _, _, step, _ = _plait(cfg, sp, "ring")
        x, y = _batch(0, cfg, args["batch"])
        step(x, y)  # a new group's first collective may exchange host names: not counted
        comm.reset_stats()
        step(x, y)
        sent[name] = sum(s.bytes_sent for s in comm.stats(reset=True).values())
    return {"rank": world.rank, "times": times, "memory": memory, "sent": sent}


def formula_bytes(cfg: GPTConfig, t: int, batch: int, sp: bool) -> int:
    b, s, h, L = batch, cfg.seq_len, cfg.width, cfg.layers
    elems = (8 * L * b * s * h + 4 * b * s * h + 8 * b * s) * (t - 1) / t
    if sp:
        replicated = L * (4 * h + 2 * h) + 2 * h + cfg.seq_len * h  # LNs, row biases, ln_f, pos
        elems += 2 * replicated * (t - 1) / t
    return int(round(elems * 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", default="2,4")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="benchmarks/results")
    ns = parser.parse_args()
    args = vars(ns)
    if ns.quick:
        args |= {"tp": "2", "layers": 2, "width": 64, "seq": 32, "steps": 3, "warmup": 1}
    cfg = _config(args)
    rows, raw = [], {}
    for t in [int(v) for v in str(args["tp"]).split(",")]:
        pool = plait.RankPool(t, timeout=600)
        try:
            results = pool.run(run_rank, args, timeout=3600)
        finally:
            pool.close()
        raw[t] = results
        r0 = results[0]
        med = {n: statistics.median(v) for n, v in r0["times"].items()}
        dense_split = r0["memory"]["dense"]["split"]
        for name in med:
            mem = r0["memory"][name]
            sent = r0["sent"].get(name)
            want = formula_bytes(cfg, t, args["batch"], "sp" in name) if sent is not None else None
            rows.append(
                {
                    "tp": t,
                    "variant": name,
                    "step_ms": 1e3 * med[name],
                    "vs_torch": med[name] / med["torch tp"],
                    "split_param_fraction": mem["split"] / dense_split,
                    "bytes_sent": sent,
                    "formula_bytes": want,
                }
            )
    out = Path(args["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "tensor.json").write_text(json.dumps({"args": args, "rows": rows, "raw": raw}, indent=1))
    lines = [
        f"GPT {cfg.layers} layers, width {cfg.width}, {cfg.heads} heads, sequence {cfg.seq_len},"
        f" vocab {cfg.vocab}, batch {args['batch']}, fp32; medians of {args['steps']} steps",
        "",
        "| tp | variant | step ms | / torch tp | split params per rank | bytes sent/step "
        "(ring) | formula |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        sent = "-" if r["bytes_sent"] is None else f"{r['bytes_sent']:,}"
        want = "-" if r["formula_bytes"] is None else f"{r['formula_bytes']:,}"
        lines.append(
            f"| {r['tp']} | {r['variant']} | {r['step_ms']:.1f} | {r['vs_torch']:.2f} | "
            f"{r['split_param_fraction']:.3f} of dense | {sent} | {want} |"
        )
    (out / "tensor.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
