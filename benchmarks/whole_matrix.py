"""Whole-matrix optimizers: what parameter ownership costs and saves, on plait's GPT or
a Hugging Face Llama.

    .venv/bin/python benchmarks/whole_matrix.py                  # worlds 2 and 4, ~3 min
    .venv/bin/python benchmarks/whole_matrix.py --model llama    # LlamaForCausalLM
    .venv/bin/python benchmarks/whole_matrix.py --worlds 2 --steps 3 --out /tmp/wm  # smoke

Local ranks (``plait.RankPool``, gloo on loopback), one intra-op thread per rank, float32,
plait's GPT or (``--model llama``) a ``LlamaForCausalLM`` built from its config (4 heads, 2
key/value heads, MLP width 2x, untied head; random init) (``--width``, ``--layers``;
vocabulary 512, sequence 64, 8 sequences per rank). Results go to ``whole_matrix.*``
(GPT) or ``whole_matrix_llama.*``.
Muon (lr 0.02, momentum 0.95) for the blocks' hidden matrices and AdamW (lr 1e-3) for the
rest, as Muon is used, or AdamW for everything. Variants, each on every rank from the same
seed:

- ``ddp muon``: plait DDP and the two optimizers as given: Muon's state replicated;
- ``zero2 muon``: ``plait.prepare(model, [muon, adamw], strategy="zero2")``: Muon by
  parameter ownership, AdamW as a ZeroOptimizer;
- ``fsdp muon``: the same under ``strategy="fsdp"`` (one unit per block);
- ``zero2 adamw``: AdamW on every parameter as a ZeroOptimizer (flat shards): the
  element-wise baseline.

Per variant and rank: the optimizer state bytes this rank holds (every state tensor of the
optimizers it was given back; for a ZeroOptimizer its local optimizer's), the bytes it sent
in one step (``plait.comm.stats``, the ``ring`` algorithm everywhere so every byte is
counted) and the median step time (``zero_grad`` + forward + backward + both steps, the
slowest rank's, after 2 warm-up steps; the variants take turns step by step). Writes
``<out>/whole_matrix.json`` and ``<out>/whole_matrix.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

import plait

VARIANTS = ("ddp muon", "zero2 muon", "fsdp muon", "zero2 adamw")
HIDDEN = re.compile(r"blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(fc1|fc2))\.weight")
VOCAB, SEQ, PER_RANK = 512, 64, 8


LLAMA_HIDDEN = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight"
)


def _model(kind: str, width: int, layers: int) -> tuple[Any, re.Pattern[str], type]:
    """The model (same seed on every rank), the names Muon takes, the block class."""
    torch.manual_seed(0)
    if kind == "llama":  # a Hugging Face Llama from its config, random init
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=width,
            intermediate_size=2 * width,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            tie_word_embeddings=False,
        )
        model = LlamaForCausalLM(config)
        return model, LLAMA_HIDDEN, type(model.model.layers[0])
    from plait.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab=VOCAB, layers=layers, heads=4, width=width, seq_len=SEQ))
    return model, HIDDEN, type(model.blocks[0])


def _logits(runner: Any, ids: torch.Tensor) -> torch.Tensor:
    out = runner(ids)
    return out.logits if hasattr(out, "logits") else out


def _build(
    variant: str, width: int, layers: int, kind: str = "gpt"
) -> tuple[Any, list[torch.optim.Optimizer]]:
    model, hidden_names, block = _model(kind, width, layers)
    named = list(model.named_parameters())
    if variant.endswith("adamw"):
        optimizers: list[torch.optim.Optimizer] = [torch.optim.AdamW(model.parameters(), lr=1e-3)]
    else:
        hidden = [p for n, p in named if hidden_names.fullmatch(n)]
        rest = [p for n, p in named if not hidden_names.fullmatch(n)]
        optimizers = [
            torch.optim.Muon(hidden, lr=0.02, momentum=0.95),
            torch.optim.AdamW(rest, lr=1e-3),
        ]
    strategy = variant.split()[0]
    options: dict[str, Any] = {"algorithm": "ring"}
    if strategy == "fsdp":
        options = {"algorithm": "ring", "wrap": {block}}
    if strategy == "ddp":
        return plait.DistributedDataParallel(model, algorithm="ring"), optimizers
    runner, out = plait.prepare(model, optimizers, strategy=strategy, **options)
    return runner, list(out)


def _state_bytes(optimizers: list[torch.optim.Optimizer]) -> int:
    total = 0
    for o in optimizers:
        inner = getattr(o, "optim", o)  # a ZeroOptimizer's local optimizer
        for entry in inner.state.values():
            for v in entry.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    total += v.numel() * v.element_size()
    return total


def _sent() -> int:
    return sum(s.bytes_sent for s in plait.comm.stats().values())


def rank_main(width: int, layers: int, steps: int, kind: str = "gpt") -> dict[str, Any]:
    torch.set_num_threads(1)
    world = plait.world()
    built = {v: _build(v, width, layers, kind) for v in VARIANTS}
    g = torch.Generator().manual_seed(world.rank)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    sent: dict[str, int] = {}
    for step in range(steps + 2):
        order = VARIANTS[step % len(VARIANTS) :] + VARIANTS[: step % len(VARIANTS)]
        for v in order:
            runner, optimizers = built[v]
            ids = torch.randint(0, VOCAB, (PER_RANK, SEQ + 1), generator=g)
            plait.comm.barrier()
            plait.comm.reset_stats()
            t0 = time.perf_counter()
            for o in optimizers:
                o.zero_grad()
            logits = _logits(runner, ids[:, :-1])
            F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
            for o in optimizers:
                o.step()
            elapsed = torch.tensor([time.perf_counter() - t0])
            sent[v] = _sent()
            plait.comm.all_reduce(elapsed, "max")
            if step >= 2:
                times[v].append(float(elapsed))
    numel = sum(p.numel() for p in _build("ddp muon", width, layers, kind)[0].parameters())
    return {
        "rank": world.rank,
        "numel": numel,
        "state_bytes": {v: _state_bytes(built[v][1]) for v in VARIANTS},
        "sent_bytes": sent,
        "median_s": {v: statistics.median(times[v]) for v in VARIANTS},
    }


def table(results: dict[str, Any]) -> str:
    lines = [
        "| world | variant | optimizer state per rank (max, KiB) | sent per step per rank "
        "(max, KiB) | step (ms, median) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for world, ranks in results["worlds"].items():
        for v in VARIANTS:
            state = max(r["state_bytes"][v] for r in ranks) / 1024
            sent = max(r["sent_bytes"][v] for r in ranks) / 1024
            ms = ranks[0]["median_s"][v] * 1e3
            lines.append(f"| {world} | {v} | {state:,.0f} | {sent:,.0f} | {ms:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--model", default="gpt", choices=["gpt", "llama"], help="plait's GPT or a HF Llama"
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    results: dict[str, Any] = {
        "width": args.width,
        "layers": args.layers,
        "steps": args.steps,
        "model": args.model,
        "cores": os.cpu_count(),
        "worlds": {},
    }
    for world in (int(w) for w in args.worlds.split(",")):
        with plait.RankPool(world) as pool:
            results["worlds"][world] = pool.run(
                rank_main, args.width, args.layers, args.steps, args.model, timeout=1200
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "whole_matrix" if args.model == "gpt" else f"whole_matrix_{args.model}"
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    numel = results["worlds"][next(iter(results["worlds"]))][0]["numel"]
    what = "plait's GPT" if args.model == "gpt" else "a Hugging Face Llama (random init)"
    text = (
        f"# Whole-matrix optimizers: state, bytes, time\n\n{what} (width {args.width}, "
        f"{args.layers} layers, {numel:,} parameters, float32), 8 sequences of 64 per rank, "
        f"local ranks on {results['cores']} cores, gloo, ring collectives; "
        f"`benchmarks/whole_matrix.py`.\n\n{table(results)}\n"
    )
    (out / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
