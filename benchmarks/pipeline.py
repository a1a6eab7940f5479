"""plait's pipeline schedules against torch.distributed.pipelining on the same GPT, split
the same way.

    .venv/bin/python benchmarks/pipeline.py                 # p = 2 and 4, m = 8
    .venv/bin/python benchmarks/pipeline.py --quick --out /tmp/pp   # smoke test
    .venv/bin/python benchmarks/pipeline.py --width 512 --heads 8 --name pipeline_w512
    .venv/bin/python benchmarks/pipeline.py --pp 4 --schedules 1f1b,zbv --no-torch

Local ranks (``plait.RankPool``, gloo on loopback), one intra-op thread per rank. The model
is ``plait.models.GPT`` (default 6 layers, width 128, 4 heads, sequence 64, vocabulary 96,
untied, fp32), a global batch of 16 sequences in m = 8 micro-batches, cut by
``plait.strategies.pipeline.partition`` (by parameters) into p stages (p * 2 for the
two-chunk schedules); each stage is the same :class:`Stage` module for both libraries.

- ``plait <schedule>``: :class:`PipelineParallel` with gpipe, 1f1b, interleaved (v=2),
  zb-h1, zbv (v=2), dualpipev (v=2), Adam;
- ``torch <Schedule>``: ``PipelineStage(stage, index, n, cpu, input_args=..., output_args=...)``
  (explicit shapes: no shape-inference round) and ``ScheduleGPipe``, ``Schedule1F1B``,
  ``ScheduleInterleaved1F1B`` (rank r holds stages r, r+p), ``ScheduleZBVZeroBubble`` and
  ``ScheduleDualPipeV`` (rank r holds r and 2p-1-r; torch runs an F&B pair's halves one
  after the other too), ``scale_grads=True`` with the mean cross-entropy, Adam.

Step time: warm-up steps, then the variants take turns step by step (rotating order); a
step is ``zero_grad`` + the schedule's step + ``optimizer.step()`` after a barrier, its time
the slowest rank's; tables show medians. Fairness: every variant's first loss equals a
one-process run's (relative 1e-4). Bubble: plait's runtime records one span per action;
the measured bubble (1 - compute time / (p x step window)) is set beside the simulator
run with the measured mean cost of every (kind, stage) (and once more with the measured
mean time between two actions of a rank added after each action: "simulated + gap"),
on ``--cores`` cores shared by the ranks when there are fewer than ranks (the mean *work*
of each (kind, stage) under processor sharing: :mod:`plait.strategies.pipeline.cores`),
beside the replay (each action's own measured time, each rank's own gap, the measured
message latency: :func:`plait.strategies.pipeline.bubble_report`) and beside the formula;
"I + W over B": the split backward's cost, from the same spans (each stage's median I
plus median W over its median B, summed over stages; B from the schedule itself or
from another schedule with the same stage cut); the stage cut is plait's for that
schedule (:func:`~plait.strategies.pipeline.partition` given the schedule), which torch's
stages use too. The timeline PNG of the last measured 1F1B / ZBV / DualPipeV step at the
largest p is written next to the table, and the simulated timeline (unit costs) of every
schedule.

Writes ``<out>/<name>.json``, ``<out>/<name>.md`` (``--name``, default ``pipeline``) and
``<out>/pipeline_*.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import plait
from plait import comm
from plait.models import GPT, GPTConfig
from plait.models.gpt import loss as gpt_loss
from plait.models.gpt import pipeline_plan
from plait.strategies.pipeline import (
    Costs,
    PipelineParallel,
    Stage,
    bubble_report,
    build,
    draw_png,
    layers_of,
    partition,
    simulate,
)
from plait.strategies.pipeline.report import slots_from_spans
from plait.strategies.pipeline.schedules import loop_placement, v_placement
from plait.trace import Tracer

PLAIT = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
TORCH = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
V_SHAPED = ("zbv", "dualpipev")


def _config(args: dict[str, Any]) -> GPTConfig:
    return GPTConfig(
        vocab=96,
        layers=args["layers"],
        heads=args["heads"],
        width=args["width"],
        seq_len=args["seq"],
    )


def _batch(step: int, cfg: GPTConfig, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, cfg.vocab, (batch, cfg.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _plait(cfg: GPTConfig, name: str, group: Any, m: int, tracer: Tracer) -> Any:
    model = GPT(cfg)
    pipe = PipelineParallel(
        model,
        group=group,
        schedule=name,
        microbatches=m,
        split="schedule",  # the cut fitted to the schedule, as torch's stages get below
        plan=pipeline_plan(model),
        tracer=tracer,
    )
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad()
        loss = pipe.step(x, y)
        opt.step()
        return float(loss)

    info = {
        "bounds": [list(b) for b in pipe.partition.bounds],
        "split": {s: r.describe() for s, r in pipe.runtime.split_reports.items()},
    }
    return step, pipe.schedule, info


def _torch(cfg: GPTConfig, name: str, p: int, rank: int, m: int, batch: int) -> Any:
    from torch.distributed import pipelining as tp

    v = 2 if name in ("interleaved", *V_SHAPED) else 1
    placement = v_placement(p) if name in V_SHAPED else loop_placement(p, v)
    gpt = GPT(cfg)
    layers = layers_of(gpt, pipeline_plan(gpt))
    part = partition(layers, p * v, by="schedule", schedule=build(name, p=p, m=m))  # plait's
    mb = batch // m
    ids = torch.zeros(mb, cfg.seq_len, dtype=torch.long)
    # example tensors; requires_grad tells torch which outputs get gradients back
    act = torch.zeros(mb, cfg.seq_len, cfg.width, requires_grad=True)
    logits = torch.zeros(mb, cfg.seq_len, cfg.vocab, requires_grad=True)
    n = p * v
    stages = []
    for s, (a, b) in enumerate(part.bounds):
        if placement[s] != rank:
            continue
        module = Stage(layers[a:b], s)
        stages.append(
            tp.PipelineStage(
                module,
                s,
                n,
                torch.device("cpu"),
                input_args=(ids if s == 0 else act,),
                output_args=(logits if s == n - 1 else act,),
            )
        )
    params = [q for st in stages for q in st.submod.parameters()]
    opt = torch.optim.Adam(params, lr=1e-3)
    cls = getattr(tp, TORCH[name])
    sched = cls(stages if v > 1 else stages[0], n_microbatches=m, loss_fn=gpt_loss)
    holds_first = placement[0] == rank
    holds_last = placement[n - 1] == rank

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {}
        if holds_last:
            kwargs = {"target": y, "losses": losses}
        if holds_first:
            sched.step(x, **kwargs)
        else:
            sched.step(**kwargs)
        opt.step()
        value = torch.stack(losses).mean() if losses else torch.zeros(())
        t = value.detach().reshape(1).clone()
        comm.broadcast(t, placement[n - 1], group=plait.world())
        return float(t)

    return step


def run_rank(args: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    cfg = _config(args)
    world = plait.world()
    p, m, batch = world.size, args["m"], args["batch"]
    mesh = plait.Mesh(pp=p)
    tracers: dict[str, Tracer] = {}
    variants: dict[str, Any] = {}
    schedules: dict[str, Any] = {}
    infos: dict[str, Any] = {}
    chosen = args["schedules"]
    for name in chosen:
        tracers[name] = Tracer(rank=world.rank)
        variants[f"plait {name}"], schedules[name], infos[name] = _plait(
            cfg, name, mesh.group("pp"), m, tracers[name]
        )
    for name in chosen:
        if name in TORCH and not args["no_torch"]:
            variants[f"torch {TORCH[name]}"] = _torch(cfg, name, p, world.rank, m, batch)
    dense = GPT(cfg)
    x, y = _batch(0, cfg, batch)
    with torch.no_grad():
        want = float(gpt_loss(dense(x), y))
    for vname, step in variants.items():
        got = step(x, y)
        if abs(got - want) > 1e-4 * abs(want):
            raise AssertionError(f"{vname}: first loss {got} differs from one process's {want}")
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    spans: dict[str, list[list[Any]]] = {n: [] for n in chosen}
    for i in range(args["warmup"] + args["steps"]):
        order = names[i % len(names) :] + names[: i % len(names)]
        for vname in order:
            x, y = _batch(i + 1, cfg, batch)
            key = vname.removeprefix("plait ")
            if key in tracers:
                tracers[key].clear()
            comm.barrier(group=world)
            t0 = time.perf_counter()
            variants[vname](x, y)
            dt = torch.tensor([time.perf_counter() - t0])
            comm.all_reduce(dt, "max", group=world)
            if i >= args["warmup"]:
                times[vname].append(float(dt))
                if key in tracers:
                    spans[key].append(tracers[key].spans())
    return {
        "rank": world.rank,
        "times": times,
        "spans": spans,
        "schedules": schedules,
        "infos": infos,
    }


def _action_ms(spans: list[list[Any]]) -> dict[tuple[str, int], float]:
    """Median milliseconds of each (kind, stage) over every measured step's spans."""
    out: dict[tuple[str, int], list[float]] = {}
    for step in spans:
        for sp in step:
            if sp.stream == "compute" and sp.name in ("F", "B", "I", "W"):
                key = (sp.name, int(sp.args["stage"]))
                out.setdefault(key, []).append(sp.duration_ns / 1e6)
    return {k: statistics.median(v) for k, v in out.items()}


def _split_cost(
    name: str, actions: dict[str, dict[tuple[str, int], float]], bounds: dict[str, Any]
) -> float | None:
    """(I + W) / B of schedule ``name``, summed over its stages: B from the schedule itself
    (DualPipeV mixes both) or from another measured schedule with the same stage cut."""
    mine = actions[name]
    stages = sorted({s for k, s in mine if k == "I"})
    if not stages:
        return None
    for ref in [name, *actions]:
        if bounds[ref] != bounds[name]:
            continue
        b = actions[ref]
        if all(("B", s) in b for s in stages):
            iw = sum(mine[("I", s)] + mine[("W", s)] for s in stages)
            return iw / sum(b[("B", s)] for s in stages)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", default="2,4")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--schedules", default=",".join(PLAIT))
    parser.add_argument("--no-torch", action="store_true", help="plait's schedules only")
    parser.add_argument(
        "--cores", type=float, default=float(os.cpu_count() or 1), help="cores the ranks share"
    )
    parser.add_argument("--save-spans", default="", help="write every step's spans here")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="pipeline", help="stem of the .md and .json written")
    args = vars(parser.parse_args())
    args["schedules"] = [x for x in str(args["schedules"]).split(",") if x]
    if args["quick"]:
        args |= {"pp": "2", "width": 32, "seq": 16, "steps": 2, "warmup": 1}
    out = Path(args["out"])
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    rows = []
    for p in [int(v) for v in str(args["pp"]).split(",")]:
        pool = plait.RankPool(p, timeout=600)
        try:
            results = pool.run(run_rank, args, timeout=3600)
        finally:
            pool.close()
        r0 = results[0]
        if args["save_spans"]:  # every measured step's spans, to study the bubble offline
            raw = {
                name: [
                    [dataclasses.asdict(s) for res in results for s in res["spans"][name][k]]
                    for k in range(len(r0["spans"][name]))
                ]
                for name in args["schedules"]
            }
            Path(args["save_spans"]).with_suffix(f".p{p}.json").write_text(json.dumps(raw))
        med = {n: statistics.median(v) for n, v in r0["times"].items()}
        # per (kind, stage) medians; each stage's actions are on the rank that holds it
        actions: dict[str, dict[tuple[str, int], float]] = {}
        for name in args["schedules"]:
            actions[name] = {}
            for res in results:
                actions[name] |= _action_ms(res["spans"][name])
        bounds = {name: r0["infos"][name]["bounds"] for name in args["schedules"]}
        for name in args["schedules"]:
            sched = build(name, p=p, m=args["m"])
            reports = [
                bubble_report(
                    sched,
                    [s for res in results for s in res["spans"][name][k]],
                    cores=args["cores"],
                )
                for k in range(len(r0["spans"][name]))
            ]
            measured = statistics.median(r.measured for r in reports)
            simulated = statistics.median(r.simulated for r in reports)
            waiting = statistics.median(r.waiting for r in reports)
            with_gap = statistics.median(r.simulated_with_gap for r in reports)
            gap_ms = 1e3 * statistics.median(r.gap_seconds for r in reports)
            replayed = statistics.median(r.replayed for r in reports)
            latency_ms = 1e3 * statistics.median(r.latency_seconds for r in reports)
            shared = [r.simulated_on_cores for r in reports if r.simulated_on_cores is not None]
            on_cores = statistics.median(shared) if shared else None
            torch_name = f"torch {TORCH[name]}" if f"torch {TORCH.get(name)}" in med else None
            rows.append(
                {
                    "p": p,
                    "m": args["m"],
                    "schedule": name,
                    "plait_ms": 1e3 * med[f"plait {name}"],
                    "torch_ms": 1e3 * med[torch_name] if torch_name else None,
                    "ratio": med[f"plait {name}"] / med[torch_name] if torch_name else None,
                    "vs_1f1b": None,
                    "sim_vs_1f1b": None,
                    "bubble_measured": measured,
                    "waiting": waiting,
                    "bubble_simulated_with_gap": with_gap,
                    "gap_ms": gap_ms,
                    "bubble_replayed": replayed,
                    "latency_ms": latency_ms,
                    "bubble_simulated_on_cores": on_cores,
                    "bubble_simulated": simulated,
                    "bubble_formula": reports[-1].formula,
                    "sim_ms": 1e3 * statistics.median(r.simulated_seconds for r in reports),
                    "bounds": bounds[name],
                    "iw_over_b": _split_cost(name, actions, bounds),
                    "split": {
                        s: d for res in results for s, d in res["infos"][name]["split"].items()
                    },
                }
            )
            top = max(int(v) for v in str(args["pp"]).split(","))
            if p == top and name in ("1f1b", "zbv", "dualpipev"):
                last = [s for res in results for s in res["spans"][name][-1]]
                slots = slots_from_spans(last)
                draw_png(
                    slots,
                    str(out / f"pipeline_{name}_p{p}.png"),
                    p=p,
                    unit="seconds",
                    title=f"plait {name}, p={p}, m={args['m']} (measured)",
                )
        base = [r for r in rows if r["p"] == p and r["schedule"] == "1f1b"]
        for r in rows:
            if r["p"] == p and base:
                r["sim_vs_1f1b"] = r["sim_ms"] / base[0]["sim_ms"]
                r["vs_1f1b"] = r["plait_ms"] / base[0]["plait_ms"]
            elif r["p"] == p:
                r["vs_1f1b"] = None
    top = max(int(v) for v in str(args["pp"]).split(","))
    for name in args["schedules"]:  # the textbook pictures: unit costs, simulated
        sched = build(name, p=top, m=args["m"])
        sim = simulate(sched, Costs.per_chunk(sched.v))
        draw_png(
            sim.slots,
            str(out / f"pipeline_sim_{name}_p{top}.png"),
            p=top,
            unit="time (F of a whole stage = 1)",
            title=f"{name}, p={top}, m={args['m']}: simulated, bubble {100 * sim.bubble:.1f}%",
        )
    lines = [
        f"GPT {args['layers']} layers, width {args['width']}, {args['heads']} heads, sequence "
        f"{args['seq']}, vocab 96, batch {args['batch']} in m={args['m']} micro-batches, fp32; "
        f"plait on its default transport (shared memory between local ranks), PyTorch on "
        f"gloo, 1 thread per rank, shared {os.cpu_count()}-core machine (1-minute load "
        f"average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after); medians of "
        f"{args['steps']} steps",
        "",
        "| p | schedule | plait ms | torch ms | plait / torch | vs plait 1f1b | simulated vs 1f1b "
        "| bubble measured | of it waiting on messages | bubble simulated | simulated + gap "
        f"| replayed | on {args['cores']:g} shared cores | measured - simulated "
        "| measured - replayed | gap per action | latency per message | formula "
        "| I + W over B | stage cut |",
        "| --- " * 20 + "|",
    ]

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    for r in rows:
        lines.append(
            f"| {r['p']} | {r['schedule']} | {r['plait_ms']:.1f} | {num(r['torch_ms'], '.1f')} | "
            f"{num(r['ratio'], '.2f')} | {num(r['vs_1f1b'], '.2f')} | "
            f"{num(r['sim_vs_1f1b'], '.2f')} | {100 * r['bubble_measured']:.1f}% | "
            f"{100 * r['waiting']:.1f}% | {100 * r['bubble_simulated']:.1f}% | "
            f"{100 * r['bubble_simulated_with_gap']:.1f}% | {100 * r['bubble_replayed']:.1f}% | "
            f"{pct(r['bubble_simulated_on_cores'])} | "
            f"{100 * (r['bubble_measured'] - r['bubble_simulated']):+.1f} | "
            f"{100 * (r['bubble_measured'] - r['bubble_replayed']):+.1f} | "
            f"{r['gap_ms']:.2f} ms | {r['latency_ms']:.2f} ms | {100 * r['bubble_formula']:.1f}% | "
            f"{num(r['iw_over_b'], '.2f')} | {r['bounds']} |"
        )
    splits = [
        f"p={r['p']} {r['schedule']} stage {s}: {d.removeprefix('split backward: ')}"
        for r in rows
        for s, d in sorted(r["split"].items())
    ]
    if splits:
        lines += ["", "Split backward (layers run as I + W; any other named as fused):", ""]
        lines += [f"- {x}" for x in splits]
    (out / f"{args['name']}.md").write_text("\n".join(lines) + "\n")
    (out / f"{args['name']}.json").write_text(json.dumps({"args": args, "rows": rows}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
