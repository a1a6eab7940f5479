"""What 1D tensor parallelism costs beyond the planner's other terms.

The planner charges a tensor-parallel rank its share of the FLOPs, each collective's
measured line and the layers' own work per collective (``tp_call``,
:mod:`plait.plan.measure.probe_runtime`). A real tensor-parallel step costs more: the work each
rank repeats in full (LayerNorms, residual adds, the embedding's lookup, the loss's
softmax bookkeeping) is not divided by ``t``, and on ranks that share cores every
collective waits for the group's last rank, which may be waiting for a core. This module
measures the difference on a calibration GPT (:data:`MODEL`, not the model being
planned) and splits it the way it grows:

    residual(micro-batch) = per_call * calls + per_element * tokens * hidden * blocks

:func:`measure_rank` (collective over the world, every tensor-parallel group at once,
``Mesh(dp=n/t, tp=t)`` for each ``t`` dividing the world and the model's heads and
vocabulary) times, at two micro-batch sizes (:data:`ROWS`), the model's forward and
backward under ``prepare(strategy="tp")`` and its plain forward and backward on the same
rows with every rank busy, taking turns. :func:`fit` asks the planner
(:func:`plait.plan.time.step_time`, the calibration so far, the efficiency from the plain
step as ``benchmarks/plan_local.py`` takes it) for the micro-batch's compute and
tensor-parallel terms, and splits measured minus predicted at the two sizes (the same
collectives) into ``per_element``, the slope (0 if the noise makes it negative), and
``per_call``, the rest at the small size, of either sign (negative: the planner's per-call
charges exceed what the ranks paid there). The planner adds the residual to the tp term,
never below 0.

Communication of the probe: the tensor-parallel layers' all-reduces over ``tp`` (4 per
block, the embedding's, the head's and the loss's 3); barriers and an all-reduce (max) of
the times on the world.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

import plait
from plait.models import GPT, GPTConfig
from plait.plan.calibration import Residual
from plait.plan.hardware import local_cpu, with_compute
from plait.plan.layout import Job, Layout
from plait.plan.measure.probe_runtime import paired
from plait.plan.model import from_gpt_config
from plait.plan.time import step_time
from plait.strategies.tensor import loss_fn

# the calibration GPT: vocab, layers, heads, width, sequence (heads and vocab split 2, 4, 8)
MODEL = (64, 2, 8, 96, 64)
ROWS = (4, 32)  # micro-batch sequences: the two sizes the residual is split from


def _config() -> Any:

    vocab, layers, heads, width, seq = MODEL
    return GPTConfig(vocab=vocab, layers=layers, heads=heads, width=width, seq_len=seq)


def sizes(n: int) -> list[int]:
    """The tensor-parallel sizes probed on ``n`` ranks: divisors of ``n`` from 2 that
    divide the calibration GPT's heads and vocabulary."""
    vocab, _, heads, _, _ = MODEL
    return [t for t in range(2, n + 1) if n % t == 0 and heads % t == 0 and vocab % t == 0]


def measure_rank(*, iters: int = 5) -> list[dict[str, Any]]:
    """Runs on every rank of the world (collective; barriers, the tensor-parallel
    all-reduces and an all-reduce of the times, each bounded by the group timeout): per
    tensor-parallel size and micro-batch size, the slowest rank's median seconds of the
    plain and the tensor-parallel forward and backward (module doc)."""

    world = plait.world()
    n = world.size
    cfg = _config()
    out = []
    for t in sizes(n):
        mesh = plait.Mesh(dp=n // t, tp=t)
        for rows in ROWS:
            ids = torch.randint(
                0, cfg.vocab, (rows, cfg.seq_len), generator=torch.Generator().manual_seed(0)
            )
            torch.manual_seed(0)
            plain, model = GPT(cfg), GPT(cfg)
            model.load_state_dict(plain.state_dict())
            adam = torch.optim.Adam(model.parameters(), lr=1e-3)
            wrapped, _ = plait.prepare(model, adam, strategy="tp", mesh=mesh)
            loss = loss_fn(wrapped)

            def plain_step(plain: Any = plain, ids: Any = ids) -> None:
                plain.zero_grad()
                logits = plain(ids).reshape(-1, cfg.vocab)
                F.cross_entropy(logits, ids.reshape(-1)).backward()

            def tp_step(wrapped: Any = wrapped, loss: Any = loss, ids: Any = ids) -> None:
                wrapped.zero_grad()
                loss(wrapped(ids), ids).backward()

            plain_s, tp_s = paired([plain_step, tp_step], world, iters=iters, block=1)
            out.append({"t": t, "rows": rows, "plain_s": plain_s, "tp_s": tp_s})
    return out


def predicted(cal: Any, ranks: int, t: int, rows: int, plain_s: float) -> tuple[float, int]:
    """The planner's compute and tensor-parallel seconds for one micro-batch of ``rows``
    sequences of the calibration GPT over ``t`` ranks (efficiency from ``plain_s``, the
    plain forward and backward of those rows with every rank busy), and its collectives."""

    cfg = _config()
    spec = from_gpt_config(cfg)
    base = local_cpu(ranks=ranks, calibration=cal, efficiency=1.0)
    cluster = with_compute(
        base, spec.flops_per_iteration(batch=rows, seq=cfg.seq_len), plain_s, cfg.layers + 1
    )
    job = Job(global_batch=rows * (ranks // t), seq=cfg.seq_len, precision="fp32", dropout=False)
    st = step_time(spec, job, Layout(tp=t, dp=ranks // t, microbatch=rows), cluster)
    return st.compute_per_mb + st.tp_per_mb, st.tp_calls_per_mb


def fit(rows: list[dict[str, Any]], *, cal: Any, ranks: int) -> dict[int, Residual]:
    """:class:`Residual` per tensor-parallel size from :func:`measure_rank`'s rows, against
    the planner with ``cal`` (a :class:`~plait.plan.measure.calibrate.Calibration` without
    residuals) on ``ranks`` ranks."""
    _, layers, _, width, seq = MODEL
    by_t: dict[int, list[tuple[float, float, int]]] = {}  # (elements, residual, calls)
    for r in rows:
        guess, calls = predicted(cal, ranks, r["t"], r["rows"], r["plain_s"])
        elements = float(r["rows"] * seq * width * layers)
        by_t.setdefault(r["t"], []).append((elements, r["tp_s"] - guess, calls))
    out = {}
    for t, pts in by_t.items():
        (e0, s0, calls), (e1, s1, _) = sorted(pts)[:2]
        # the two sizes have the same collectives: the slope is per element (never
        # negative), the rest at the small size per call, either sign (a negative one:
        # the planner's per-call charges exceed what the ranks paid)
        per_element = max(0.0, (s1 - s0) / (e1 - e0))
        out[t] = Residual(per_call=(s0 - per_element * e0) / calls, per_element=per_element)
    return out


__all__ = ["MODEL", "ROWS", "fit", "measure_rank", "predicted", "sizes"]
