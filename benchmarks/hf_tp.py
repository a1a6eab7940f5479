"""plait's tensor parallelism against PyTorch's ``parallelize_module`` on the same Hugging
Face LlamaForCausalLM, each handed the model whole and trained with its own ``labels=`` loss.

    .venv/bin/python benchmarks/hf_tp.py                        # tp 2, a few minutes
    .venv/bin/python benchmarks/hf_tp.py --quick --out /tmp/tp  # small model: smoke test

Local ranks (``plait.RankPool``, gloo on loopback), one intra-op thread per rank. The model
(default): 4 layers, hidden 256, MLP 688, 8 query heads and 4 key/value heads, vocabulary
1024, sequence 128, untied head, fp32, eager attention, batch 4, AdamW (lr 1e-3). Every
rank builds it from the same seed; variants:

- ``plait tp``: ``plait.prepare(model, opt, strategy="tp", mesh=Mesh(tp=t))`` (the Llama
  family's plan: q/k/v and gate/up column-wise behind one "f" per block, o/down row-wise,
  embedding and ``lm_head`` by vocabulary, the logits gathered for the model's loss);
- ``torch tp``: ``parallelize_module`` over ``init_device_mesh("cpu", (t,))`` with the plan
  Hugging Face and torchtitan use: ``ColwiseParallel`` on q/k/v/gate/up,
  ``RowwiseParallel`` on o/down, ``RowwiseParallel(input_layouts=Replicate())`` on the
  embedding, ``ColwiseParallel(output_layouts=Replicate())`` on ``lm_head`` (full logits
  for the model's loss, as plait's).

Step time: warm-up steps, then the variants take turns step by step (rotating order); a
step is ``zero_grad`` + forward with ``labels=`` + ``backward`` + ``step`` after a barrier,
its time the slowest rank's; the table shows medians and plait / torch. Fairness: each
variant's losses over its first two steps equal a one-process run (relative 1e-4).
Writes ``<out>/hf_tp.json`` and ``<out>/hf_tp.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import plait
from plait import comm


def _model(args: dict[str, Any]) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args["vocab"],
        hidden_size=args["hidden"],
        intermediate_size=args["mlp"],
        num_hidden_layers=args["layers"],
        num_attention_heads=args["heads"],
        num_key_value_heads=args["kv_heads"],
        max_position_embeddings=args["seq"],
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _batch(step: int, args: dict[str, Any]) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, args["vocab"], (args["batch"], args["seq"]), generator=g)


def _stepper(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    def step(ids: torch.Tensor) -> float:
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return float(loss.item())

    return step


def _plait(args: dict[str, Any]) -> Any:
    model = _model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, new = plait.prepare(model, opt, strategy="tp", mesh=plait.Mesh(tp=plait.world().size))
    assert new is not None
    return _stepper(model, new)


def _torch(args: dict[str, Any]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (plait.world().size,))
    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(args["layers"]):
        b = f"model.layers.{i}"
        plan |= {
            f"{b}.self_attn.q_proj": ColwiseParallel(),
            f"{b}.self_attn.k_proj": ColwiseParallel(),
            f"{b}.self_attn.v_proj": ColwiseParallel(),
            f"{b}.self_attn.o_proj": RowwiseParallel(),
            f"{b}.mlp.gate_proj": ColwiseParallel(),
            f"{b}.mlp.up_proj": ColwiseParallel(),
            f"{b}.mlp.down_proj": RowwiseParallel(),
        }
    model = parallelize_module(_model(args), mesh, plan)
    return _stepper(model, torch.optim.AdamW(model.parameters(), lr=1e-3))


def run_rank(args: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    world = plait.world()
    variants = {"plait tp": _plait(args), "torch tp": _torch(args)}
    dense = _model(args)
    step = _stepper(dense, torch.optim.AdamW(dense.parameters(), lr=1e-3))
    want = [step(_batch(i, args)) for i in range(2)]
    for name, run in variants.items():
        got = [run(_batch(i, args)) for i in range(2)]
        if not all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(got, want, strict=True)):
            raise AssertionError(f"{name}: losses {got} differ from one process's {want}")
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args["warmup"] + args["steps"]):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            ids = _batch(i + 2, args)
            comm.barrier(group=world)
            t0 = time.perf_counter()
            variants[name](ids)
            dt = torch.tensor([time.perf_counter() - t0])
            comm.all_reduce(dt, "max", group=world)
            if i >= args["warmup"]:
                times[name].append(float(dt))
    return {"rank": world.rank, "times": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", default="2")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--mlp", type=int, default=688)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", dest="kv_heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="benchmarks/results")
    ns = parser.parse_args()
    args = vars(ns)
    if ns.quick:
        args |= {"layers": 2, "hidden": 64, "mlp": 128, "vocab": 128, "seq": 32}
        args |= {"steps": 3, "warmup": 1}
    rows, raw = [], {}
    for t in [int(v) for v in str(args["tp"]).split(",")]:
        pool = plait.RankPool(t, timeout=600)
        try:
            results = pool.run(run_rank, args, timeout=3600)
        finally:
            pool.close()
        raw[t] = results
        med = {n: statistics.median(v) for n, v in results[0]["times"].items()}
        for name, value in med.items():
            rows.append(
                {
                    "tp": t,
                    "variant": name,
                    "step_ms": 1e3 * value,
                    "vs_torch": value / med["torch tp"],
                }
            )
    out = Path(args["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "hf_tp.json").write_text(json.dumps({"args": args, "rows": rows, "raw": raw}, indent=1))
    lines = [
        f"LlamaForCausalLM {args['layers']} layers, hidden {args['hidden']}, MLP {args['mlp']}, "
        f"{args['heads']} heads / {args['kv_heads']} kv heads, vocab {args['vocab']}, sequence "
        f"{args['seq']}, batch {args['batch']}, fp32; medians of {args['steps']} steps",
        "",
        "| tp | variant | step ms | / torch tp |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['tp']} | {r['variant']} | {r['step_ms']:.1f} | {r['vs_torch']:.2f} |")
    (out / "hf_tp.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
