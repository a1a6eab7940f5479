"""Compiled against eager step time: plait DDP and FSDP beside PyTorch DDP and FSDP2.

    PYTHONPATH=. python benchmarks/compile.py              # 2 ranks, CPU inductor, a few min
    PYTHONPATH=. python benchmarks/compile.py --quick      # fewer steps: a smoke test

Local ranks (``plait.RankPool``, gloo on loopback), one intra-op thread per rank. The model
is plait's GPT (4 layers, width 128, 4 heads, vocabulary 512, sequence 64, float32), a
micro-batch of 8 sequences per rank, SGD. Eight variants are built on every rank from the
same seed:

- ``plait ddp`` / ``plait fsdp``: ``plait.prepare(model, opt, strategy=...)``;
- ``torch ddp``: ``torch.nn.parallel.DistributedDataParallel(model)``;
- ``torch fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every block, then the root;

each eager and compiled (``torch.compile(wrapped)`` after wrapping, the default inductor
backend; PyTorch's DDP under compile splits the graph at its buckets, "DDPOptimizer").
Compilation happens in the warm-up steps (their time is reported apart); then the variants
take one step each in a rotating order, so machine noise hits all alike. A timed step is
``zero_grad`` + forward + loss + ``backward`` + ``step``, after a barrier; the step time is
the slowest rank's, the table shows medians and each compiled variant's ratio to its eager
self. After the warm-up every compiled variant's loss is checked against its eager twin's.

Writes ``benchmarks/results/compile.json`` and ``compile.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import torch.distributed as dist  # noqa: E402

import plait  # noqa: E402
from plait.models import GPT, GPTConfig  # noqa: E402
from plait.models.gpt import loss as gpt_loss  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"
STRATEGIES = ("plait ddp", "plait fsdp", "torch ddp", "torch fsdp2")


def config() -> GPTConfig:
    return GPTConfig(vocab=512, layers=4, heads=4, width=128, seq_len=64)


def build(name: str, compiled: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(config())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if name in ("plait ddp", "plait fsdp"):
        wrapped, opt2 = plait.prepare(model, opt, strategy=name.removeprefix("plait "))
        assert opt2 is not None
        module, opt = wrapped, opt2
    elif name == "torch ddp":
        module = torch.nn.parallel.DistributedDataParallel(model)
    elif name == "torch fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        module, opt = model, torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        raise ValueError(f"unknown variant {name!r}; use one of {STRATEGIES}")
    return (torch.compile(module) if compiled else module), opt


def batch(micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    t = torch.randint(0, config().vocab, (micro, config().seq_len + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _step(module: torch.nn.Module, opt: torch.optim.Optimizer, x: Any, y: Any) -> float:
    opt.zero_grad(set_to_none=True)
    loss = gpt_loss(module(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


def _slowest(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, dist.ReduceOp.MAX)
    return t.tolist()


def race(warmup: int, steps: int, micro: int) -> dict[str, Any]:
    """Runs on every rank: build each variant, warm it up (compiling), time the rest."""
    torch.set_num_threads(1)
    torch._dynamo.reset()
    x, y = batch(micro)
    variants: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    warm_s: dict[str, float] = {}
    first_loss: dict[str, float] = {}
    errors: dict[str, str] = {}
    for name in STRATEGIES:
        for compiled in (False, True):
            key = f"{name}{' + compile' if compiled else ''}"
            try:
                module, opt = build(name, compiled)
                dist.barrier()
                t0 = time.perf_counter()
                first_loss[key] = _step(module, opt, x, y)
                for _ in range(warmup - 1):
                    _step(module, opt, x, y)
                warm_s[key] = time.perf_counter() - t0
                variants[key] = (module, opt)
            except Exception as exc:  # recorded; the race goes on without it
                errors[key] = f"{type(exc).__name__}: {exc}"[:500]
    times: dict[str, list[float]] = {k: [] for k in variants}
    keys = list(variants)
    for i in range(steps):
        shift = i % len(keys)
        for key in keys[shift:] + keys[:shift]:
            module, opt = variants[key]
            dist.barrier()
            t0 = time.perf_counter()
            _step(module, opt, x, y)
            times[key].append(time.perf_counter() - t0)
    slowest = {k: _slowest(v) for k, v in times.items()}
    warm = dict(zip(warm_s, _slowest(list(warm_s.values())), strict=True))
    return {
        "median_ms": {k: statistics.median(v) * 1e3 for k, v in slowest.items()},
        "steps_ms": {k: [t * 1e3 for t in v] for k, v in slowest.items()},
        "warmup_s": warm,
        "first_loss": first_loss,
        "errors": errors,
        "params": sum(p.numel() for p in GPT(config()).parameters()),
    }


def markdown(res: dict[str, Any], world: int, args: argparse.Namespace) -> str:
    med = res["median_ms"]
    lines = [
        f"# Compiled vs eager at {world} ranks (CPU, gloo, inductor)",
        "",
        f"plait's GPT ({res['params'] / 1e6:.1f}M parameters, 4 layers, width 128, sequence "
        f"64, float32), micro-batch {args.micro} per rank, SGD; torch {torch.__version__}, "
        f"{os.cpu_count()} cores; median of {args.steps} interleaved steps after {args.warmup} "
        f"warm-up steps (compilation included in those); slowest rank.",
        "",
        "| strategy | eager ms | compiled ms | compiled / eager | warm-up s (compiled) |",
        "|---|---|---|---|---|",
    ]

    def fmt(v: float | None, spec: str = ".1f") -> str:
        return "-" if v is None else format(v, spec)

    for name in STRATEGIES:
        eager, comp = med.get(name), med.get(f"{name} + compile")
        ratio = comp / eager if eager and comp else None
        warm = res["warmup_s"].get(f"{name} + compile")
        lines.append(f"| {name} | {fmt(eager)} | {fmt(comp)} | {fmt(ratio, '.2f')} | {fmt(warm)} |")
    for key, err in res["errors"].items():
        lines.append(f"\n{key} failed: {err}")
    losses = res["first_loss"]
    same = {
        name: abs(losses[name] - losses[f"{name} + compile"])
        for name in STRATEGIES
        if name in losses and f"{name} + compile" in losses
    }
    lines += [
        "",
        "First-step loss, compiled minus eager: "
        + ", ".join(f"{k} {v:.1e}" for k, v in same.items())
        + ".",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro", type=int, default=8, help="sequences per rank")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--quick", action="store_true", help="few steps: a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.warmup, args.steps = 2, 3
    started = time.perf_counter()
    with plait.RankPool(args.world, timeout=600) as pool:
        res = pool.run(race, args.warmup, args.steps, args.micro, timeout=3600)[0]
    res["seconds"] = time.perf_counter() - started
    res["args"] = {k: str(v) for k, v in vars(args).items()}
    res["torch"] = torch.__version__
    res["cores"] = os.cpu_count()
    text = markdown(res, args.world, args)
    print(text)
    if not args.quick:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "compile.json").write_text(json.dumps(res, indent=1))
        (args.out / "compile.md").write_text(text)
        print(f"wrote {args.out / 'compile.md'} and compile.json")


if __name__ == "__main__":
    main()
