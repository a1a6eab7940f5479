"""One training step of every strategy on a model on the ``meta`` device, in one process.

The process plays rank 0 of a world of :data:`WORLD` ranks on PyTorch's fake process group
(``torch.testing._internal.distributed.fake_pg``: collectives and point-to-point messages
complete at once, no data moves), which plait treats as a device backend for ``meta``
(``plait/comm/device.py``): every tensor a strategy hands to a collective must be on
``meta``, as on NCCL it must be on the GPU, so a flag, a mask, a norm or a shape message
made on the CPU by accident is refused naming the call. Meta tensors also refuse
``.item()``, ``.tolist()`` and ``bool()``, so a step that completes read no device value
on the host (a GPU synchronization); :func:`no_sync` makes ``torch.cuda.synchronize``
raise too.

Each case builds its model under ``torch.device("meta")`` and its own mesh over the first
ranks of the world (rank 0 is in every group), runs ``STEPS`` steps (the second after
one-time work such as DDP's bucket rebuild: the steady state) and returns what it ran.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore

import plait
from plait.models.gpt import GPT, GPTConfig, MoEConfig
from plait.strategies.context.layout import shard_sequence

# rank 0 holds stage 0 only under these: its shapes are known locally. Under
# "interleaved", "zbv" and "dualpipev" it also holds a later stage, whose input shape
# arrives in a message that carries nothing on the fake backend: on a meta model the
# runtime derives it by running the earlier stages here on meta (the model's own cut).
FLAT_SCHEDULES = ("gpipe", "1f1b", "zb-h1")
LOOPED_SCHEDULES = ("interleaved", "zbv", "dualpipev")
WORLD = 32  # tp x pp x dp x ep x cp = 2 x 2 x 2 x 2 x 2 in the ptdp case
STEPS = 2
BATCH, SEQ, VOCAB = 4, 16, 64
TIMEOUT_S = 30  # no message waits on the fake backend; a wait that does is a bug


@contextlib.contextmanager
def fake_world(world_size: int = WORLD, *, adopt: bool = True) -> Iterator[plait.comm.Group]:
    """PyTorch's fake process group as the default one, this process playing rank 0:
    initialized here and adopted by ``plait.init()`` (``adopt``), or made by
    ``plait.init(backend="fake")`` from WORLD_SIZE. Left with ``plait.shutdown()``."""
    if dist.is_initialized() or plait.comm.world_or_none() is not None:
        raise RuntimeError("meta harness: a process group is already initialized here")
    saved = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK")}
    try:
        if adopt:
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
            world = plait.init(timeout=TIMEOUT_S)
        else:
            os.environ["WORLD_SIZE"], os.environ["RANK"] = str(world_size), "0"
            world = plait.init(backend="fake", timeout=TIMEOUT_S)
        yield world
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        plait.shutdown()


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """``torch.cuda.synchronize`` raises inside the block (a hot path must not call it)."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("torch.cuda.synchronize() called on the hot path")

    real = torch.cuda.synchronize
    torch.cuda.synchronize = refuse  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.synchronize = real  # type: ignore[assignment]


# --- models and data on meta --------------------------------------------------------------
def gpt(*, moe: bool = False, layers: int = 4, pad_to_capacity: bool = False) -> GPT:
    """``pad_to_capacity``: the MoE layers dispatch through static buffers (the dropless
    dispatch reads the routing on the host and is refused on meta)."""
    experts = MoEConfig(num_experts=4, top_k=2, pad_to_capacity=pad_to_capacity)
    config = GPTConfig(
        vocab=VOCAB,
        layers=layers,
        heads=4,
        width=32,
        seq_len=SEQ,
        moe=experts if moe else None,
    )
    with torch.device("meta"):
        return GPT(config)


def tokens(rows: int = BATCH, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, seq + 1), device="meta")
    return ids[:, :-1], ids[:, 1:]


def ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def sgd(model: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _on_meta(params: Any) -> list[str]:
    """Parameters that are not on meta (the step would have moved data)."""
    return [tuple(p.shape).__repr__() + str(p.device) for p in params if not p.is_meta]


def _module_steps(model: Any, opt: torch.optim.Optimizer, loss: Callable[[], Any]) -> None:
    """Forward, backward, the global gradient norm clipped (its collective included),
    optimizer step."""
    for _ in range(STEPS):
        opt.zero_grad()
        with no_sync():
            loss().backward()
            if hasattr(opt, "clip_grad_norm_"):  # ZeRO-1/2: the optimizer holds the shards
                opt.clip_grad_norm_(1.0)
            elif hasattr(model, "clip_grad_norm_"):  # FSDP's (and DDP's) own
                model.clip_grad_norm_(1.0)
            else:  # by placement: tensor, expert and context parallelism
                plait.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()


def _runner_steps(runner: Any, opt: torch.optim.Optimizer, rows: int = BATCH) -> None:
    for _ in range(STEPS):
        opt.zero_grad()
        ids, targets = tokens(rows)
        with no_sync():
            runner.step(ids, targets)
            if hasattr(runner, "clip_grad_norm_"):
                runner.clip_grad_norm_(1.0)
            else:
                plait.clip_grad_norm_(runner.parameters(), 1.0)
            opt.step()


# --- the cases ----------------------------------------------------------------------------
def data_parallel(strategy: str, **options: Any) -> dict[str, Any]:
    """ddp, naive, zero1, zero2, fsdp (options: mixed precision, offload) on Mesh(dp=4).

    FSDP with ``offload_policy``: the shards, their gradients and the optimizer step live
    on the CPU (the host), compute and every collective on meta; ``off_meta`` then lists
    the shards that are *not* on the host, and ``host`` where shards and gradients were."""
    mesh = plait.Mesh(dp=4, ranks=range(4))
    model = gpt()
    if strategy == "fsdp":
        options.setdefault("wrap", {type(model.blocks[0])})
    offload = options.get("offload_policy") is not None
    wrapped, opt = plait.prepare(model, sgd(model), strategy=strategy, mesh=mesh, **options)
    assert opt is not None
    ids, targets = tokens()
    _module_steps(wrapped, opt, lambda: ce(wrapped(ids), targets))
    params = opt.param_groups[0]["params"]
    if not offload:
        return {"off_meta": _on_meta(params)}
    host = [(str(p.device), None if p.grad is None else str(p.grad.device)) for p in params]
    return {"off_meta": [f"{tuple(p.shape)}{p.device}" for p in params if p.device.type != "cpu"],
            "host": host}  # fmt: skip


def tensor_parallel(sequence_parallel: bool, **options: Any) -> dict[str, Any]:
    mesh = plait.Mesh(tp=4, ranks=range(4))
    model = gpt()
    wrapped, opt = plait.prepare(
        model, sgd(model), strategy="tp", mesh=mesh, sequence_parallel=sequence_parallel,
        **options,
    )  # fmt: skip
    assert opt is not None
    ids, targets = tokens()
    _module_steps(wrapped, opt, lambda: ce(wrapped(ids), targets))
    return {"off_meta": _on_meta(wrapped.parameters())}


def pipeline(
    schedule: str, *, microbatches: int = 4, derive: bool = True, **options: Any
) -> dict[str, Any]:
    """``derive=False``: without the other ranks' stages, as if they were not on meta."""
    mesh = plait.Mesh(pp=4, ranks=range(4))
    model = gpt(layers=8)
    pipe, opt = plait.prepare(
        model, sgd(model), strategy="pipeline", mesh=mesh, schedule=schedule,
        microbatches=microbatches,
        **options,
    )  # fmt: skip
    assert opt is not None
    if not derive:
        pipe.runtime.shape_stages = {}
    _runner_steps(pipe, opt, max(BATCH, microbatches))
    received = {s: (tuple(shape), dtype) for _, inp in pipe.runtime.shapes.values()
                for s, (shape, dtype) in inp.items()}  # fmt: skip
    return {"off_meta": _on_meta(pipe.parameters()), "received": received,
            "stages": sorted(pipe.runtime.stages), "width": model.config.width}  # fmt: skip


def expert_parallel(*, pad_to_capacity: bool = False, **options: Any) -> dict[str, Any]:
    mesh = plait.Mesh(ep=4, ranks=range(4))
    model = gpt(moe=True, pad_to_capacity=pad_to_capacity)
    wrapped, opt = plait.prepare(model, sgd(model), strategy="ep", mesh=mesh, **options)
    assert opt is not None
    ids, targets = tokens()
    _module_steps(wrapped, opt, lambda: ce(wrapped(ids), targets))
    return {"off_meta": _on_meta(wrapped.parameters()), "moe": wrapped.blocks[1].mlp}


def context_parallel(context: str, **options: Any) -> dict[str, Any]:
    mesh = plait.Mesh(cp=4, ranks=range(4))
    model = gpt()
    runner, opt = plait.prepare(
        model, sgd(model), strategy="cp", mesh=mesh, context=context, **options
    )
    assert opt is not None
    ids, targets = tokens()
    ids, _ = shard_sequence(ids, mesh)
    targets, _ = shard_sequence(targets, mesh)
    _module_steps(runner, opt, lambda: ce(runner(ids), targets))
    return {"off_meta": _on_meta(runner.parameters())}


def ptdp(dims: dict[str, int], *, pad_to_capacity: bool = False, **options: Any) -> dict[str, Any]:
    size = 1
    for v in dims.values():
        size *= v
    mesh = plait.Mesh(ranks=range(size), **dims)
    model = gpt(moe=dims.get("ep", 1) > 1, layers=4, pad_to_capacity=pad_to_capacity)
    runner, opt = plait.prepare(
        model, sgd(model), strategy="ptdp", mesh=mesh, microbatches=2, **options
    )
    _runner_steps(runner, opt, rows=BATCH * dims.get("dp", 1))
    return {"off_meta": _on_meta(p for g in opt.param_groups for p in g["params"])}


def parameter_server() -> str:
    """The parameter server keeps its model on the CPU by design: refused on meta."""
    model = gpt()
    try:
        plait.prepare(model, sgd(model), strategy="ps", mesh=plait.Mesh(dp=4, ranks=range(4)))
    except ValueError as exc:
        return str(exc)
    return "NOT REFUSED"
