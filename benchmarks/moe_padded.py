"""plait's MoE dispatch padded to capacity (``pad_to_capacity=True``: static all-to-all
splits, no counts all-gather, no host read) against the dropless dispatch, under expert
parallelism, side by side in one run.

    PYTHONPATH=. .venv/bin/python benchmarks/moe_padded.py            # ep 2, cf 2 and 1.25
    PYTHONPATH=. .venv/bin/python benchmarks/moe_padded.py --eps 2,4

Local ranks (``plait.RankPool``, gloo on loopback), one intra-op thread per rank; world =
ep. The model is benchmarks/moe.py's: ``plait.models.GPT`` with MoE blocks 1 and 3 of 4,
width 128, 4 heads, sequence 64, vocabulary 96, 8 experts of hidden width 512, top-2,
``second_expert="random"``, fp32, 2 sequences per rank, Adam, ``plait.moe.prepare_ep``;
the two variants differ only in ``MoEConfig(pad_to_capacity=...)``, per capacity factor.

Step time: warm-up steps, then the variants take turns step by step (rotating order); a
step is ``zero_grad`` + forward + loss + ``backward`` + ``step`` after a barrier, its time
the slowest rank's; medians and their ratio. On a CPU the padded path pays for sending and
computing the empty slots and saves little (the host read it avoids costs nothing here);
on a GPU it also saves one synchronization per MoE layer and step. Bytes: one more step of
each on the ring all-to-all after one unmeasured step (in which the padded path's ep group
agrees on its groups and capacity), what rank 0 sent (``plait.comm.stats``), all-to-alls
and all-gathers. No assertion on speed.

Writes ``<out>/moe_padded.json`` and ``<out>/moe_padded.md``.
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
import plait.moe
from plait import comm
from plait.models.gpt import GPT, GPTConfig, MoEConfig

VARIANTS = {"dropless": False, "padded": True}


def _config(cf: float, pad: bool, algorithm: str = "auto") -> GPTConfig:
    moe = MoEConfig(
        num_experts=8, top_k=2, capacity_factor=cf, algorithm=algorithm, pad_to_capacity=pad
    )
    return GPTConfig(vocab=96, layers=4, heads=4, width=128, seq_len=64, moe=moe, moe_every=2)


def _batch(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 96, (batch, 65), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _build(cfg: GPTConfig) -> tuple[Any, Any]:
    model = GPT(cfg)
    mesh = plait.Mesh(ep=plait.world().size)
    return plait.moe.prepare_ep(model, torch.optim.Adam(model.parameters()), mesh=mesh)


def run_rank(args: dict[str, Any], cf: float) -> dict[str, Any]:
    torch.set_num_threads(1)
    world = plait.world()
    variants = {name: _build(_config(cf, pad)) for name, pad in VARIANTS.items()}

    def step(name: str, i: int) -> None:
        model, opt = variants[name]
        x, y = _batch(1000 * world.rank + i, args["batch"])
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()

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
    sent: dict[str, dict[str, int]] = {}
    drop: dict[str, float] = {}
    for name, pad in VARIANTS.items():
        model, _ = _build(_config(cf, pad, algorithm="ring"))
        for i in (6, 7):  # step 7 measured (the padded path agrees on its shape in step 6)
            x, y = _batch(i, args["batch"])
            comm.reset_stats()
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        stats = comm.stats()
        sent[name] = {
            op: sum(s.bytes_sent for k, s in stats.items() if k[0] == op)
            for op in ("all_to_all", "all_gather")
        }
        layers = plait.moe.collect(model)
        drop[name] = statistics.mean(s.drop_rate for s in layers.values())
    return {"times": times, "sent": sent, "drop_rate": drop}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eps", default="2")
    parser.add_argument("--cfs", default="2,1.25", help="capacity factors")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = vars(parser.parse_args())
    rows = []
    for ep in [int(e) for e in args["eps"].split(",")]:
        with plait.RankPool(ep, timeout=600) as pool:
            for cf in [float(c) for c in args["cfs"].split(",")]:
                res = pool.run(run_rank, args, cf, timeout=900)[0]
                med = {n: statistics.median(t) for n, t in res["times"].items()}
                row = {"ep": ep, "cf": cf, "median_s": med, "sent": res["sent"]}
                rows.append(row | {"drop_rate": res["drop_rate"]})
                print(ep, cf, med, res["sent"], flush=True)
    out = Path(args["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_padded.json").write_text(json.dumps({"args": args, "rows": rows}, indent=2))
    lines = [
        "| ep | cf | dropless (ms) | padded (ms) | padded / dropless | all-to-all bytes "
        "dropless / padded (rank 0) | counts all-gather bytes dropless / padded |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        m, s = r["median_s"], r["sent"]
        lines.append(
            f"| {r['ep']} | {r['cf']} | {m['dropless'] * 1e3:.1f} | {m['padded'] * 1e3:.1f} | "
            f"{m['padded'] / m['dropless']:.2f}x | {s['dropless']['all_to_all']} / "
            f"{s['padded']['all_to_all']} | {s['dropless']['all_gather']} / "
            f"{s['padded']['all_gather']} |"
        )
    (out / "moe_padded.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
