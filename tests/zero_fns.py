"""Rank functions for the ZeRO tests; models, data and the oracle come from ddp_fns."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import plait
import plait.amp
import plait.trace
from plait.strategies.zero import GuardedGrad, ShardedGradientError, ZeroOptimizer, prepare_zero
from tests.ddp_fns import batch, make_model, make_optimizer, shard


def _train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, first: int, last: int) -> None:
    world = plait.world()
    for step in range(first, last):
        x, y = batch(step)
        optimizer.zero_grad()
        out = model(shard(x, world.rank, world.size))
        nn.functional.mse_loss(out, shard(y, world.rank, world.size)).backward()
        optimizer.step()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def train(
    stage: int, steps: int, opt: str, options: dict[str, Any] | None = None
) -> list[torch.Tensor]:
    """Train under ZeRO from replicas that start different (construction broadcasts)."""
    world = plait.world()
    model: nn.Module = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(world.rank)
    model, zero = prepare_zero(model, make_optimizer(model, opt), stage=stage, **(options or {}))
    _train_steps(model, zero, 0, steps)
    return _params(model)


def shard_sizes(stage: int, opt: str) -> dict[str, Any]:
    """Sizes after one step: shard, optimizer state, gradients held."""
    model: nn.Module = make_model()
    model, zero = prepare_zero(model, make_optimizer(model, opt), stage=stage)
    _train_steps(model, zero, 0, 1)
    (state,) = [zero.optim.state[s] for s in zero.shards]  # one param group
    breakdown = zero.memory_breakdown()
    return {
        "total": sum(p.numel() for p in model.parameters()),
        "shard": zero.shard.numel(),
        "bounds": zero.bounds,
        "state_numel": sum(v.numel() for v in state.values() if v.dim() > 0),
        "breakdown": {k: sum(t.numel() for t in v) for k, v in breakdown.items()},
    }


def stage2_gradients() -> dict[int, Any]:
    """After a stage-2 backward: no full gradient, an averaged shard gradient; and after
    a stage-1 backward the full gradients are still there."""
    world = plait.world()
    result: dict[int, Any] = {}
    for stage in (1, 2):
        model: nn.Module = make_model()
        model, zero = prepare_zero(model, make_optimizer(model, "adam"), stage=stage)
        x, y = batch(0)
        out = model(shard(x, world.rank, world.size))
        nn.functional.mse_loss(out, shard(y, world.rank, world.size)).backward()
        zero.gradients.wait()  # stage 2: the averaged shard, before step
        grad = zero.gradients.flat
        result[stage] = {
            # stage 2: one-element placeholders (stride 0); stage 1: the local gradients
            "placeholders": [
                p.grad is not None and 0 in p.grad.stride() for p in model.parameters()
            ],
            "guarded": [isinstance(p.grad, GuardedGrad) for p in model.parameters()],
            "shard_grad": None if grad is None else grad.clone(),
            "grad_numel": sum(t.numel() for t in zero.memory_breakdown()["grads"]),
            "lo_hi": (zero.lo, zero.hi),
        }
        zero.zero_grad()
        result[stage]["after_zero_grad"] = zero.gradients.flat is None and all(
            p.grad is None for p in model.parameters()
        )
    return result


def accumulate(stage: int, steps: int) -> list[torch.Tensor]:
    """Two micro-batches per step (loss halved each), zero_grad between steps."""
    world = plait.world()
    model: nn.Module = make_model()
    model, zero = prepare_zero(model, make_optimizer(model, "adam"), stage=stage)
    for step in range(steps):
        x, y = batch(step)
        x, y = shard(x, world.rank, world.size), shard(y, world.rank, world.size)
        half = x.shape[0] // 2
        zero.zero_grad()
        for part in (slice(0, half), slice(half, None)):
            (nn.functional.mse_loss(model(x[part]), y[part]) / 2).backward()
        zero.step()
    return _params(model)


def save(stage: int, steps: int, opt: str) -> dict[str, Any]:
    """Train, then return the parameters and both kinds of state dict."""
    model: nn.Module = make_model()
    model, zero = prepare_zero(model, make_optimizer(model, opt), stage=stage)
    _train_steps(model, zero, 0, steps)
    return {
        "params": _params(model),
        "state": zero.state_dict(),
        "sharded": zero.sharded_state_dict(),
    }


def resume(
    stage: int, params: list[torch.Tensor], state: dict[str, Any], opt: str, first: int, last: int
) -> list[torch.Tensor]:
    """Load parameters and a consolidated state, train steps [first, last)."""
    model: nn.Module = make_model(seed=123)  # all values must come from the checkpoint
    with torch.no_grad():
        for p, saved in zip(model.parameters(), params, strict=True):
            p.copy_(saved)
    model, zero = prepare_zero(model, make_optimizer(model, opt), stage=stage)
    zero.load_state_dict(state)
    _train_steps(model, zero, first, last)
    return _params(model)


def sharded_round_trip(stage: int) -> dict[str, Any]:
    """Save a shard after 2 steps, load it into a fresh optimizer, train 2 more steps;
    against 4 uninterrupted steps. Also: a mismatched layout is refused."""
    model: nn.Module = make_model()
    model, zero = prepare_zero(model, make_optimizer(model, "adam"), stage=stage)
    _train_steps(model, zero, 0, 2)
    saved, params = copy.deepcopy(zero.sharded_state_dict()), _params(model)
    _train_steps(model, zero, 2, 4)
    straight = _params(model)

    model2 = make_model(seed=7)
    with torch.no_grad():
        for p, s in zip(model2.parameters(), params, strict=True):
            p.copy_(s)
    zero2 = ZeroOptimizer(model2.parameters(), torch.optim.Adam, stage=stage, lr=0.5)
    zero2.load_sharded_state_dict(saved)
    lr = zero2.param_groups[0]["lr"]
    _train_steps(model2, zero2, 2, 4)
    refused = ""
    other = dict(saved, world_size=saved["world_size"] + 1)
    try:
        zero2.load_sharded_state_dict(other)
    except ValueError as exc:
        refused = str(exc)
    return {"straight": straight, "resumed": _params(model2), "lr": lr, "refused": refused}


def bytes_per_step(stage: int) -> dict[str, Any]:
    """Bytes one step sends with the ring, against the contract."""
    model: nn.Module = make_model()
    model, zero = prepare_zero(
        model, make_optimizer(model, "sgd"), stage=stage, algorithm="ring", bucket_mb=0.0002
    )
    plait.comm.reset_stats()
    _train_steps(model, zero, 0, 1)
    stats = plait.comm.stats()
    return {
        "reduce_scatter": stats[("reduce_scatter", "ring")].bytes_sent,
        "all_gather": stats[("all_gather", "ring")].bytes_sent,
        "bounds": zero.bounds,
        "buckets": len(zero._buckets),
    }


def with_scheduler(stage: int, steps: int) -> list[torch.Tensor]:
    """An LR scheduler on the ZeroOptimizer changes the local optimizer's lr."""
    model: nn.Module = make_model()
    model, zero = prepare_zero(model, make_optimizer(model, "adam"), stage=stage)
    scheduler = torch.optim.lr_scheduler.StepLR(zero, step_size=2, gamma=0.1)
    for step in range(steps):
        _train_steps(model, zero, step, step + 1)
        scheduler.step()
    return _params(model)


def odd_model() -> nn.Module:
    """22 elements: shards of 6, 6, 5, 5 at world 4; small buckets miss some ranks."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1))


def odd_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(8, 5, generator=g), torch.randn(8, 1, generator=g)


def train_odd(stage: int | None, steps: int, options: dict[str, Any]) -> dict[str, Any]:
    """The odd model under ZeRO (``stage``) or, with ``stage=None``, plain Adam on the
    global batch in this process."""
    model = odd_model()
    optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    rank, size = 0, 1
    if stage is not None:
        world = plait.world()
        rank, size = world.rank, world.size
        model, optimizer = prepare_zero(model, optimizer, stage=stage, **options)
    for step in range(steps):
        x, y = odd_batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(shard(x, rank, size)), shard(y, rank, size)).backward()
        optimizer.step()
    shard_numel = optimizer.shard.numel() if isinstance(optimizer, ZeroOptimizer) else None
    return {"params": _params(model), "shard": shard_numel}


# --- drop-in fidelity: clipping, param groups, loss scaling, wrap check, tracing ---------
def loss_on_shard(model: nn.Module, step: int) -> torch.Tensor:
    world = plait.world()
    x, y = batch(step)
    out = model(shard(x, world.rank, world.size))
    return nn.functional.mse_loss(out, shard(y, world.rank, world.size))


def clipped(stage: int, norm_type: float, steps: int, max_norm: float) -> dict[str, Any]:
    """SGD with momentum, ``optimizer.clip_grad_norm_`` every step. Also what
    ``torch.nn.utils.clip_grad_norm_`` and a gradient read do on the model's ``.grad``."""
    model: nn.Module = make_model()
    model, zero = prepare_zero(model, make_optimizer(model, "sgd"), stage=stage)
    norms, refused = [], {}
    for step in range(steps):
        zero.zero_grad()
        loss_on_shard(model, step).backward()
        if step == 0:
            for what, fn in (
                ("torch_clip", lambda: nn.utils.clip_grad_norm_(model.parameters(), max_norm)),
                ("grad_norm", lambda: model.fc1.weight.grad.norm()),
                ("print", lambda: repr(model.fc2.bias.grad)),
            ):
                try:
                    refused[what] = f"returned {fn()!r}"
                except ShardedGradientError as exc:
                    refused[what] = str(exc)
        norms.append(float(zero.clip_grad_norm_(max_norm, norm_type)))
        zero.step()
    return {"params": _params(model), "norms": norms, "refused": refused}


def grouped_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    """nanoGPT's split: weight matrices decay, biases do not (and get another lr)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "lr": 0.02},
    ]
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=0.01, betas=(0.9, 0.95))
    if name == "adam":
        return torch.optim.Adam(groups, lr=0.01)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True)
    if name == "rmsprop":
        return torch.optim.RMSprop(groups, lr=0.01, momentum=0.5)
    if name == "adagrad":
        return torch.optim.Adagrad(groups, lr=0.05)
    raise ValueError(name)


def schedule(step: int) -> float:
    """LambdaLR factor: full lr for steps 0 and 1, then 0.3."""
    return 1.0 if step < 2 else 0.3


def train_grouped(
    stage: int | None,
    opt: str,
    first: int,
    last: int,
    *,
    scheduled: bool = False,
    params: list[torch.Tensor] | None = None,
    state: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Steps [first, last) with two param groups, from ``params``/``state`` if given.
    ``stage=None``: plain optimizer, global batch, this process (the oracle). Also returns
    the ZeroOptimizer's buckets (parameter indices, launch order)."""
    model: nn.Module = make_model()
    if params is not None:
        with torch.no_grad():
            for p, s in zip(model.parameters(), params, strict=True):
                p.copy_(s)
    optimizer = grouped_optimizer(model, opt)
    if stage is not None:  # through plait.prepare, as a ported script would
        model, prepared = plait.prepare(
            model, optimizer, strategy=f"zero{stage}", **(options or {})
        )
        assert isinstance(prepared, ZeroOptimizer)
        optimizer = prepared
    if state is not None:
        optimizer.load_state_dict(copy.deepcopy(state))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule) if scheduled else None
    lrs = []
    for step in range(first, last):
        optimizer.zero_grad()
        if stage is None:
            x, y = batch(step)
            nn.functional.mse_loss(model(x), y).backward()
        else:
            loss_on_shard(model, step).backward()
        optimizer.step()
        lrs.append([g["lr"] for g in optimizer.param_groups])
        if scheduler is not None:
            scheduler.step()
    buckets = [b.params for b in optimizer._buckets] if stage is not None else []
    return {
        "params": _params(model),
        "state": optimizer.state_dict(),
        "lrs": lrs,
        "buckets": buckets,
    }


def _overflow(grad: torch.Tensor) -> torch.Tensor:
    """An fp16-like overflow: the first element of a gradient becomes inf."""
    return grad.index_fill(0, torch.tensor([0]), float("inf"))


def scaled(stage: int, kind: str, steps: int, max_norm: float | None = None) -> dict[str, Any]:
    """Loss scaling with ``torch.amp.GradScaler`` (``kind="torch"``) or plait's
    DynamicLossScaler; at step 1 rank 1's gradient of fc2.bias gets an inf. With
    ``max_norm`` (torch only): the documented recipe ``scaler.unscale_(optimizer)``, then
    ``optimizer.clip_grad_norm_(max_norm)``, then ``scaler.step(optimizer)``."""
    world = plait.world()
    model: nn.Module = make_model()
    model, zero = prepare_zero(model, make_optimizer(model, "sgd"), stage=stage)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    plait_scaler = plait.amp.DynamicLossScaler(init_scale=2.0**8, growth_interval=1000)
    scales, unchanged = [], []
    for step in range(steps):
        zero.zero_grad()
        handle = None
        if step == 1 and world.rank == 1:
            handle = model.fc2.bias.register_hook(_overflow)
        loss = loss_on_shard(model, step)
        before = _params(model)
        if kind == "torch":
            torch_scaler.scale(loss).backward()
            if max_norm is not None:
                torch_scaler.unscale_(zero)
                zero.clip_grad_norm_(max_norm)
            torch_scaler.step(zero)
            torch_scaler.update()
            scales.append(torch_scaler.get_scale())
        else:
            plait_scaler.scale(loss).backward()
            plait_scaler.step(zero)
            scales.append(plait_scaler.scale_value)
        if handle is not None:
            handle.remove()
        unchanged.append(
            all(torch.equal(a, b) for a, b in zip(before, _params(model), strict=True))
        )
    return {"params": _params(model), "scales": scales, "unchanged": unchanged}


class _Swapped(nn.Module):
    """ddp_fns.Net's layers, registered in the other order."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc2 = nn.Linear(16, 4)
        self.fc1 = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def built_differently(stage: int) -> str:
    """Rank 1 registers its modules in another order: construction must refuse it."""
    model: nn.Module = _Swapped() if plait.world().rank == 1 else make_model()
    try:
        prepare_zero(model, make_optimizer(model, "adam"), stage=stage)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def traced(stage: int) -> list[tuple[str, str]]:
    """(name, stream) of the spans one step records through ``prepare_zero(tracer=)``."""
    tracer = plait.trace.Tracer(rank=plait.world().rank)
    model: nn.Module = make_model()
    model, zero = prepare_zero(
        model, make_optimizer(model, "adam"), stage=stage, tracer=tracer, bucket_mb=0.0002
    )
    zero.zero_grad()
    loss_on_shard(model, 0).backward()
    zero.step()
    return [(s.name, s.stream) for s in tracer.spans()]


def accumulate_with(stage: int, steps: int, clear: str) -> list[torch.Tensor]:
    """Two micro-batches per step; gradients cleared by ``clear``: ``optimizer``/``model``
    ``.zero_grad()`` with ``set_to_none`` True (``..._none``) or False (``..._zero``)."""
    model: nn.Module = make_model()
    model, zero = prepare_zero(model, make_optimizer(model, "adam"), stage=stage)
    world = plait.world()
    for step in range(steps):
        owner, how = clear.split("_")
        (zero if owner == "optimizer" else model).zero_grad(set_to_none=how == "none")
        x, y = batch(step)
        x, y = shard(x, world.rank, world.size), shard(y, world.rank, world.size)
        half = x.shape[0] // 2
        for part in (slice(0, half), slice(half, None)):
            (nn.functional.mse_loss(model(x[part]), y[part]) / 2).backward()
        zero.step()
    return _params(model)


def frozen_first_layer(stage: int | None, steps: int) -> dict[str, Any]:
    """fc1 frozen, Adam on all parameters (as fine-tuning scripts do): the frozen ones stay
    in the param group and out of the state, as with the plain optimizer.
    ``stage=None``: the oracle, in this process."""
    model: nn.Module = make_model()
    for p in model.fc1.parameters():
        p.requires_grad_(False)
    optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    rank, size = 0, 1
    if stage is not None:
        rank, size = plait.world().rank, plait.world().size
        model, optimizer = prepare_zero(model, optimizer, stage=stage)
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(shard(x, rank, size)), shard(y, rank, size)).backward()
        optimizer.step()
    return {"params": _params(model), "state": optimizer.state_dict()}


def zero_one_gradient(stage: int | None, steps: int) -> list[torch.Tensor]:
    """``model.fc2.bias.grad.zero_()`` between backward and step (SGD with momentum).
    ``stage=None``: the oracle, in this process."""
    model: nn.Module = make_model()
    optimizer = make_optimizer(model, "sgd")
    rank, size = 0, 1
    if stage is not None:
        rank, size = plait.world().rank, plait.world().size
        model, optimizer = prepare_zero(model, optimizer, stage=stage)
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(shard(x, rank, size)), shard(y, rank, size)).backward()
        model.fc2.bias.grad.zero_()
        optimizer.step()
    return _params(model)
