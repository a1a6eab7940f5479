"""Rank functions for tests/test_placement.py."""

from __future__ import annotations

import torch

import plait
from plait.comm.group import Group
from plait.strategies.placement import place


def _full_grads() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return (
        torch.randn(4, 6, generator=g, dtype=torch.float64),
        torch.randn(5, generator=g, dtype=torch.float64),
    )


def clip_split_and_copied(norm_type: float, max_norm: float) -> tuple[float, list[torch.Tensor]]:
    """A weight split by rows over the world, a bias copied on every rank; clip them."""
    world: Group = plait.runtime.world()
    w, b = _full_grads()
    rows = w.shape[0] // world.size
    pw = torch.nn.Parameter(torch.zeros(rows, w.shape[1], dtype=torch.float64))
    pb = torch.nn.Parameter(torch.zeros_like(b))
    pw.grad = w[world.rank * rows : (world.rank + 1) * rows].clone()
    pb.grad = b.clone()
    place(pw, shard=(world,))
    place(pb, replicate=(world,))
    norm = plait.clip_grad_norm_([pw, pb], max_norm, norm_type)
    return float(norm), [pw.grad, pb.grad]


def unplaced_refused() -> str:
    world: Group = plait.runtime.world()
    a = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    b = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    a.grad, b.grad = torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    place(a, shard=(world,))
    try:
        plait.clip_grad_norm_([a, b], 1.0)
    except ValueError as e:
        return str(e)
    return "not refused"


def tp_inside_ddp(clip: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    """plait's GPT split over tp 2, inside DDP over dp 2 (the README's quickstart), clipped
    with plait.clip_grad_norm_(params): the global norm counts each dp copy once."""
    from plait.models import GPT, GPTConfig
    from plait.strategies.tensor import loss_fn

    mesh = plait.Mesh(dp=2, tp=2)
    cfg = GPTConfig(vocab=13, layers=2, heads=4, width=16, seq_len=8, dtype=torch.float64)
    dense = GPT(cfg)
    model, opt = plait.prepare(
        dense, torch.optim.SGD(dense.parameters(), lr=0.1), strategy="tp", mesh=mesh
    )
    assert opt is not None
    loss_of = loss_fn(model)
    ddp = plait.DistributedDataParallel(model, group=mesh.group("dp"))
    d = mesh.rank("dp")
    norms = []
    for step in range(2):
        x, y = tp_batch(step)
        loss_of(ddp(x[2 * d : 2 * d + 2]), y[2 * d : 2 * d + 2]).backward()
        norms.append(float(plait.clip_grad_norm_(ddp.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return norms, plait.checkpoint.full_state_dict(model)


def tp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 13, (4, 9), generator=g)
    return x[:, :-1], x[:, 1:]


def tp_oracle(clip: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    from plait.models import GPT, GPTConfig

    cfg = GPTConfig(vocab=13, layers=2, heads=4, width=16, seq_len=8, dtype=torch.float64)
    model = GPT(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    for step in range(2):
        x, y = tp_batch(step)
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.reshape(-1, 13), y.reshape(-1)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return norms, {k: v.detach().clone() for k, v in model.state_dict().items()}
