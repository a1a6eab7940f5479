"""The split backward's cost: ``I`` + ``W`` against the fused ``B``, per layer type, in one
process.

    .venv/bin/python benchmarks/pipeline_split.py                  # width 512, 8 heads
    .venv/bin/python benchmarks/pipeline_split.py --quick --out /tmp/split

The units are those of ``benchmarks/pipeline.py --width 512 --heads 8``: plait's GPT (6
layers, sequence 64, vocabulary 96, fp32) on one micro-batch of 2 sequences (16 in m = 8),
one intra-op thread. Each unit (a layer of each type with its shape in the model, a whole
block, the embedding, the head, a stage of three blocks) runs forward then backward,
two ways taking turns: fused (``B``: one ``torch.autograd.backward``), and split
(:mod:`plait.strategies.pipeline.deferred`: ``I``, then ``W``). The backward actions are
timed by a :class:`~plait.trace.Tracer` span each, as the pipeline runtime times them
(wall clock), and by the thread's CPU time (``time.thread_time_ns``: one intra-op thread,
so the whole action; other processes taking the core do not inflate it, which matters on
a shared machine: the first columns); the table gives medians over ``--repeats`` and
the median of ``(I + W) / B`` over the runs (each split run against the fused run beside
it). Gradients of the split run are checked against the fused run's (relative 1e-5 in
fp32); after that first run gradients accumulate, as they do over a step's micro-batches.

Writes ``<out>/pipeline_split.json`` and ``<out>/pipeline_split.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.models import GPT, GPTConfig
from plait.models.gpt import loss as gpt_loss
from plait.models.gpt import pipeline_plan
from plait.strategies.pipeline import Stage, layers_of
from plait.strategies.pipeline.deferred import Deferred, SplitBackward
from plait.trace import Tracer


def _units(args: dict[str, Any]) -> list[tuple[str, nn.Module, Callable[[], Any], bool]]:
    """(name, module, input maker, ends in the loss) for every unit measured."""
    cfg = GPTConfig(
        vocab=96, layers=6, heads=args["heads"], width=args["width"], seq_len=args["seq"]
    )
    gpt = GPT(cfg)
    layers = layers_of(gpt, pipeline_plan(gpt))
    b, s, w = args["mb"], args["seq"], args["width"]
    block: Any = gpt.blocks[0]

    def act(width: int = w) -> Callable[[], torch.Tensor]:
        return lambda: torch.randn(b, s, width).requires_grad_(True)

    def ids() -> torch.Tensor:
        return torch.randint(0, cfg.vocab, (b, s))

    return [
        ("Linear qkv", block.attn.qkv, act(), False),
        ("Linear proj", block.attn.proj, act(), False),
        ("Linear fc1", block.mlp.fc1, act(), False),
        ("Linear fc2", block.mlp.fc2, act(4 * w), False),
        ("Linear head", gpt.head, act(), False),
        ("LayerNorm", block.ln1, act(), False),
        ("Embedding tok", gpt.tok, ids, False),
        ("block", block, act(), False),
        ("embed (tok + pos)", Stage(layers[:1], 0), ids, False),
        ("head (ln_f, head, loss)", Stage(layers[-1:], 0), act(), True),
        ("stage: 3 blocks", Stage(layers[1:4], 0), act(), False),
    ]


def _measure(
    name: str, module: nn.Module, make: Callable[[], Any], lossy: bool, args: dict[str, Any]
) -> dict[str, Any]:
    splitter = SplitBackward(module)
    tracer = Tracer()
    cpu: dict[str, list[float]] = {"B": [], "I": [], "W": []}

    @contextlib.contextmanager
    def timed(kind: str) -> Iterator[None]:
        """A tracer span (wall clock) and this thread's CPU time, which other processes
        taking the core do not inflate."""
        t0 = time.thread_time_ns()
        with tracer.span(kind):
            yield
        cpu[kind].append((time.thread_time_ns() - t0) / 1e6)

    x = make()
    target = torch.randint(0, 96, (args["mb"], args["seq"]))

    def output(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if lossy:
            return gpt_loss(y, target), None
        return y, torch.ones_like(y)

    def fused() -> dict[str, torch.Tensor]:
        y, g = output(module(x))
        with timed("B"):
            torch.autograd.backward(y, g)
        return {n: p.grad for n, p in module.named_parameters() if p.grad is not None}

    def split() -> dict[str, torch.Tensor]:
        kept = Deferred()
        with splitter.deferring(kept):
            y, g = output(module(x))
        with timed("I"), splitter.deferring(kept):
            torch.autograd.backward(y, g)
        with timed("W"):
            kept.apply()
        return {n: p.grad for n, p in module.named_parameters() if p.grad is not None}

    module.zero_grad(set_to_none=True)
    want = {n: g.clone() for n, g in fused().items()}
    module.zero_grad(set_to_none=True)
    got = split()
    for n in want:
        err = (want[n] - got[n]).abs().max() / want[n].abs().max().clamp_min(1e-30)
        if err > 1e-5:
            raise AssertionError(f"{name}: {n} differs by {float(err):.2e} (relative)")
    # gradients accumulate from here on, as over a pipeline step's micro-batches
    for _ in range(args["warmup"]):
        fused(), split()
    tracer.clear()
    cpu = {k: [] for k in cpu}
    for i in range(args["repeats"]):
        for run in (fused, split) if i % 2 else (split, fused):
            run()
    wall: dict[str, list[float]] = {"B": [], "I": [], "W": []}
    for span in tracer.spans():
        wall[span.name].append(span.duration_ns / 1e6)
    row: dict[str, Any] = {"unit": name, "split": splitter.report.describe()}
    for clock, ms in (("cpu", cpu), ("wall", wall)):
        for k, v in ms.items():
            row[f"{k}_{clock}_ms"] = statistics.median(v)
        # each run's I + W over the B run beside it: pairs taken close in time share the load
        ratios = [(i + w) / b for i, w, b in zip(ms["I"], ms["W"], ms["B"], strict=True)]
        row[f"IW_over_B_{clock}"] = statistics.median(ratios)
    return row


def measure(args: dict[str, Any]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    for name, module, make, lossy in _units(args):
        rows.append(_measure(name, module, make, lossy, args))
        print(f"{name}: {rows[-1]}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--mb", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="benchmarks/results")
    args = vars(parser.parse_args())
    if args["quick"]:
        args |= {"width": 64, "heads": 4, "seq": 16, "repeats": 3, "warmup": 1}
    load = os.getloadavg()
    rows = measure(args)
    load_after = os.getloadavg()
    out = Path(args["out"])
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"plait's split backward against the fused one, per unit of the GPT of "
        f"`benchmarks/pipeline.py --width {args['width']} --heads {args['heads']}` (sequence "
        f"{args['seq']}, micro-batch of {args['mb']}, fp32, 1 thread); medians of "
        f"{args['repeats']} runs of each, taking turns; 1-minute load average "
        f"{load[0]:.1f} before, {load_after[0]:.1f} after, on {os.cpu_count()} cores",
        "",
        "| unit | B ms | I ms | W ms | (I + W) / B | wall: B ms | I ms | W ms | (I + W) / B |",
        "| --- " * 9 + "|",
    ]
    for r in rows:
        cells = [
            f"{r[f'{k}_{clock}_ms']:.3f}" for clock in ("cpu", "wall") for k in ("B", "I", "W")
        ]
        lines.append(
            f"| {r['unit']} | {' | '.join(cells[:3])} | {r['IW_over_B_cpu']:.2f} | "
            f"{' | '.join(cells[3:])} | {r['IW_over_B_wall']:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    (out / "pipeline_split.md").write_text(text)
    record = {"args": args, "load": [load, load_after], "rows": rows}
    (out / "pipeline_split.json").write_text(json.dumps(record, indent=1))
    print(text)


if __name__ == "__main__":
    main()
