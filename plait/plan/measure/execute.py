"""Run a planner :class:`~plait.plan.layout.Layout` of the reference GPT on real ranks.

The planner's numbers are checked against what plait's strategies really do, so one place
turns a layout into the strategy that trains it, on every rank of the world (collective:
it builds a :class:`plait.Mesh`, whose groups block on every rank, at most their timeout):

======================================  ==================================================
layout                                  strategy
======================================  ==================================================
``dp=n`` (``zero`` 0, 1, 2, 3)          ``plait.prepare(strategy="ddp" | "zero1" | "zero2"
                                        | "fsdp")``; FSDP wraps each block
``tp=n``                                ``plait.prepare(strategy="tp", mesh=Mesh(tp=n))``
``ep > 1`` (``tp = pp = 1``)            ``plait.prepare(strategy="ep", mesh=Mesh(ep, dp))``
anything else with ``pp``, ``tp``,      :func:`plait.strategies.compose.compose` on
``dp`` (PTD-P)                          ``Mesh(pp=.., dp=.., tp=..)`` with the layout's
                                        schedule, ``v``, micro-batches, ZeRO stage and SP
======================================  ==================================================

:class:`Built` gives ``step()`` (forward and backward of this rank's rows of the global
batch, every micro-batch), the optimizer, and ``held()``: the object
:func:`plait.plan.memory.measure` reads for this rank's model states. Recomputation and
2D/3D tensor modes, context parallelism (``cp > 1``), gradient accumulation without a
pipeline, ZeRO-3 with tp or pp and expert parallelism with tp, pp or ZeRO are not built
(:func:`supported` says why; :func:`build` refuses them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

import plait
from plait.plan.layout import Job, Layout
from plait.strategies.compose import compose
from plait.strategies.tensor import loss_fn


@dataclass
class Built:
    """A layout on this rank (module doc). ``pp_rank``: the pipeline coordinate, which
    picks the planner's row (:func:`plait.plan.states.rank_states`)."""

    step: Callable[[], None]
    optimizer: torch.optim.Optimizer
    held: Callable[[], object]
    pp_rank: int
    strategy: str


class _Held:
    """``memory_breakdown`` over explicit parameter lists (pipeline and PTD-P ranks)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params

    def memory_breakdown(self) -> dict[str, list[torch.Tensor]]:
        grads = [p.grad for p in self.params if p.grad is not None]
        return {"params": list(self.params), "grads": grads}


def supported(layout: Layout, job: Job) -> str | None:
    """Why :func:`build` cannot run ``layout``, or None if it can."""
    lay = layout
    if lay.cp > 1:  # build has no cp: it would train and measure the layout without it
        return (
            f"cp={lay.cp} (context parallelism) is not built here: measure it with "
            f"plait.prepare(strategy='cp', mesh=Mesh(cp={lay.cp}, dp={lay.dp}), "
            f"context={lay.context!r}), or take cp=1"
        )
    if lay.recompute != "none" or lay.tp_mode != "1d":
        return f"recompute={lay.recompute!r}, tp_mode={lay.tp_mode!r}: only 'none', '1d' are built"
    if lay.ep > 1 and (lay.tp > 1 or lay.pp > 1 or lay.zero):
        return "ep with tp, pp or ZeRO is not built here"
    if lay.pp == 1 and lay.microbatches(job) != 1:
        return "without a pipeline one micro-batch per step (no gradient accumulation)"
    if lay.zero == 3 and (lay.tp > 1 or lay.pp > 1):
        return "ZeRO-3 (FSDP) only with pure data parallelism"
    if lay.zero == 2 and lay.pp > 1:
        return "ZeRO-2 only without a pipeline"
    return None


def _rows(x: torch.Tensor, index: int, shards: int) -> torch.Tensor:
    share = x.shape[0] // shards
    return x[index * share : (index + 1) * share]


def build(
    model: torch.nn.Module,
    layout: Layout,
    job: Job,
    ids: torch.Tensor,
    targets: torch.Tensor,
    *,
    lr: float = 1e-3,
) -> Built:
    """Wrap ``model`` (a :class:`plait.models.GPT`, the same seed on every rank) for
    ``layout`` with Adam; ``ids``/``targets`` are the global batch (the same on every rank).
    Collective over the world (module doc)."""

    lay = layout
    why = supported(lay, job)  # before the world: what cannot be built is refused anywhere
    if why is not None:
        raise ValueError(f"execute.build: layout {lay.label()}: {why}")
    world = plait.world()
    if lay.world != world.size:
        raise ValueError(
            f"layout {lay.label()} needs {lay.world} ranks; this world has {world.size}"
        )
    if ids.shape[0] != job.global_batch:
        raise ValueError(
            f"ids has {ids.shape[0]} rows; the job's global_batch is {job.global_batch}"
        )
    gpt: Any = model
    cfg: Any = gpt.config
    block_type: Any = type(gpt.blocks[0])
    vocab = cfg.vocab
    adam = torch.optim.Adam(model.parameters(), lr=lr)

    def ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, vocab), y.reshape(-1))

    if lay.ep > 1:
        wrapped, opt = plait.prepare(
            model, adam, strategy="ep", mesh=plait.Mesh(ep=lay.ep, dp=lay.dp)
        )
        assert opt is not None
        ep_model: Any = wrapped
        b = int(ep_model.plait_expert_parallel.batch_rank)
        xs, ys = _rows(ids, b, world.size), _rows(targets, b, world.size)

        def ep_step() -> None:
            ce(wrapped(xs), ys).backward()

        return Built(ep_step, opt, lambda: wrapped, 0, "ep")
    if lay.tp == 1 and lay.pp == 1:
        kind = {0: "ddp", 1: "zero1", 2: "zero2", 3: "fsdp"}[lay.zero]
        extra: dict[str, Any] = {"wrap": {block_type}} if kind == "fsdp" else {}
        wrapped, opt = plait.prepare(model, adam, strategy=kind, **extra)  # type: ignore[arg-type]
        assert opt is not None
        xs, ys = _rows(ids, world.rank, world.size), _rows(targets, world.rank, world.size)

        def dp_step() -> None:
            ce(wrapped(xs), ys).backward()

        return Built(dp_step, opt, lambda: wrapped, 0, kind)
    if lay.pp == 1 and lay.dp == 1 and not lay.sp:
        wrapped, opt = plait.prepare(model, adam, strategy="tp", mesh=plait.Mesh(tp=lay.tp))
        assert opt is not None
        loss = loss_fn(wrapped)

        def tp_step() -> None:
            loss(wrapped(ids), targets).backward()

        return Built(tp_step, opt, lambda: wrapped, 0, "tp")

    mesh = plait.Mesh(pp=lay.pp, dp=lay.dp, tp=lay.tp)
    ptdp = compose(
        model,
        adam,
        mesh=mesh,
        sequence_parallel=lay.sp,
        schedule=lay.schedule if lay.pp > 1 else "1f1b",
        microbatches=lay.microbatches(job),
        chunks=lay.v if lay.pp > 1 and lay.v > 1 else None,
        zero=lay.zero,
    )

    def ptdp_step() -> None:
        ptdp.step(ids, targets)

    return Built(
        ptdp_step, ptdp.optimizer, lambda: _Held(ptdp.parameters()), mesh.rank("pp"), "ptdp"
    )


__all__ = ["Built", "build", "supported"]
