"""The strategies' own per-step work, measured for :mod:`plait.plan.measure.calibrate`.

A layout's step costs more than its FLOPs, its collectives and Adam: plait's strategies
run Python per parameter, per collective and per pipeline action (hooks, bucket copies,
flattening, autograd functions around the collectives, the pipeline runtime's action
loop). Each probe here runs a small GPT (2 blocks, a few tokens: almost no FLOPs, every
operator still dispatched) under one strategy and, taking turns with it, a **reference
step**: the plain model's step calling the same collectives on buffers of the same sizes
(so the collectives' cost, and the wake-ups of ranks that share cores, cancel), every rank
of the world at once. The difference is the strategy's own work, divided by what the
planner can count in any layout (``T``: the slowest rank's median step; ``G`` gradient
bytes, ``N`` parameter elements, ``n`` ranks):

================  ============================================================  ============
field             probe                                                          charged per
================  ============================================================  ============
``ddp``           ``T_ddp - T_ref``, ref = plain + ``all_reduce(G)``; at widths  step: per
                  8 and 128 (29 tensors each, 7.5 KB and 1.6 MB of gradients):   gradient
                  ``per_tensor`` and ``per_byte`` from the two                   tensor, byte
                  (:func:`split_overhead`)
``zero``          ``T_zero1 - T_ref + adam(N) - adam(N/n)``, ref = plain +       step: per
                  ``reduce_scatter(G)`` + ``all_gather(G)`` (Adam on all of it)  tensor, byte
``fsdp``          ``T_fsdp - T_ref + adam(N) - adam(N/n)``, each block a unit    step: per
                  and the root one; ref = plain + per unit 2 ``all_gather`` and  tensor, byte
                  a ``reduce_scatter`` of ``G/units``
``tp_call``       ``(T_tp - T_ref) / k`` over ``Mesh(dp=n/g, tp=g)`` for each    collective
                  group size ``g`` (``max(4, g)`` heads of 2 features); ref =
                  plain + ``k`` all-reduces of the activation (half after
                  forward, half after backward),
                  ``k = 4 L + 5`` the model's calls (4 per block, embedding,
                  head, the loss's 3)
``pipe_action``   a 2-stage 1F1B pipeline (``compose``, ``Mesh(pp=2, dp=n/2)``)  action
                  at ``m1`` and ``m2`` micro-batches: ``(T(m2) - T(m1)) /
                  (m2 - m1)`` per micro-batch (fill, drain and the step's fixed
                  work cancel), minus half the whole model's forward and
                  backward of a micro-batch (a stage's compute) and 2 messages
                  (the back-to-back p2p line), over the 4 actions each rank
                  runs per micro-batch (F, B, a send, a receive)
================  ============================================================  ============

Each function is collective over the world (barriers and the strategies' collectives,
each bounded by the group timeout) and returns the same figures on every rank. A
difference the noise makes negative is kept at 0 (:func:`split_overhead`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

import plait
from plait import comm
from plait.models import GPT, GPTConfig
from plait.plan.calibration import Calibration, Line, Overhead
from plait.strategies.compose import compose
from plait.strategies.tensor import loss_fn

WIDTHS = (8, 128)  # the ddp and zero probes' two GPTs: same tensors, 7.5 KB and 1.6 MB
LAYERS = 2
PIPE_MB = (2, 6)  # the pipeline probe's two micro-batch counts
UNITS = LAYERS + 1  # the FSDP probe's units: each block, and the root


def split_overhead(
    small: tuple[float, float], large: tuple[float, float], tensors: int
) -> Overhead:
    """``(bytes, seconds)`` of two models of ``tensors`` parameter tensors each into
    ``seconds = per_tensor * tensors + per_byte * bytes``: the slope between the two is
    the per-byte cost (0 if negative), the rest of the small one's seconds the per-tensor
    cost (0 if negative)."""
    (b0, t0), (b1, t1) = small, large
    if tensors < 1 or b1 <= b0:
        raise ValueError(
            f"split_overhead: need tensors >= 1 and larger bytes second, got {small}, {large}"
        )
    per_byte = max(0.0, (t1 - t0) / (b1 - b0))
    per_tensor = max(0.0, (t0 - per_byte * b0) / tensors)
    return Overhead(per_tensor=per_tensor, per_byte=per_byte)


def _gpt(width: int, layers: int = LAYERS, heads: int = 4, vocab: int = 8) -> Any:

    return GPT(GPTConfig(vocab=vocab, layers=layers, heads=heads, width=width, seq_len=4))


def paired(
    fns: list[Callable[[], object]], world: Any, *, iters: int, block: int = 2
) -> list[float]:
    """Seconds per call of each of ``fns``, taking turns block by block (a noisy moment
    hits them alike): median over ``iters`` of the slowest rank's block, over ``block``."""

    for fn in fns:
        fn()
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for i, fn in enumerate(fns):
            comm.barrier(group=world)
            t0 = time.perf_counter()
            for _ in range(block):
                fn()
            times[i].append((time.perf_counter() - t0) / block)
    t = torch.tensor(times, dtype=torch.float64)
    comm.all_reduce(t, op="max", group=world)
    return [statistics.median(row) for row in t.tolist()]


def _plain_step(model: Any, ids: Any, after_backward: Callable[[], None]) -> Callable[[], None]:
    """The reference step: ``model``'s forward, backward, ``after_backward`` (the
    collectives the strategy calls, on buffers of their sizes), Adam."""

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad()
        model(ids).sum().backward()
        after_backward()
        opt.step()

    return step


def _wrapped_step(strategy: str, model: Any, ids: Any, group: Any) -> Callable[[], None]:

    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    extra: dict[str, Any] = {"wrap": {type(model.blocks[0])}} if strategy == "fsdp" else {}
    wrapped, opt = plait.prepare(model, adam, strategy=strategy, mesh=group, **extra)
    assert opt is not None

    def step() -> None:
        opt.zero_grad()
        wrapped(ids).sum().backward()
        opt.step()

    return step


def data_parallel(
    strategy: str, world: Any, adam: Line, raw: list[dict[str, Any]], *, iters: int
) -> Overhead:
    """``ddp`` (``strategy="ddp"``), ``zero`` (``"zero1"``) or ``fsdp`` (``"fsdp"``, each
    block a unit) of the module doc."""

    n = world.size
    ids = torch.zeros(1, 4, dtype=torch.long)
    points = []
    tensors = 0
    for width in WIDTHS:
        torch.manual_seed(0)
        plain_model, model = _gpt(width), _gpt(width)
        model.load_state_dict(plain_model.state_dict())
        params = [p.numel() for p in model.parameters()]
        numel = -(-sum(params) // n) * n
        tensors, grad = len(params), 4.0 * sum(params)
        unit = -(-numel // UNITS // n) * n
        full, part = torch.zeros(numel), torch.zeros(numel // n)
        ufull, upart = torch.zeros(unit), torch.zeros(unit // n)

        def collectives(
            full: Any = full, part: Any = part, ufull: Any = ufull, upart: Any = upart
        ) -> None:
            if strategy == "ddp":
                comm.all_reduce(full, group=world)
            elif strategy == "fsdp":  # per unit: gathered in forward and backward, reduced
                for _ in range(UNITS):
                    comm.all_gather(ufull, upart, group=world)
                    comm.all_gather(ufull, upart, group=world)
                    comm.reduce_scatter(upart, ufull, group=world)
            else:
                comm.reduce_scatter(part, full, group=world)
                comm.all_gather(full, part, group=world)

        t_plain, t_wrapped = paired(
            [
                _plain_step(plain_model, ids, collectives),
                _wrapped_step(strategy, model, ids, world),
            ],
            world,
            iters=iters,
        )
        own = t_wrapped - t_plain
        if strategy != "ddp":  # the reference ran Adam on all the parameters, ZeRO on 1/n
            own += adam.seconds(grad / 4) - adam.seconds(grad / 4 / n)
        points.append((grad, own))
        raw.append(
            {
                "probe": strategy,
                "bytes": grad,
                "tensors": tensors,
                "reference_s": t_plain,
                "strategy_s": t_wrapped,
                "own_s": own,
            }
        )
    return split_overhead(points[0], points[1], tensors)


def tensor_call(world: Any, raw: list[dict[str, Any]], *, iters: int) -> dict[int, float]:
    """``tp_call`` of the module doc, per tensor-parallel group size."""

    n = world.size
    ids = torch.zeros(2, 4, dtype=torch.long)
    targets = torch.zeros(2, 4, dtype=torch.long)
    calls = 4 * LAYERS + 5
    out: dict[int, float] = {}
    for g in (d for d in range(2, n + 1) if n % d == 0):
        torch.manual_seed(0)
        mesh = plait.Mesh(dp=n // g, tp=g)
        group = mesh.group("tp")
        # heads, width and vocabulary divisible by g (2 features per head, at least 4 heads)
        heads = max(4, g)
        width, vocab = 2 * heads, max(8, g)
        plain_model = _gpt(width, heads=heads, vocab=vocab)
        model = _gpt(width, heads=heads, vocab=vocab)
        plain_opt = torch.optim.Adam(plain_model.parameters(), lr=1e-3)
        adam = torch.optim.Adam(model.parameters(), lr=1e-3)
        wrapped, opt = plait.prepare(model, adam, strategy="tp", mesh=mesh)
        assert opt is not None
        loss = loss_fn(wrapped)
        act = torch.zeros(ids.numel() * width)

        def plain(
            plain_model: Any = plain_model,
            plain_opt: Any = plain_opt,
            act: Any = act,
            group: Any = group,
            vocab: int = vocab,
        ) -> None:
            plain_opt.zero_grad()
            logits = plain_model(ids).reshape(-1, vocab)
            for _ in range(calls // 2):
                comm.all_reduce(act, group=group)
            F.cross_entropy(logits, targets.reshape(-1)).backward()
            for _ in range(calls - calls // 2):
                comm.all_reduce(act, group=group)
            plain_opt.step()

        def tp(opt: Any = opt, loss: Any = loss, wrapped: Any = wrapped) -> None:
            opt.zero_grad()
            loss(wrapped(ids), targets).backward()
            opt.step()

        t_plain, t_tp = paired([plain, tp], world, iters=iters)
        out[g] = max(0.0, (t_tp - t_plain) / calls)
        raw.append(
            {"probe": "tp", "n": g, "calls": calls, "reference_s": t_plain, "strategy_s": t_tp}
        )
    return out


def pipeline_action(
    world: Any,
    links: dict[str, dict[int, Line]],
    raw: list[dict[str, Any]],
    *,
    iters: int,
) -> float:
    """``pipe_action`` of the module doc."""

    n = world.size
    mesh = plait.Mesh(pp=2, dp=n // 2, tp=1)
    steps = []
    torch.manual_seed(0)
    plain_model = _gpt(8)
    one = torch.zeros(1, 4, dtype=torch.long)

    def plain() -> None:  # the whole model's forward and backward of one micro-batch
        plain_model.zero_grad()
        plain_model(one).sum().backward()

    for m in PIPE_MB:
        torch.manual_seed(0)
        model = _gpt(8)
        ptdp = compose(
            model,
            torch.optim.Adam(model.parameters(), lr=1e-3),
            mesh=mesh,
            schedule="1f1b",
            microbatches=m,
        )
        ids = torch.zeros(mesh.size("dp") * m, 4, dtype=torch.long)
        opt = ptdp.optimizer

        def step(ptdp: Any = ptdp, ids: Any = ids, opt: Any = opt) -> None:
            opt.zero_grad()
            ptdp.step(ids, ids)

        steps.append(step)
    t_mb, t1, t2 = paired([plain, *steps], world, iters=iters, block=1)
    slope = (t2 - t1) / (PIPE_MB[1] - PIPE_MB[0])
    message = 4.0 * 4 * 8  # one row of 4 tokens of width 8
    p2p = links["p2p"][2].seconds(message)
    raw.append(
        {
            "probe": "pipeline",
            "microbatches": list(PIPE_MB),
            "steps_s": [t1, t2],
            "slope_s": slope,
            "model_mb_s": t_mb,
            "p2p_s": p2p,
        }
    )
    return max(0.0, (slope - t_mb / 2 - 2 * p2p) / 4)


def measure(
    cal: Calibration, world: Any, *, iters: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The four probes of the module doc on ``world``: the fields
    :class:`~plait.plan.measure.calibrate.Calibration` keeps them in, and the raw rows."""
    adam = cal.adam or Line(latency=0.0, bandwidth=float("inf"), points=0)
    raw: list[dict[str, Any]] = []
    out: dict[str, Any] = {
        "ddp": data_parallel("ddp", world, adam, raw, iters=iters),
        "zero": data_parallel("zero1", world, adam, raw, iters=iters),
        "fsdp": data_parallel("fsdp", world, adam, raw, iters=iters),
        "tp_call": tensor_call(world, raw, iters=iters),
    }
    if world.size % 2 == 0:  # messages back to back: the tiny pipeline has no bursts
        links = {**cal.links, **cal.idle_links}
        out["pipe_action"] = pipeline_action(world, links, raw, iters=2 * iters)
    return out, raw


__all__ = [
    "LAYERS",
    "PIPE_MB",
    "WIDTHS",
    "data_parallel",
    "measure",
    "paired",
    "pipeline_action",
    "split_overhead",
    "tensor_call",
]
