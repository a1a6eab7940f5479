"""Rank function for tests/test_tensor_accounting.py: bytes one transformer layer sends."""

from __future__ import annotations

import torch

import plait
from plait import comm
from plait.models.gpt import Block, GPTConfig
from plait.strategies.tensor import mappings, parallelize

B, S, H = 2, 8, 16


def layer_bytes(sequence_parallel: bool) -> dict[str, int]:
    """Forward + backward of one GPT block on the ring; bytes this rank sent per collective."""
    mesh = plait.Mesh(tp=plait.world().size)
    g = mesh.group("tp")
    torch.manual_seed(0)  # the same dense block on every rank (checked when it is split)
    block = Block(GPTConfig(width=H, heads=4, dtype=torch.float32))
    plan = {"attn.qkv": "colwise", "attn.proj": "rowwise", "mlp.fc1": "colwise"}
    plan["mlp.fc2"] = "rowwise"
    if sequence_parallel:
        plan |= {"ln1": "sequence", "ln2": "sequence"}
    parallelize(block, mesh, plan, algorithm="ring")
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(0))
    if sequence_parallel:
        x = mappings.split_dim(x, 1, g)
    x.requires_grad_(True)
    comm.reset_stats()
    block(x).sum().backward()
    stats = comm.stats(reset=True)
    return {f"{c}/{a}": s.bytes_sent for (c, a), s in stats.items()} | {
        f"{c}/{a}#calls": s.calls for (c, a), s in stats.items()
    }


def bytes_per_group() -> dict[str, dict[str, int]]:
    """On ``Mesh(dp=2, tp=2)``: one block's forward + backward on ``tp``, then one all-reduce
    of its gradients on ``dp``; bytes sent per group name, and this rank's group names."""
    mesh = plait.Mesh(dp=2, tp=2)
    torch.manual_seed(0)  # the same dense block on every rank (checked when it is split)
    block = Block(GPTConfig(width=H, heads=4, dtype=torch.float32))
    plan = {"attn.qkv": "colwise", "attn.proj": "rowwise", "mlp.fc1": "colwise"}
    plan["mlp.fc2"] = "rowwise"
    parallelize(block, mesh, plan, algorithm="ring")
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(0), requires_grad=True)
    comm.reset_stats()
    block(x).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in block.parameters()])
    comm.all_reduce(grads, "avg", group=mesh.group("dp"), algorithm="ring")
    by_group: dict[str, dict[str, int]] = {}
    for (name, c, a), s in comm.group_stats(reset=True).items():
        by_group.setdefault(name, {})[f"{c}/{a}"] = s.bytes_sent
    return {
        "sent": by_group,  # type: ignore[dict-item]
        "tp": mesh.group("tp").name,  # type: ignore[dict-item]
        "dp": mesh.group("dp").name,  # type: ignore[dict-item]
        "grad_numel": grads.numel(),  # type: ignore[dict-item]
    }
