"""1D vs 2D vs 2.5D vs 3D tensor parallelism on the same GPT: step time, bytes, memory.

    .venv/bin/python benchmarks/tensor_modes.py                          # 4 and 8 ranks
    .venv/bin/python benchmarks/tensor_modes.py --quick --out /tmp/tpnd  # tiny GPT: smoke test

Local ranks (``plait.RankPool``, gloo on loopback), one intra-op thread per rank. The model
is ``plait.models.GPT`` (default 2 layers, width 128, 8 heads, sequence 64, vocabulary 96,
untied head, fp32), a global batch of 8 sequences, Adam (lr 1e-3). Every rank builds it from
the same seed and passes the global batch. Variants at 4 ranks: ``1d`` (``Mesh(tp=4)``,
``tp_plan``) and ``2d`` (2 x 2); at 8 ranks: ``1d`` (``Mesh(tp=8)``), ``2.5d`` (depth 2,
2 x 2) and ``3d`` (2 x 2 x 2); all through ``plait.parallelize`` and ``loss_fn``,
collectives ``auto``.

Step time: one warm-up step, then the variants of one world size take turns step by step
(rotating order); a step is ``zero_grad`` + forward + loss + ``backward`` + ``step`` after a
barrier, its time the slowest rank's; the table shows medians and the ratio to 1D at the
same world size. Fairness: every variant's losses over its first two steps equal a
one-process run (relative 1e-4) and its gathered state dict has the dense keys and shapes.

Bytes: one more step of each variant with ``algorithm="ring"`` counts what every rank sent
(``plait.comm.stats``), averaged over the ranks, against
``plait.plan.tensor_costs.gpt_step_bytes`` (the whole step: linears, vectors and tables,
LayerNorm statistics, loss), and the linear layers' share by the same module. Memory per
rank, measured: the bytes of the rank's parameters, and of the tensors autograd saves for
backward in one forward (``saved_tensors_hooks``, distinct storages), rank 0.

The machine is a shared 2-core box: 8 ranks on 2 cores time-slice, so step times measure
the CPU contention at least as much as the algorithms; ratios within one run are what to
read. Writes ``<out>/tensor_modes.json`` and ``<out>/tensor_modes.md``.
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
from plait.plan.tensor_costs import crossover_tokens, gpt_linears, gpt_step_bytes, linear_cost
from plait.strategies.tensor import loss_fn, parallelize
from plait.strategies.tensor.grid import grid_mesh
from plait.strategies.tensor.parallelize_nd import gpt_plan

MODES = {4: ("1d", "2d"), 8: ("1d", "2.5d", "3d")}


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


def _build(mode: str, cfg: GPTConfig, algorithm: str) -> tuple[Any, Any]:
    n = plait.world().size
    if mode == "1d":
        mesh, plan = plait.Mesh(tp=n), tp_plan(cfg)
    else:
        mesh = grid_mesh(mode, n, depth=2 if mode == "2.5d" else None)
        plan = gpt_plan(mode, layers=cfg.layers)
    model = parallelize(GPT(cfg), mesh, plan, algorithm=algorithm)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = loss_fn(model)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad()
        value = loss(model(x), y)
        value.backward()
        opt.step()
        return value.item()

    return model, step


def _saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct tensors autograd keeps for backward in one forward."""
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen[(st.data_ptr(), st.nbytes())] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    del out
    return sum(n for (ptr, _), n in seen.items() if ptr not in params)


def run_rank(args: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    cfg = _config(args)
    world = plait.world()
    b = args["batch"]
    names = list(MODES[world.size])
    variants = {m: _build(m, cfg, "auto") for m in names}
    dense = GPT(cfg)
    opt = torch.optim.Adam(dense.parameters(), lr=1e-3)
    want = []
    for i in range(2):
        x, y = _batch(i, cfg, b)
        opt.zero_grad()
        value = F.cross_entropy(dense(x).flatten(0, 1), y.flatten())
        value.backward()
        opt.step()
        want.append(value.item())
    shapes = {k: tuple(v.shape) for k, v in dense.state_dict().items()}
    for name, (model, step) in variants.items():
        got = [step(*_batch(i, cfg, b)) for i in range(2)]
        if not all(abs(a - w) <= 1e-4 * abs(w) for a, w in zip(got, want, strict=True)):
            raise AssertionError(f"{name}: losses {got} differ from one process's {want}")
        full = checkpoint.full_state_dict(model)
        if {k: tuple(v.shape) for k, v in full.items()} != shapes:
            raise AssertionError(f"{name}: the gathered state dict is not the dense model's")
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args["warmup"] + args["steps"]):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            x, y = _batch(i + 2, cfg, b)
            comm.barrier(group=world)
            t0 = time.perf_counter()
            variants[name][1](x, y)
            dt = torch.tensor([time.perf_counter() - t0])
            comm.all_reduce(dt, "max", group=world)
            if i >= args["warmup"]:
                times[name].append(float(dt))
    memory = {}
    for name, (model, _) in variants.items():
        memory[name] = {
            "params": sum(p.numel() * p.element_size() for p in model.parameters()),
            "saved": _saved_bytes(model, _batch(0, cfg, b)[0]),
        }
    sent: dict[str, int] = {}
    for name in names:
        _, step = _build(name, cfg, "ring")
        x, y = _batch(0, cfg, b)
        step(x, y)  # a new group's first collective may exchange host names: not counted
        comm.reset_stats()
        step(x, y)
        sent[name] = sum(s.bytes_sent for s in comm.stats(reset=True).values())
    dense_mem = {
        "params": sum(p.numel() * p.element_size() for p in dense.parameters()),
        "saved": _saved_bytes(dense, _batch(0, cfg, b)[0]),
    }
    return {"times": times, "memory": memory, "dense": dense_mem, "sent": sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="4,8")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="benchmarks/results")
    ns = parser.parse_args()
    args = vars(ns)
    if ns.quick:
        args |= {"worlds": "4", "width": 32, "seq": 16, "steps": 2}
    cfg = _config(args)
    rows, raw = [], {}
    for n in [int(v) for v in str(args["worlds"]).split(",")]:
        pool = plait.RankPool(n, timeout=600)
        try:
            results = pool.run(run_rank, args, timeout=3600)
        finally:
            pool.close()
        raw[n] = results
        r0 = results[0]
        med = {m: statistics.median(v) for m, v in r0["times"].items()}
        for mode in med:
            measured = sum(r["sent"][mode] for r in results) / n
            depth = 2 if mode == "2.5d" else None
            formula = gpt_step_bytes(
                mode,
                batch=args["batch"],
                seq=cfg.seq_len,
                width=cfg.width,
                layers=cfg.layers,
                vocab=cfg.vocab,
                ranks=n,
                depth=depth,
            )
            multiple = 1 if mode == "1d" else (4 if mode == "3d" else 2)
            vocab_p = -(-cfg.vocab // multiple) * multiple
            linears = sum(
                linear_cost(
                    mode,
                    tokens=args["batch"] * cfg.seq_len,
                    in_features=i,
                    out_features=o,
                    side=side,
                    ranks=n,
                    depth=depth,
                ).bytes_per_rank
                for i, o, side in gpt_linears(cfg.width, cfg.layers, vocab_p)
            )
            rows.append(
                {
                    "ranks": n,
                    "mode": mode,
                    "step_ms": 1e3 * med[mode],
                    "vs_1d": med[mode] / med["1d"],
                    "bytes_measured": measured,
                    "bytes_formula": formula,
                    "bytes_linears": linears,
                    "param_bytes": r0["memory"][mode]["params"],
                    "param_fraction": r0["memory"][mode]["params"] / r0["dense"]["params"],
                    "saved_bytes": r0["memory"][mode]["saved"],
                    "saved_fraction": r0["memory"][mode]["saved"] / r0["dense"]["saved"],
                }
            )
    out = Path(args["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "tensor_modes.json").write_text(
        json.dumps({"args": args, "rows": rows, "raw": raw}, indent=1)
    )
    lines = [
        f"GPT {cfg.layers} layers, width {cfg.width}, {cfg.heads} heads, sequence {cfg.seq_len},"
        f" vocab {cfg.vocab}, global batch {args['batch']}, fp32; medians of {args['steps']} "
        f"steps; shared 2-core box (8 ranks time-slice 2 cores)",
        "",
        "| ranks | mode | step ms | / 1d | bytes/step/rank (ring, measured) | formula | "
        "of which linears | params/rank (of dense) | saved activations/rank (of dense) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['ranks']} | {r['mode']} | {r['step_ms']:.1f} | {r['vs_1d']:.2f} | "
            f"{r['bytes_measured']:,.0f} | {r['bytes_formula']:,.0f} | {r['bytes_linears']:,.0f}"
            f" | {r['param_bytes']:,} ({r['param_fraction']:.3f}) | {r['saved_bytes']:,} "
            f"({r['saved_fraction']:.3f}) |"
        )
    tokens = args["batch"] * cfg.seq_len
    lines += [
        "",
        f"Crossover in bytes (linear layers, tensor_costs.crossover_tokens): the tokens per step "
        f"above which a mode's linears send fewer bytes per rank than 1D's; this run has "
        f"{tokens}. Ring = what plait sends; paper = the papers' reduce.",
        "",
        "| ranks | mode | crossover tokens (ring) | (paper) |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["mode"] == "1d":
            continue
        shape = {"ranks": r["ranks"], "width": cfg.width, "layers": cfg.layers}
        cross = [
            crossover_tokens(r["mode"], vocab=cfg.vocab, algorithm=a, **shape)
            for a in ("ring", "paper")
        ]
        text = ["never" if c is None else f"{c:,.0f}" for c in cross]
        lines.append(f"| {r['ranks']} | {r['mode']} | {text[0]} | {text[1]} |")
    (out / "tensor_modes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
