"""How ``plait demo --model gpt`` builds each layout: the pieces its training loop calls.

Each builder takes the demo's config, the mesh and a tracer and returns a :class:`Trainer`:
``step(x, y)`` (forward and backward of this rank's rows), ``held_out(x, y)`` (the held-out
loss, the same on every rank), ``state()`` (this rank's part of the dense state dict), the
optimizer, the module whose parameters this rank holds, this rank's rows of a global batch
and the group over which the ranks' losses are averaged.

- :func:`tensor_parallel`: ``Mesh(dp, tp)``, ``plait.prepare(strategy="tp")`` (1D, or a
  2D/2.5D/3D grid) and plait DDP over ``dp``;
- :func:`pipeline`: ``Mesh(pp)``, :class:`plait.strategies.pipeline.PipelineParallel`;
- :func:`composed`: ``Mesh(pp, dp, tp)``, :func:`plait.strategies.compose.compose`;
- :func:`experts`: ``Mesh(ep, dp)``, ``plait.prepare(strategy="ep")``;
- :func:`context`: ``Mesh(dp, cp, tp)``, ``plait.prepare(strategy="cp")`` (ring or Ulysses
  attention over cp, tensor parallelism over tp first, gradients averaged over cp x dp).

Every builder splits the dense GPT of :func:`start_model`: the seeded initialisation, or
the checkpoint ``config.init`` (the tour's reference), the same on every rank and in the
one-process oracle.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

import plait
from plait import checkpoint, comm
from plait.models import GPT
from plait.models.gpt import loss as gpt_loss
from plait.models.gpt import pipeline_plan
from plait.strategies.compose import compose
from plait.strategies.context import shard_sequence
from plait.strategies.data_parallel.naive import NaiveDataParallel
from plait.strategies.pipeline import PipelineParallel
from plait.strategies.tensor import loss_fn
from plait.trace import Tracer

if TYPE_CHECKING:
    from plait.demo.options import GPTDemoConfig


@dataclass
class Trainer:
    """One layout's pieces, as the training loop uses them."""

    step: Any  # (x, y) -> loss tensor; forward and backward of this rank's rows
    held_out: Any  # (x, y) -> float; the held-out loss (every rank the same)
    state: Any  # () -> this rank's part of the dense state dict (keys of the dense GPT)
    optimizer: torch.optim.Optimizer
    model: torch.nn.Module
    rows: tuple[int, int]  # this rank's rows of a global batch, [a, b)
    loss_group: Any  # the group over which the ranks' mean losses are averaged


def start_model(config: GPTDemoConfig) -> GPT:
    """The dense GPT every layout starts from. With ``config.init``: the plait checkpoint
    there (:func:`plait.checkpoint.load`, collective over the world when one is running).
    A MoE GPT is upcycled from a dense checkpoint: every expert of an MoE block starts as a
    copy of the MLP it replaces, the gate keeps its seeded initialisation (so the MoE model
    starts near the dense one's function and learns to route from there)."""
    model = GPT(config.model_config())
    if not config.init:
        return model
    if not config.moe:
        checkpoint.load(config.init, model=model, rng=False)
        return model
    dense = GPT(replace(config.model_config(), moe=None))
    checkpoint.load(config.init, model=dense, rng=False)
    return upcycle(dense.state_dict(), model)


def upcycle(dense: dict[str, torch.Tensor], model: GPT) -> GPT:
    """``model`` (a MoE GPT) with every tensor of ``dense`` it shares by name, and every
    expert ``blocks.<i>.mlp.experts.<e>.<rest>`` set to the dense ``blocks.<i>.mlp.<rest>``."""
    state = model.state_dict()
    for key in state:
        source = re.sub(r"\.mlp\.experts\.\d+\.", ".mlp.", key)
        if source in dense:
            state[key] = dense[source]
    model.load_state_dict(state)
    return model


def tensor_parallel(config: GPTDemoConfig, mesh: Any, tracer: Tracer) -> Trainer:
    dense = start_model(config)
    model, opt = plait.prepare(
        dense,
        torch.optim.Adam(dense.parameters(), lr=config.lr),
        strategy="tp",
        mesh=mesh,
        sequence_parallel=config.sequence_parallel,
        mode=config.tp_mode,
        algorithm=config.algorithm,
    )
    assert opt is not None
    loss_of = loss_fn(model)
    run: torch.nn.Module = model
    if config.dp > 1:
        run = plait.DistributedDataParallel(
            model, group=mesh.group("dp"), algorithm=config.algorithm, tracer=tracer
        )

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with tracer.span("forward", stream="compute"):
            loss = loss_of(run(x), y)
        with tracer.span("backward", stream="compute"):
            loss.backward()
        return loss

    def held_out(x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.no_grad():
            return float(loss_of(model(x), y))

    d, rows = mesh.rank("dp"), config.batch_size // config.dp
    return Trainer(
        step,
        held_out,
        lambda: checkpoint.full_state_dict(model),
        opt,
        model,
        (d * rows, (d + 1) * rows),
        mesh.group("dp"),
    )


def pipeline(config: GPTDemoConfig, mesh: Any, tracer: Tracer) -> Trainer:

    dense = start_model(config)
    pipe = PipelineParallel(
        dense,
        plan=pipeline_plan(dense),
        group=mesh.group("pp"),
        schedule=config.schedule,
        microbatches=config.m,
        tracer=tracer,
    )
    opt = torch.optim.Adam(pipe.parameters(), lr=config.lr)

    def held_out(x: torch.Tensor, y: torch.Tensor) -> float:
        # the pipeline has no forward-only schedule yet: a whole step whose gradients are
        # dropped (the next training step zeroes them)
        loss = float(pipe.step(x, y))
        opt.zero_grad()
        return loss

    return Trainer(
        pipe.step,
        held_out,
        pipe.dense_state_dict,
        opt,
        pipe,
        (0, config.batch_size),
        mesh.group("pp"),
    )


def composed(config: GPTDemoConfig, mesh: Any, tracer: Tracer) -> Trainer:
    """PTD-P: tensor parallelism over tp, the pipeline over pp, gradients averaged over dp
    (:func:`plait.strategies.compose.compose`; it takes this rank's dp rows itself)."""

    dense = start_model(config)
    ptdp = compose(
        dense,
        torch.optim.Adam(dense.parameters(), lr=config.lr),
        mesh=mesh,
        sequence_parallel=config.sequence_parallel,
        schedule=config.schedule,
        microbatches=config.m,
        algorithm=config.algorithm,
    )
    opt = ptdp.optimizer

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with tracer.span("forward + backward (pipelined)", stream="compute"):
            return ptdp.step(x, y)

    def held_out(x: torch.Tensor, y: torch.Tensor) -> float:
        # no forward-only schedule yet: a whole step whose gradients are dropped
        loss = float(ptdp.step(x, y))
        opt.zero_grad()
        return loss

    class _Params(torch.nn.Module):  # what the report counts: this rank's parameters
        def __init__(self) -> None:
            super().__init__()
            self.held = torch.nn.ParameterList(ptdp.parameters())

    return Trainer(
        step, held_out, ptdp.full_state_dict, opt, _Params(), (0, config.batch_size), None
    )


def batch_rank(model: torch.nn.Module) -> int:
    info: Any = model.plait_expert_parallel
    return int(info.batch_rank)


def experts(config: GPTDemoConfig, mesh: Any, tracer: Tracer) -> Trainer:
    dense = start_model(config)
    model, opt = plait.prepare(
        dense, torch.optim.Adam(dense.parameters(), lr=config.lr), strategy="ep", mesh=mesh
    )
    assert opt is not None

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with tracer.span("forward", stream="compute"):
            loss = gpt_loss(model(x), y)
        with tracer.span("backward", stream="compute"):
            loss.backward()
        return loss

    def held_out(x: torch.Tensor, y: torch.Tensor) -> float:
        # MoE layers route collectively over ep: every rank evaluates its own rows
        b = batch_rank(model)
        n = x.shape[0] // config.world_size
        model.eval()
        with torch.no_grad():
            mine = gpt_loss(model(x[b * n : (b + 1) * n]), y[b * n : (b + 1) * n])
        model.train()
        mean = mine.detach().to(torch.float64).reshape(1)
        comm.all_reduce(mean, "avg", algorithm="auto")
        return float(mean)

    b = batch_rank(model)
    rows = config.batch_size // config.world_size
    return Trainer(
        step,
        held_out,
        lambda: checkpoint.full_state_dict(model),
        opt,
        model,
        (b * rows, (b + 1) * rows),
        plait.world(),
    )


def context(config: GPTDemoConfig, mesh: Any, tracer: Tracer) -> Trainer:
    """Context parallelism: each cp rank feeds two chunks of every window of its dp replica's
    rows (:func:`plait.strategies.context.shard_sequence`, the causal load-balanced layout)
    and attention runs as ``config.context`` (ring or Ulysses) over cp. The loss of a rank
    is the mean over its tokens; the cp x dp ranks hold equal numbers of tokens, so their
    average is the global batch's loss (and the gradient average is its gradient)."""
    dense = start_model(config)
    run, opt = plait.prepare(
        dense,
        torch.optim.Adam(dense.parameters(), lr=config.lr),
        strategy="cp",
        mesh=mesh,
        context=config.context,
        sequence_parallel=config.sequence_parallel,
        algorithm=config.algorithm,
    )
    assert opt is not None and isinstance(run, NaiveDataParallel)
    loss_of = loss_fn(dense)  # the vocab-parallel loss where tp splits the head
    group = run.group  # the cp x dp ranks that average gradients (and the loss)

    def shard(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return shard_sequence(x, mesh)[0], shard_sequence(y, mesh)[0]

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        xs, ys = shard(x, y)
        with tracer.span("forward", stream="compute"):
            loss = loss_of(run(xs), ys)
        with tracer.span("backward", stream="compute"):
            loss.backward()
        return loss

    def held_out(x: torch.Tensor, y: torch.Tensor) -> float:
        # this dp replica's rows, this cp rank's chunks; the mean over the cp x dp ranks
        n = x.shape[0] // config.dp
        d = mesh.rank("dp")
        xs, ys = shard(x[d * n : (d + 1) * n], y[d * n : (d + 1) * n])
        with torch.no_grad():
            mine = loss_of(run(xs), ys).detach().to(torch.float64).reshape(1)
        comm.all_reduce(mine, "avg", group=group, algorithm="auto")
        return float(mine)

    d, rows = mesh.rank("dp"), config.batch_size // config.dp
    return Trainer(
        step,
        held_out,
        lambda: checkpoint.full_state_dict(dense),
        opt,
        dense,
        (d * rows, (d + 1) * rows),
        group,
    )
