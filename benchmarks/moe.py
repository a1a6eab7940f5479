"""plait's expert parallelism against the same MoE GPT with every expert on every rank, and
against DeepSpeed's MoE layer when DeepSpeed imports.

    .venv/bin/python benchmarks/moe.py                     # ep 2 and 4, about a minute
    PYTHONPATH=. /tmp/dsvenv/bin/python benchmarks/moe.py  # the same, with DeepSpeed's layer

(``/tmp/dsvenv``: a separate venv that sees plait's venv's torch through a ``.pth`` file and
has ``DS_BUILD_OPS=0 pip install deepspeed --no-deps`` plus its pure-Python dependencies;
nothing is installed into plait's venv.)

Local ranks (``plait.RankPool``, gloo on loopback), one intra-op thread per rank; world =
ep (no extra data parallelism). The model is ``plait.models.GPT`` with MoE blocks
(``moe_every=2``: blocks 1 and 3 of 4), width 128, 4 heads, sequence 64, vocabulary 96,
8 experts of hidden width 512, top-2, capacity factor 2, ``second_expert="random"``, fp32;
2 sequences per rank, Adam. Variants:

- ``plait ep``: ``plait.moe.prepare_ep(model, opt, mesh=Mesh(ep=p))``: E/p experts per rank,
  dispatch/combine all-to-alls (``auto``), non-expert gradients averaged over the ranks;
- ``replicated``: the same model, every expert on every rank, under plait's DDP (all
  gradients, experts included, all-reduced): the "no expert parallelism" anchor;
- ``deepspeed moe``: each MoE block's ``mlp`` is ``deepspeed.moe.layer.MoE(hidden_size,
  expert=FeedForward, num_experts=8, ep_size=p, k=2, capacity_factor=2, min_capacity=4,
  drop_tokens=True)`` (its ``l_aux`` added to the loss with weight 0.01), the non-expert
  gradients all-reduced with ``torch.distributed.all_reduce`` (the part DeepSpeed's engine
  would do). Its gating is DeepSpeed's (Gumbel second expert, capacity ``2*cf*S/E``), so
  drops differ a little from plait's; it is a cost anchor, not an equivalence.

Step time: warm-up steps, then the variants take turns step by step (rotating order); a
step is ``zero_grad`` + forward + loss + ``backward`` + ``step`` after a barrier, its time
the slowest rank's; medians. Bytes: one more step of ``plait ep`` on the ring all-to-all
counts what rank 0 sent (``plait.comm.stats``) against ``sum over MoE layers of
(2 rows_out + 2 rows_in) * width * 4`` from the layers' statistics.

Writes ``<out>/moe.json`` and ``<out>/moe.md``.
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
from torch.nn import functional as F

import plait
import plait.moe
from plait import comm
from plait.models.gpt import GPT, FeedForward, GPTConfig, MoEConfig


def _config(args: dict[str, Any], algorithm: str = "auto") -> GPTConfig:
    moe = MoEConfig(num_experts=args["experts"], top_k=2, capacity_factor=2.0, algorithm=algorithm)
    return GPTConfig(
        vocab=96, layers=4, heads=4, width=args["width"], seq_len=64, moe=moe, moe_every=2
    )


def _batch(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 96, (batch, 65), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _plait_ep(cfg: GPTConfig) -> tuple[nn.Module, Any]:
    mesh = plait.Mesh(ep=plait.world().size)
    model = GPT(cfg)
    model, opt = plait.moe.prepare_ep(model, torch.optim.Adam(model.parameters()), mesh=mesh)
    return model, opt


def _replicated(cfg: GPTConfig) -> tuple[nn.Module, Any]:
    model = plait.DistributedDataParallel(GPT(cfg))
    return model, torch.optim.Adam(model.parameters())


class _DeepSpeedMLP(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, aux, _ = self.layer(x)
        self.aux = aux
        return out


def _deepspeed(cfg: GPTConfig) -> tuple[nn.Module, Any, Any]:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE as DSMoE

    p = plait.world().size
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the initialised torch.distributed
    model = GPT(cfg)
    for i, block in enumerate(model.blocks):
        if (i + 1) % cfg.moe_every == 0:
            layer = DSMoE(
                cfg.width,
                expert=FeedForward(cfg),
                num_experts=cfg.moe.num_experts,  # type: ignore[union-attr]
                ep_size=p,
                k=2,
                capacity_factor=2.0,
                eval_capacity_factor=2.0,
                min_capacity=4,
                drop_tokens=True,
            )
            layer.set_deepspeed_parallelism()
            block.mlp = _DeepSpeedMLP(layer)
    assert deepspeed is not None
    experts = {id(q) for n, q in model.named_parameters() if ".deepspeed_moe.experts." in n}
    others = [q for q in model.parameters() if id(q) not in experts]
    opt = torch.optim.Adam(model.parameters())

    def sync() -> None:
        flat = torch.cat([q.grad.reshape(-1) for q in others])  # type: ignore[union-attr]
        dist.all_reduce(flat)
        flat /= p
        offset = 0
        for q in others:
            q.grad.copy_(flat[offset : offset + q.numel()].view_as(q))  # type: ignore[union-attr]
            offset += q.numel()

    return model, opt, sync


def run_rank(args: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    world = plait.world()
    cfg = _config(args)
    variants: dict[str, Any] = {}
    model, opt = _plait_ep(cfg)
    variants["plait ep"] = (model, opt, None)
    model, opt = _replicated(cfg)
    variants["replicated"] = (model, opt, None)
    ds_error = ""
    try:
        variants["deepspeed moe"] = _deepspeed(cfg)
    except Exception as exc:  # DeepSpeed absent or failing on CPU: say so in the table
        ds_error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"

    def step(name: str, i: int) -> float:
        model, opt, sync = variants[name]
        x, y = _batch(1000 * world.rank + i, args["batch"])
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        if name == "deepspeed moe":
            loss = loss + 0.01 * sum(b.mlp.aux for b in model.blocks if hasattr(b.mlp, "aux"))
        loss.backward()
        if sync is not None:
            sync()
        opt.step()
        return float(loss.detach())

    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args["warmup"] + args["steps"]):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            comm.barrier(group=world)
            t0 = time.perf_counter()
            step(name, i)
            dt = torch.tensor([time.perf_counter() - t0])
            comm.all_reduce(dt, "max", group=world)
            if i >= args["warmup"]:
                times[name].append(float(dt))
    # bytes: one step of plait ep on the ring all-to-all
    model, opt = _plait_ep(_config(args, algorithm="ring"))
    x, y = _batch(7, args["batch"])
    comm.reset_stats()
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    sent = comm.stats().get(("all_to_all", "ring"))
    stats = plait.moe.collect(model)
    theory = sum((2 * s.rows_out + 2 * s.rows_in) * cfg.width * 4 for s in stats.values())
    return {
        "times": times,
        "ds_error": ds_error,
        "a2a_sent": 0 if sent is None else sent.bytes_sent,
        "a2a_calls": 0 if sent is None else sent.calls,
        "a2a_theory": theory,
        "drop_rate": {k: s.drop_rate for k, s in stats.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eps", default="2,4")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = vars(parser.parse_args())
    rows = []
    for ep in [int(e) for e in args["eps"].split(",")]:
        with plait.RankPool(ep, timeout=600) as pool:
            res = pool.run(run_rank, args, timeout=900)[0]
        med = {n: statistics.median(t) for n, t in res["times"].items()}
        rows.append({"ep": ep, "median_s": med, **{k: v for k, v in res.items() if k != "times"}})
        print(ep, med, res["a2a_sent"], res["a2a_theory"], res["ds_error"])
    out = Path(args["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe.json").write_text(json.dumps({"args": args, "rows": rows}, indent=2))
    lines = [
        "| ep | plait ep (ms) | replicated (ms) | plait / replicated | deepspeed moe (ms) "
        "| plait / deepspeed | all-to-all bytes sent (rank 0) | theory | calls |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        m = r["median_s"]
        ds = m.get("deepspeed moe")
        lines.append(
            f"| {r['ep']} | {m['plait ep'] * 1e3:.1f} | {m['replicated'] * 1e3:.1f} | "
            f"{m['plait ep'] / m['replicated']:.2f}x | "
            + (f"{ds * 1e3:.1f} | {m['plait ep'] / ds:.2f}x" if ds else "n/a | n/a")
            + f" | {r['a2a_sent']} | {r['a2a_theory']} | {r['a2a_calls']} |"
        )
    errors = {r["ep"]: r["ds_error"] for r in rows if r["ds_error"]}
    if errors:
        lines.append("")
        lines += [f"DeepSpeed at ep {ep}: {e}" for ep, e in errors.items()]
    (out / "moe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
