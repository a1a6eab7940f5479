"""What every rank of the GPT demo runs: :func:`train_rank` builds the mesh and the
layout (:mod:`plait.demo.layouts`), trains, evaluates at the evaluation points
(:class:`Point`) and counts the bytes sent per mesh dimension."""

from __future__ import annotations

import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import plait
from plait import comm, moe
from plait.demo import layouts
from plait.demo.gpt.data import corpus, global_batch, held_out_windows
from plait.demo.options import GPTDemoConfig, validate
from plait.extras import require
from plait.metrics import Metrics
from plait.strategies.tensor.grid import grid_mesh
from plait.trace import Tracer


@dataclass
class Point:
    step: int
    loss: float  # mean training loss since the previous point
    held_out_loss: float
    tokens_per_s: float
    elapsed_s: float


def _dimension_bytes(mesh: plait.Mesh) -> dict[str, dict[str, int]]:
    """Bytes this rank sent per mesh dimension (and per collective), from group_stats."""
    names = {mesh.group(d).name: d for d in mesh.names if mesh.size(d) > 1}
    out: dict[str, dict[str, int]] = {}
    for (group, collective, algorithm), s in comm.group_stats().items():
        # a group over several dimensions is named like 'mesh0.dp+ep0[0, 1]'
        several = re.match(r"^mesh\d+\.([a-z]+(?:\+[a-z]+)+)\d*\[", group)
        dim = names.get(group, several.group(1) if several else group)
        row = out.setdefault(dim, {})
        # plait's algorithms count what they send; a "native" collective only its payload
        # (what the backend sends is not visible), and its key says so
        key = f"{collective}/{algorithm}" + (" (payload)" if algorithm == "native" else "")
        row[key] = row.get(key, 0) + (s.payload_bytes if algorithm == "native" else s.bytes_sent)
    return out


def train_rank(config: GPTDemoConfig, run_dir: Path | None = None) -> dict[str, Any]:
    """Runs on every rank: build the mesh, split the GPT, train, report (rank 0 writes
    ``metrics.jsonl`` into ``run_dir`` when given: :class:`plait.metrics.Metrics`)."""
    validate(config)
    world = plait.world()
    if config.tp_mode != "1d":  # the tp ranks as a 2D / 2.5D / 3D grid, dp outside it
        depth = config.tp_depth if config.tp_mode == "2.5d" else None
        mesh = grid_mesh(config.tp_mode, config.tp, depth=depth, dp=config.dp)
    else:
        mesh = plait.Mesh(**config.mesh_shape())  # type: ignore[arg-type]
    train_tokens, held_tokens = corpus()
    tracer = Tracer(rank=world.rank)
    composed = config.pp > 1 and (config.tp > 1 or config.dp > 1)
    build = (
        layouts.context
        if config.cp > 1
        else layouts.composed
        if composed
        else layouts.pipeline
        if config.pp > 1
        else layouts.experts
        if config.moe
        else layouts.tensor_parallel
    )
    t = build(config, mesh, tracer)
    a, b = t.rows
    lead = world.rank == 0
    x_held, y_held = held_out_windows(config, held_tokens)
    evals = config.eval_points
    marks = {round(config.steps * (k + 1) / evals) for k in range(evals)}
    history: list[Point] = []
    losses: list[float] = []  # this rank's loss at every step
    ends: list[float] = []  # seconds since the start at the end of every step
    loads: list[dict[str, Any]] = []
    comm.reset_stats()
    meter = Metrics(
        mesh=mesh, model=config.model_config(), seq_len=config.seq_len, progress=False,
        log_dir=run_dir, jsonl=run_dir is not None,
    )  # fmt: skip
    start = last = time.perf_counter()
    last_step_ns = last_step_end_ns = 0  # the last training step (the held-out pass after it
    # is a whole pipeline step too: kept out of the bubble and the timeline)
    since, loss_sum = 0, 0.0
    bar = _progress(config, show=lead)
    for step in range(config.steps):
        with meter.data():
            x, y = global_batch(config, train_tokens, step)
        t.optimizer.zero_grad()
        last_step_ns = time.perf_counter_ns()
        loss = t.step(x[a:b], y[a:b])
        with tracer.span("optimizer step", stream="compute"):
            t.optimizer.step()
        last_step_end_ns = time.perf_counter_ns()
        meter.step(loss, tokens=config.batch_size * config.seq_len)
        if config.moe:
            loads.append(moe.collect(t.model))
        losses.append(loss.item())
        loss_sum += losses[-1]
        since += 1
        bar.update(1)
        if step + 1 in marks:
            # every replica's mean loss; the replicas' average is the global batch's
            mean = torch.tensor([loss_sum / since], dtype=torch.float64)
            if t.loss_group is not None:  # None: the step's loss is the global batch's
                comm.all_reduce(mean, "avg", group=t.loss_group, algorithm="auto")
            held = t.held_out(x_held, y_held)
            now = time.perf_counter()
            point = Point(
                step=step + 1,
                loss=float(mean),
                held_out_loss=held,
                tokens_per_s=since * config.batch_size * config.seq_len / (now - last),
                elapsed_s=now - start,
            )
            history.append(point)
            if lead and not bar.disable:
                bar.set_postfix(loss=f"{point.loss:.3f}", held_out=f"{held:.3f}")
            elif lead:
                print(
                    f"step {point.step}/{config.steps}  loss {point.loss:.4f}  held-out "
                    f"{held:.4f}  {point.tokens_per_s:,.0f} tokens/s",
                    flush=True,
                )
            since, loss_sum, last = 0, 0.0, time.perf_counter()
            meter.start()  # the held-out pass is no training step's time
        ends.append(time.perf_counter() - start)
    bar.close()
    meter.close()
    train_s = time.perf_counter() - start
    sent = _dimension_bytes(mesh)  # training only: full_state_dict below gathers over tp
    return {
        "history": [asdict(p) for p in history],
        "losses": losses,
        "ends": ends,
        "spans": tracer.spans(),
        "last_step_ns": last_step_ns,
        "last_step_end_ns": last_step_end_ns,
        "state": t.state(),
        "bytes_by_dim": sent,
        "param_bytes": sum(p.numel() * p.element_size() for p in t.model.parameters()),
        "train_s": train_s,
        "layout": str(mesh) if lead else "",
        "moe": [{k: v.as_dict() for k, v in step.items()} for step in loads],
        "metrics": {"info": meter.info, "summary": meter.summary()},
    }


def _progress(config: GPTDemoConfig, show: bool) -> Any:
    tqdm = require("tqdm", why="plait demo's progress bar").tqdm
    return tqdm(
        total=config.steps,
        desc="training",
        unit="step",
        leave=False,
        file=sys.stdout,
        disable=not (show and sys.stdout.isatty()),
        dynamic_ncols=True,
    )
