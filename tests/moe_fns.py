"""Rank functions for tests/test_moe_ep.py: the expert-parallel MoE layer and the MoE GPT
against the one-process oracle on the global batch, routing proofs and byte counts."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import plait
from plait import comm
from plait.models.gpt import GPT, GPTConfig, MoEConfig
from plait.moe import MoE, expert_parallel

D, E, SEQ = 6, 4, 12


def layer_case(case: str) -> dict[str, Any]:
    """MoE options of each layer case; every case skews the router so loads are uneven."""
    base: dict[str, Any] = {
        "num_experts": E,
        "top_k": 2,
        "capacity_factor": 1.0,
        "min_capacity": 0,
        "second_expert": "random",
        "aux_loss_weight": 0.1,
        "z_loss_weight": 0.01,
        "seed": 7,
        "dtype": torch.float64,
    }
    extra = {
        "top2_random": {},
        "top1": {"top_k": 1},
        "sampling": {"second_expert": "sampling"},
        "dropless": {"drop_tokens": False},
    }[case]
    return base | extra


def build_layer(case: str) -> MoE:
    torch.manual_seed(3)
    moe = MoE(D, **layer_case(case))
    with torch.no_grad():
        moe.gate.weight[0] += 0.8  # expert 0 is popular: uneven loads, drops
    return moe


def global_batch(size: int, step: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(size, SEQ, D, generator=g, dtype=torch.float64) + 0.3


def _loss(y: torch.Tensor) -> torch.Tensor:
    return (y * torch.linspace(-1, 1, D, dtype=y.dtype)).pow(2).mean()


def layer_vs_oracle(case: str, per_rank: int, pad_to_capacity: bool = False) -> dict[str, Any]:
    """Every rank: the oracle (all experts, global batch, dropless dispatch) and the
    expert-parallel layer on its slice (``pad_to_capacity``: its static-capacity dispatch),
    two forward/backward passes (two draws); differences out."""
    mesh = plait.Mesh(ep=plait.world().size)
    R, r = mesh.size("ep"), mesh.rank("ep")
    oracle = build_layer(case)
    layer = build_layer(case)
    layer.pad_to_capacity = pad_to_capacity
    moe = expert_parallel(layer, mesh=mesh)
    out: dict[str, Any] = {"y": 0.0, "xgrad": 0.0, "grads": 0.0, "kept": [], "routed": []}
    for step in range(2):
        xg = global_batch(R * per_rank, step).requires_grad_(True)
        for p in oracle.parameters():
            p.grad = None
        for p in moe.parameters():
            p.grad = None
        y_want = oracle(xg)
        _loss(y_want).backward()
        x = xg.detach()[r * per_rank : (r + 1) * per_rank].clone().requires_grad_(True)
        y = moe(x)
        _loss(y).backward()
        mine = slice(r * per_rank, (r + 1) * per_rank)
        out["y"] = max(out["y"], float((y - y_want[mine]).abs().max()))
        assert xg.grad is not None and x.grad is not None
        out["xgrad"] = max(out["xgrad"], float((x.grad / R - xg.grad[mine]).abs().max()))
        want = dict(oracle.named_parameters())
        names = []
        for name, p in moe.named_parameters():
            assert p.grad is not None, name
            names.append(name)
            w = want[name].grad
            assert w is not None, name
            out["grads"] = max(out["grads"], float((p.grad - w).abs().max()))
        out["names"] = names
        assert moe.last_stats is not None and oracle.last_stats is not None
        out["kept"].append((moe.last_stats.tokens_per_expert, oracle.last_stats.tokens_per_expert))
        out["routed"].append(
            (moe.last_stats.routed_per_expert, oracle.last_stats.routed_per_expert)
        )
    return out


class _RoundRobinGate(nn.Module):
    """Token s of every group goes to expert s % E, with a probability of nearly 1."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.experts = experts
        self.weight = nn.Parameter(torch.zeros(experts, D, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        S = x.shape[1]
        hot = F.one_hot(torch.arange(S) % self.experts, self.experts).to(x.dtype)
        return 30.0 * hot.expand(x.shape[0], S, self.experts) + x[..., :1] * 0


class _Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor
        self.w = nn.Parameter(torch.ones((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor * self.w


def round_robin() -> dict[str, Any]:
    """Round-robin gate, expert e scales by (rank holding e) + 1: y tells where tokens went."""
    R = plait.world().size
    mesh = plait.Mesh(ep=R)
    local = E // R
    factors = iter([e // local + 1.0 for e in range(E)])
    moe = MoE(
        D,
        num_experts=E,
        top_k=1,
        capacity_factor=float(E),
        expert=lambda: _Scale(next(factors)),
        dtype=torch.float64,
    )
    moe.gate = _RoundRobinGate(E)
    expert_parallel(moe, mesh=mesh)
    x = torch.ones(2, SEQ, D, dtype=torch.float64)
    y = moe(x)
    assert moe.last_stats is not None
    return {"y": y[..., 0], "held": sorted(moe.experts), "kept": moe.last_stats.tokens_per_expert}


def bytes_per_step(case: str) -> dict[str, Any]:
    """One forward/backward on the ring all-to-all; what was sent against the theory."""
    R = plait.world().size
    mesh = plait.Mesh(ep=R)
    opts = layer_case(case)
    torch.manual_seed(3)
    moe = MoE(D, **(opts | {"algorithm": "ring"}))
    with torch.no_grad():
        moe.gate.weight[0] += 0.8
    expert_parallel(moe, mesh=mesh, algorithm="ring")
    x = global_batch(2 * R)[2 * mesh.rank("ep") : 2 * mesh.rank("ep") + 2]
    comm.reset_stats()
    # counts for the theory: what routing this rank's tokens gives (same draws as the run)
    from plait.strategies.moe import dispatch as moe_dispatch
    from plait.strategies.moe.gshard_gate import route

    y = moe(x.requires_grad_(True))
    _loss(y).backward()
    sent = comm.stats()
    # recompute this call's routing with the same draws: call counter back by one
    moe.draw_calls -= 1
    with torch.no_grad():
        grouped = moe._grouped(x)
        logits = moe.gate(grouped)
        uniform, gumbel = moe._draws(*grouped.shape[:2], logits.dtype)
        routing = route(
            logits,
            top_k=moe.top_k,
            capacity=moe._capacity(grouped.shape[1]),
            second_expert=moe.second_expert,
            uniform=uniform,
            gumbel=gumbel,
        )
    mine = torch.tensor(moe_dispatch.plan(routing).counts)
    every = torch.empty(R, E, dtype=torch.int64)
    comm.all_gather(every, mine, group=mesh.group("ep"))
    r, local = mesh.rank("ep"), E // R
    held = slice(r * local, (r + 1) * local)
    n_out = int(mine.sum() - mine[held].sum())
    n_in = int(every[:, held].sum() - every[r, held].sum())
    a2a = sent.get(("all_to_all", "ring"))
    assert moe.last_stats is not None
    assert (moe.last_stats.rows_out, moe.last_stats.rows_in) == (n_out, n_in)
    return {
        "sent": 0 if a2a is None else a2a.bytes_sent,
        "calls": 0 if a2a is None else a2a.calls,
        "theory": (2 * n_out + 2 * n_in) * D * 8,
        "n_out": n_out,
        "n_in": n_in,
    }


# --- the MoE GPT ---------------------------------------------------------------------------
STEPS, PER_RANK = 3, 1


def gpt_config() -> GPTConfig:
    moe = MoEConfig(
        num_experts=4,
        capacity_factor=1.0,
        min_capacity=0,
        second_expert="random",
        z_loss_weight=1e-3,
        seed=11,
    )
    return GPTConfig(
        vocab=13,
        layers=2,
        heads=4,
        width=16,
        seq_len=8,
        dtype=torch.float64,
        moe=moe,
        moe_every=1,
    )


def gpt_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 13, (size, 9), generator=g)
    return ids[:, :-1], ids[:, 1:]


def gpt_oracle(size: int) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    model = GPT(gpt_config())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loads = []
    for step in range(STEPS):
        x, y = gpt_batch(step, size)
        opt.zero_grad()
        F.cross_entropy(model(x).reshape(-1, 13), y.reshape(-1)).backward()
        opt.step()
        loads.append(plait.moe.collect(model)["blocks.1.mlp"].tokens_per_expert)
    return model.state_dict(), loads


# --- gradient accumulation: 2 micro-steps of 2 sequences per rank, clipping active -----------
ACC, MICRO, MAX_NORM = 2, 2, 0.2


def _micro(step: int, slices: int, b: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``m`` of batch slice ``b`` of ``step``'s global batch."""
    x, y = gpt_batch(step, slices * ACC * MICRO)
    rows = slice((b * ACC + m) * MICRO, (b * ACC + m + 1) * MICRO)
    return x[rows], y[rows]


def _acc_steps(model: nn.Module, opt: torch.optim.Optimizer, micro: Any) -> list[float]:
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(ACC):
            x, y = micro(step, m)
            (F.cross_entropy(model(x).reshape(-1, 13), y.reshape(-1)) / ACC).backward()
        norms.append(float(plait.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
    return norms


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    return [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]


def gpt_acc_oracle(slices: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, 2 accumulation micro-steps; micro-batch m is the m-th micro-batch of
    every batch slice, in slice order (what the expert-parallel ranks see together)."""
    model = GPT(gpt_config())
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)

    def micro(step: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [_micro(step, slices, b, m) for b in range(slices)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    norms = _acc_steps(model, opt, micro)
    return model.state_dict(), norms


def gpt_ep_acc(dp: int) -> dict[str, Any]:
    """The MoE GPT under strategy 'ep', 2 accumulation micro-steps, two AdamW groups."""
    w = plait.world().size
    mesh = plait.Mesh(ep=w // dp, dp=dp) if dp > 1 else plait.Mesh(ep=w)
    model = GPT(gpt_config())
    model, opt = plait.prepare(
        model, torch.optim.AdamW(_groups(model), lr=1e-2), strategy="ep", mesh=mesh
    )
    assert opt is not None
    b = model.plait_expert_parallel.batch_rank  # type: ignore[union-attr]
    norms = _acc_steps(model, opt, lambda step, m: _micro(step, w, b, m))
    return {"state": copy.deepcopy(model.state_dict()), "norms": norms}


def gpt_ep(dp: int) -> dict[str, Any]:
    """Mesh(ep=world/dp, dp=dp), plait.prepare(strategy='ep'), STEPS Adam steps."""
    w = plait.world().size
    mesh = plait.Mesh(ep=w // dp, dp=dp) if dp > 1 else plait.Mesh(ep=w)
    model = GPT(gpt_config())
    model, opt = plait.prepare(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), strategy="ep", mesh=mesh
    )
    assert opt is not None
    b = model.plait_expert_parallel.batch_rank  # type: ignore[union-attr]
    loads = []
    for step in range(STEPS):
        x, y = gpt_batch(step, w * PER_RANK)
        mine = slice(b * PER_RANK, (b + 1) * PER_RANK)
        opt.zero_grad()
        F.cross_entropy(model(x[mine]).reshape(-1, 13), y[mine].reshape(-1)).backward()
        opt.step()
        loads.append(plait.moe.collect(model)["blocks.1.mlp"].tokens_per_expert)
    return {"state": copy.deepcopy(model.state_dict()), "loads": loads}


def refusals() -> dict[str, str]:
    out = {}
    cases = {
        "ratio": lambda: expert_parallel(
            MoE(D, num_experts=3, top_k=1), mesh=plait.Mesh(ep=plait.world().size)
        ),
        "no_moe": lambda: expert_parallel(nn.Linear(2, 2), mesh=plait.Mesh(ep=2)),
        "tp": lambda: expert_parallel(MoE(D, num_experts=4), mesh=plait.Mesh(ep=1, tp=2)),
    }
    for name, fn in cases.items():
        try:
            fn()
        except ValueError as exc:
            out[name] = str(exc)
        else:
            out[name] = "NOT REFUSED"
    return out


def nonfinite(policy: str) -> dict[str, Any]:
    """Rank 1's own gradient of one dense parameter turns NaN in the second backward: every
    rank raises naming rank 1 and the parameter ('raise'), or skips the step ('skip')."""
    w = plait.world().size
    model = GPT(gpt_config())
    model, opt = plait.prepare(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        strategy="ep",
        mesh=plait.Mesh(ep=w),
        check_finite=policy,
    )
    assert opt is not None
    b = model.plait_expert_parallel.batch_rank  # type: ignore[union-attr]
    out: dict[str, Any] = {"error": None}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for step in range(2):
        x, y = _micro(step, w, b, 0)
        opt.zero_grad()
        loss = F.cross_entropy(model(x).reshape(-1, 13), y.reshape(-1))
        if step == 1 and plait.world().rank == 1:
            model.blocks[1].ln1.weight.register_hook(lambda g: g * float("nan"))
        if step == 1:
            before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            loss.backward()
        except FloatingPointError as exc:
            out["error"] = str(exc)
            return out
        opt.step()
    out["unchanged"] = all(
        torch.equal(v, before[k]) for k, v in model.state_dict().items() if v.is_floating_point()
    )
    return out


def gather_uneven() -> dict[str, Any]:
    """plait.strategies.moe.stacked.gather_rows with r + 1 rows on rank r: every rank gets
    every rank's rows in rank order; the gradient of each copy comes home and adds up."""
    from plait.strategies.moe.stacked import gather_rows

    g = comm.world()
    rows = [torch.full((r + 1, 3), float(r), dtype=torch.float64) for r in range(g.size)]
    x = rows[g.rank].clone().requires_grad_(True)
    out = gather_rows(x, g)
    weight = torch.arange(out.numel(), dtype=torch.float64).reshape(out.shape)
    (out * weight).sum().backward()
    start = sum(r + 1 for r in range(g.rank))
    assert x.grad is not None
    return {
        "equal": torch.equal(out, torch.cat(rows)),
        "grad": torch.equal(x.grad, g.size * weight[start : start + g.rank + 1]),
    }


def structure_mismatch() -> str:
    """Rank 1 built a wider model: strategy 'ep' refuses on every rank before any slicing."""
    config = gpt_config()
    if plait.world().rank == 1:
        config = dataclasses.replace(config, width=24)
    model = GPT(config)
    try:
        plait.prepare(model, strategy="ep", mesh=plait.Mesh(ep=plait.world().size))
    except ValueError as exc:
        return str(exc)
    return "NOT REFUSED"
