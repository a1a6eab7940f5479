"""PTD-P with MoE blocks (dp 2 x ep 2 through ``compose``) against plait's own expert
parallelism (``prepare(strategy="ep")`` on Mesh(ep=2, dp=2)): does composing add cost?

    .venv/bin/python benchmarks/ptdp_moe.py          # ~1 minute on 2 cores

The same MoE GPT (4 layers, width 128, 4 heads, sequence 64, vocabulary 512, GShard top-2
of 4 experts in every second block, capacity factor 2), the same global batch of 16 on 4
ranks (4 rows per rank), fp32 Adam. Each run: the slowest rank's median step (zero_grad,
forward + backward, optimizer step) over 7 steps after 2 warm-up steps; the two layouts
take turns for 3 rounds and each keeps its fastest round (other jobs' load only slows a
round). Writes benchmarks/results/ptdp_moe.md. 4 ranks share 2 cores here.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from torch.nn import functional as F

import plait
from plait.models import GPT, GPTConfig
from plait.models.gpt import MoEConfig
from plait.strategies.compose import compose

CFG = GPTConfig(
    vocab=512,
    layers=4,
    heads=4,
    width=128,
    seq_len=64,
    moe=MoEConfig(num_experts=4, top_k=2, capacity_factor=2.0),
)
BATCH, STEPS, WARMUP, ROUNDS = 16, 7, 2, 3
RESULTS = Path(__file__).parent / "results"


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(0, CFG.vocab, (BATCH, CFG.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _run(kind: str) -> float:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = GPT(CFG)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if kind == "ptdp":
        ptdp = compose(model, opt, mesh=plait.Mesh(pp=1, dp=2, ep=2, tp=1), microbatches=1)
        opt = ptdp.optimizer

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            opt.zero_grad()
            ptdp.step(x, y)
            opt.step()

    else:
        model, opt = plait.prepare(model, opt, strategy="ep", mesh=plait.Mesh(ep=2, dp=2))
        r = model.plait_expert_parallel.batch_rank
        n = BATCH // 4

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            opt.zero_grad()
            logits = model(x[r * n : (r + 1) * n])
            F.cross_entropy(
                logits.reshape(-1, CFG.vocab), y[r * n : (r + 1) * n].reshape(-1)
            ).backward()
            opt.step()

    times = []
    for i in range(WARMUP + STEPS):
        x, y = _batch(i)
        t = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - t)
    return statistics.median(times[WARMUP:])


def main() -> None:
    best: dict[str, float] = {}
    rounds: dict[str, list[float]] = {}
    for _ in range(ROUNDS):
        for kind in ("ep", "ptdp"):
            t = max(plait.spawn(_run, world_size=4, args=(kind,), timeout=300))
            rounds.setdefault(kind, []).append(t)
            best[kind] = min(best.get(kind, t), t)
    ratio = best["ptdp"] / best["ep"]
    lines = [
        "# PTD-P with MoE against plait's expert parallelism",
        "",
        "`.venv/bin/python benchmarks/ptdp_moe.py`; 4 ranks on 2 cores; each layout's fastest "
        f"of {ROUNDS} rounds (median of {STEPS} steps, slowest rank).",
        "",
        "| layout | step (ms) | rounds (ms) |",
        "| --- | --- | --- |",
        *(
            f"| {label} | {best[k] * 1e3:.1f} | {', '.join(f'{t * 1e3:.1f}' for t in rounds[k])} |"
            for k, label in (
                ("ep", "prepare(strategy='ep'), Mesh(ep=2, dp=2)"),
                ("ptdp", "compose, Mesh(pp=1, dp=2, ep=2, tp=1)"),
            )
        ),
        "",
        f"compose / ep: {ratio:.2f}",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ptdp_moe.md").write_text(text)
    (RESULTS / "ptdp_moe.json").write_text(json.dumps({"best_s": best, "rounds_s": rounds}))


if __name__ == "__main__":
    main()
