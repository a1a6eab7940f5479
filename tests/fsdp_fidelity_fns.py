"""Rank functions for the drop-in fidelity tests of fully_shard (tests/test_fsdp_fidelity.py).

Each function runs on every rank of a pool (or in one process with ``world`` given) and
returns what the test compares with a single-process oracle of the same model, seed and
global batch (``ddp_fns.batch``, cut with ``ddp_fns.shard``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import plait
from plait.strategies.fsdp import (
    full_optimizer_state_dict,
    full_state_dict,
    fully_shard,
    load_full_optimizer_state_dict,
    load_full_state_dict,
    materialize,
)
from tests.ddp_fns import batch, shard
from tests.fsdp_fns import Block, make_deep

VOCAB, DIM, TOKENS = 11, 8, 6


def _rank_size(world: int | None) -> tuple[int, int]:
    if world is not None:
        return 0, world
    return plait.world().rank, plait.world().size


def _step(model: nn.Module, step: int, rank: int, size: int) -> None:
    x, y = batch(step)
    nn.functional.mse_loss(model(shard(x, rank, size)), shard(y, rank, size)).backward()


# --- 1. clipping ------------------------------------------------------------------------------
def clip_oracle(steps: int, max_norm: float, norm_type: float) -> dict[str, Any]:
    model = make_deep()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        _step(model, step, 0, 1)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)))
        opt.step()
    return {"norms": norms, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def clip_train(
    steps: int, max_norm: float, norm_type: float, world: int | None = None
) -> dict[str, Any]:
    """Train with ``model.clip_grad_norm_``; also report what torch's own clipping of
    ``model.parameters()`` does (it must raise)."""
    rank, size = _rank_size(world)
    model = fully_shard(make_deep(), wrap={nn.Linear})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    norms = []
    refused = ""
    for step in range(steps):
        opt.zero_grad()
        _step(model, step, rank, size)
        if step == 0:
            try:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
            except RuntimeError as error:
                refused = f"{type(error).__name__}: {error}"
        norms.append(float(model.clip_grad_norm_(max_norm, norm_type)))  # type: ignore[operator]
        opt.step()
    return {"norms": norms, "state": full_state_dict(model), "refused": refused}


# --- 2. tied weights --------------------------------------------------------------------------
class TinyGPT(nn.Module):
    """Token embedding, two residual blocks, an output head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in "ab"))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.wte(idx)
        for block in self.blocks:
            h = h + block(h)
        return self.lm_head(h)


def gpt_batch(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, VOCAB, (n, TOKENS), generator=g), torch.randint(
        0, VOCAB, (n, TOKENS), generator=g
    )


def _gpt_loss(model: nn.Module, step: int, rank: int, size: int) -> torch.Tensor:
    idx, target = (shard(t, rank, size) for t in gpt_batch(step))
    logits = model(idx)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def gpt_oracle(steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(steps):
        opt.zero_grad()
        _gpt_loss(model, step, 0, 1).backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


class Outer(nn.Module):
    """TinyGPT one level down: the tied weight's common unit is ``gpt``, not the root."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = TinyGPT()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx)


def gpt_train(steps: int, nested: bool = False, world: int | None = None) -> dict[str, Any]:
    """Each Linear, the Embedding and the blocks are units: wte and lm_head in different
    units, so the tied weight must move to their common unit (the root; with ``nested``,
    the unit ``gpt``, which reshards after its forward)."""
    rank, size = _rank_size(world)
    torch.manual_seed(0)
    wrap = {nn.Embedding, nn.Linear, nn.Sequential} | ({TinyGPT} if nested else set())
    outer = fully_shard(Outer() if nested else TinyGPT(), wrap=wrap)
    model: Any = outer.gpt if nested else outer
    opt = torch.optim.AdamW(outer.parameters(), lr=0.01)
    for step in range(steps):
        opt.zero_grad()
        _gpt_loss(outer, step, rank, size).backward()
        opt.step()
    state = full_state_dict(outer)
    return {
        "state": {k.removeprefix("gpt."): v for k, v in state.items()},
        "same_tensor": model.lm_head.weight is model.wte.weight,
        "units": [(u.path.removeprefix("gpt."), u.numel) for u in outer.sharded_units()],
    }


# --- 3. parameter groups through plait.prepare -----------------------------------------------
def _grouped_adamw(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2]
    no_decay = [
        p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() == 2)
    ]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 0.1, "lr": 0.01},
            {"params": no_decay, "weight_decay": 0.0, "lr": 0.003},
        ],
        betas=(0.8, 0.95),
    )


def groups_oracle(steps: int) -> dict[str, Any]:
    model = make_deep()
    opt = _grouped_adamw(model)
    for step in range(steps):
        opt.zero_grad()
        _step(model, step, 0, 1)
        opt.step()
    return {"state": {k: v.clone() for k, v in model.state_dict().items()}, "opt": opt.state_dict()}


def groups_train(steps: int, strategy: str = "fsdp", world: int | None = None) -> dict[str, Any]:
    rank, size = _rank_size(world)
    model = make_deep()
    model, opt = plait.prepare(model, _grouped_adamw(model), strategy=strategy, wrap={nn.Linear})
    assert opt is not None
    for step in range(steps):
        opt.zero_grad()
        _step(model, step, rank, size)
        opt.step()
    return {
        "state": full_state_dict(model),
        "opt": full_optimizer_state_dict(model, opt),
        "groups": [
            {k: v for k, v in g.items() if k != "params"} | {"n": len(g["params"])}
            for g in opt.param_groups
        ],
        "type": type(opt).__name__,
    }


# --- 4. resume from full state; meta-device init -----------------------------------------------
def _sharded_adam(world: int | None) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = fully_shard(make_deep(seed=7), wrap={nn.Linear, Block})
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def resume_save(steps: int, world: int | None = None) -> dict[str, Any]:
    """Train ``steps`` steps; the full model and optimizer state (equal on every rank)."""
    rank, size = _rank_size(world)
    model, opt = _sharded_adam(world)
    for step in range(steps):
        opt.zero_grad()
        _step(model, step, rank, size)
        opt.step()
    return {"model": full_state_dict(model), "opt": full_optimizer_state_dict(model, opt)}


def resume_continue(saved: dict[str, Any], start: int, steps: int, world: int | None = None) -> Any:
    """A fresh sharded model and optimizer, loaded from ``saved``, trained on from ``start``."""
    rank, size = _rank_size(world)
    model, opt = _sharded_adam(world)
    load_full_state_dict(model, saved["model"])
    load_full_optimizer_state_dict(model, opt, saved["opt"])
    for step in range(start, steps):
        opt.zero_grad()
        _step(model, step, rank, size)
        opt.step()
    return {"model": full_state_dict(model), "opt": full_optimizer_state_dict(model, opt)}


def resume_oracle(steps: int) -> dict[str, Any]:
    model = make_deep(seed=7)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(steps):
        opt.zero_grad()
        _step(model, step, 0, 1)
        opt.step()
    return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": opt.state_dict()}


def meta_init(world: int | None = None) -> dict[str, torch.Tensor]:
    """Build under the meta device, shard, materialize with seed 3: full state dict."""
    with torch.device("meta"):
        model = make_deep()
    fully_shard(model, wrap={nn.Linear})
    torch.manual_seed(3)

    def init(m: nn.Module) -> None:  # what DeepNet's constructor does, in its order
        for sub in m.modules():
            if isinstance(sub, (nn.Linear, nn.LayerNorm)):
                sub.reset_parameters()
        m.scale.fill_(0.5)  # type: ignore[operator]

    materialize(model, init)
    return full_state_dict(model)


# --- 6. loss scaling ---------------------------------------------------------------------------
def grad_scaler_skips_together() -> dict[str, Any]:
    """torch.amp.GradScaler with fully_shard: step 0 has a non-finite gradient on rank 1's
    shard only; every rank must skip it (shards unchanged, scale halved), then step."""
    world = plait.world()
    model = fully_shard(make_deep(), wrap={nn.Linear})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = full_state_dict(model)
    out = []
    for step in range(2):
        opt.zero_grad()
        x, y = batch(step)
        loss = nn.functional.mse_loss(
            model(shard(x, world.rank, world.size)), shard(y, world.rank, world.size)
        )
        scaler.scale(loss).backward()
        if step == 0 and world.rank == 1:
            shard_param = next(iter(model.parameters()))
            assert shard_param.grad is not None
            shard_param.grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        state = full_state_dict(model)
        out.append(
            {
                "scale": float(scaler.get_scale()),
                "unchanged": all(torch.equal(state[k], before[k]) for k in before),
            }
        )
    return {"steps": out}


# --- 7. wrap-time consistency ------------------------------------------------------------------
class _Swapped(nn.Module):
    def __init__(self, swap: bool) -> None:
        super().__init__()
        if swap:
            self.b = nn.Linear(4, 3)
            self.a = nn.Linear(3, 4)
        else:
            self.a = nn.Linear(3, 4)
            self.b = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def refuses_other_order() -> str:
    """Rank 1 registers its modules in another order: fully_shard must refuse on every rank."""
    try:
        fully_shard(_Swapped(swap=plait.world().rank == 1))
    except ValueError as error:
        return str(error)
    return ""


# --- 4. explicit prefetch, unshard/reshard, frozen parameters ----------------------------------
def explicit_prefetch_train(steps: int, world: int | None = None) -> dict[str, Any]:
    """Adam (as resume_oracle) with explicit prefetch lists and ``prefetch=False``: the
    listed units are all-gathered asynchronously; the numbers stay the oracle's."""
    from plait import comm

    rank, size = _rank_size(world)
    model = fully_shard(make_deep(seed=7), wrap={nn.Linear}, prefetch=False)
    m: Any = model
    m.set_modules_to_forward_prefetch([m.inp, m.blocks[0].fc])
    m.blocks[1].fc.set_modules_to_backward_prefetch([m.blocks[0].fc, m.inp])
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    issued: list[bool] = []
    original = comm.all_gather

    def recording(*args: Any, **kwargs: Any) -> Any:
        issued.append(bool(kwargs.get("async_op", False)))
        return original(*args, **kwargs)

    comm.all_gather = recording  # type: ignore[assignment]
    try:
        for step in range(steps):
            opt.zero_grad()
            _step(model, step, rank, size)
            opt.step()
    finally:
        comm.all_gather = original
    return {"state": full_state_dict(model), "async_gathers": sum(issued)}


def unshard_edit_reshard(world: int | None = None) -> dict[str, Any]:
    """``unshard()``, edit a weight in place, ``reshard()``: the edit is kept. Then the
    meta-device route of FSDP2: ``to_empty``, ``unshard``, ``reset_parameters``, ``reshard``."""
    model: Any = fully_shard(make_deep(), wrap={nn.Linear})
    model.unshard(async_op=True).wait()
    gathered = model.inp.weight.device.type != "meta"
    with torch.no_grad():
        model.inp.weight.fill_(0.25)
    model.reshard()
    edited = full_state_dict(model)["inp.weight"]
    with torch.device("meta"):
        meta: Any = make_deep()
    fully_shard(meta, wrap={nn.Linear})
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    meta.unshard()
    with torch.no_grad():
        for sub in meta.modules():
            if isinstance(sub, (nn.Linear, nn.LayerNorm)):
                sub.reset_parameters()
        meta.scale.fill_(0.5)
    meta.reshard()
    return {"gathered": gathered, "edited": edited, "meta": full_state_dict(meta)}


def frozen_train(steps: int, world: int | None = None) -> dict[str, Any]:
    """``inp.weight`` frozen: the root unit holds a frozen and a trainable flat shard."""
    rank, size = _rank_size(world)
    model = make_deep(seed=7)
    model.inp.weight.requires_grad_(False)
    fully_shard(model, wrap={Block})
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    for step in range(steps):
        opt.zero_grad()
        _step(model, step, rank, size)
        opt.step()
    kinds = sorted(
        (u.requires_grad, u.numel)
        for u in model.sharded_units()  # type: ignore[operator]
        if u.module is model
    )
    return {"state": full_state_dict(model), "kinds": kinds}


def frozen_oracle(steps: int) -> dict[str, torch.Tensor]:
    model = make_deep(seed=7)
    model.inp.weight.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    for step in range(steps):
        opt.zero_grad()
        _step(model, step, 0, 1)
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}
