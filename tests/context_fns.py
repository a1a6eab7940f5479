"""Rank functions for tests/test_context.py: ring and Ulysses attention, and models under
context parallelism, against one process on the whole sequence (float64)."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch.nn import functional as F

import plait
from plait import comm
from plait.strategies.context import (
    ring_attention,
    shard_sequence,
    ulysses_attention,
)
from plait.strategies.context.ring_attention import WORK

ring_module = importlib.import_module("plait.strategies.context.ring_attention")

B, H, D = 2, 4, 5


def qkv(
    seq: int, kv_heads: int = H
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The global q, k, v and an upstream gradient, the same on every rank."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, H, seq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, kv_heads, seq, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, kv_heads, seq, D, generator=g, dtype=torch.float64)
    dy = torch.randn(B, H, seq, D, generator=g, dtype=torch.float64)
    return q, k, v, dy


def attention_vs_oracle(
    kernel: str, seq: int, causal: bool, balanced: bool, kv_heads: int = H, fused: bool = True
) -> dict[str, Any]:
    """This rank's output and q/k/v gradients against its rows of one-process attention
    (``fused=False``: ring attention's plain arithmetic instead of the fused CPU kernel)."""
    ring_module.FUSED_CPU_KERNEL = fused
    mesh = plait.Mesh(cp=plait.world().size)
    q, k, v, dy = qkv(seq, kv_heads)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=kv_heads != H)
    want.backward(dy)
    mine = [shard_sequence(t, mesh, balanced=balanced, dim=2)[0] for t in (q, k, v, dy)]
    local = [t.clone().requires_grad_(True) for t in mine[:3]]
    fn = ring_attention if kernel == "ring" else ulysses_attention
    comm.reset_stats()
    got = fn(*local, group=mesh.group("cp"), causal=causal, balanced=balanced)
    got.backward(mine[3])
    sent = {k[1]: v.bytes_sent for k, v in comm.group_stats().items()}
    calls = {k[1]: v.calls for k, v in comm.group_stats().items()}

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.detach() - b).abs().max())

    shard = lambda t: shard_sequence(t, mesh, balanced=balanced, dim=2)[0]  # noqa: E731
    return {
        "out": err(got, shard(want.detach())),
        "grads": [err(a.grad, shard(b.grad)) for a, b in zip(local, leaves, strict=True)],
        "work": WORK.get((mesh.size("cp"), mesh.group("cp").rank)),
        "sent": sent,
        "calls": calls,
        "kv_bytes": 2 * local[1].numel() * local[1].element_size(),
        "q_bytes": local[0].numel() * local[0].element_size(),
    }


# --- models under plait.prepare(strategy="cp") ----------------------------------------------
STEPS, BATCH, SEQ = 3, 2, 16


def _tokens(step: int, vocab: int, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, vocab, (batch, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _gpt() -> Any:
    from plait.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab=23, layers=2, heads=4, width=16, seq_len=SEQ, dtype=torch.float64))


def _llama(heads: int = 4, kv_heads: int = 2) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=23,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).double()


def _logits(model: Any, ids: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
    if pos is None:
        return model(ids)
    out = model(input_ids=ids, position_ids=pos.expand(ids.shape[0], -1))
    return out.logits


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def model_oracle(family: str, dp: int) -> dict[str, Any]:
    """One process on the whole sequences of the global batch (dp slices of BATCH rows)."""
    model = _gpt() if family == "gpt" else _llama()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, grads = [], {}
    hf = family != "gpt"
    for step in range(STEPS):
        ids, targets = _tokens(step, 23, BATCH * dp)
        pos = torch.arange(SEQ).unsqueeze(0) if hf else None
        opt.zero_grad()
        loss = _ce(_logits(model, ids, pos), targets)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        losses.append(float(loss.detach()))
        opt.step()
    return {
        "losses": losses,
        "grads": grads,
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }


def model_under_cp(family: str, context: str, balanced: bool, dp: int) -> dict[str, Any]:
    """plait.prepare(strategy='cp') on Mesh(cp=world/dp, dp=dp): STEPS Adam steps, each rank
    on its dp slice of the batch and its chunks of the sequence."""
    w = plait.world().size
    mesh = plait.Mesh(cp=w // dp, dp=dp) if dp > 1 else plait.Mesh(cp=w)
    model = _gpt() if family == "gpt" else _llama()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    runner, opt = plait.prepare(
        model, opt, strategy="cp", mesh=mesh, context=context, balanced=balanced
    )
    assert opt is not None
    d = mesh.rank("dp") if dp > 1 else 0
    losses, grads = [], {}
    hf = family != "gpt"
    for step in range(STEPS):
        ids, targets = _tokens(step, 23, BATCH * dp)
        rows = slice(d * BATCH, (d + 1) * BATCH)
        ids, pos = shard_sequence(ids[rows], mesh, balanced=balanced)
        targets, _ = shard_sequence(targets[rows], mesh, balanced=balanced)
        opt.zero_grad()
        loss = _ce(_logits(runner, ids, pos if hf else None), targets)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        mean = loss.detach().clone()
        comm.all_reduce(mean, "avg")  # the mean over all ranks' tokens: the global loss
        losses.append(float(mean))
        opt.step()
    return {
        "losses": losses,
        "grads": grads,
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }


def refusals() -> dict[str, str]:
    """Each bad input's error text (every case raises before any attention message)."""
    from torch import nn

    from plait.models.gpt import GPT, GPTConfig

    mesh = plait.Mesh(cp=plait.world().size)
    out: dict[str, str] = {}

    def catch(name: str, fn: Any) -> None:
        try:
            fn()
        except (ValueError, KeyError) as exc:
            out[name] = str(exc)
        else:
            out[name] = "NOT REFUSED"

    def opt(m: Any) -> Any:
        return torch.optim.SGD(m.parameters(), lr=0.1)

    odd = GPT(GPTConfig(vocab=23, layers=1, heads=3, width=15, seq_len=SEQ, dtype=torch.float64))
    llama = _llama()
    plait.prepare(llama, opt(llama), strategy="cp", mesh=mesh, context="ring")
    from transformers import MistralConfig, MistralForCausalLM

    mistral = MistralForCausalLM(
        MistralConfig(
            vocab_size=23,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=4,
        )
    )
    plait.prepare(mistral, None, strategy="cp", mesh=mesh, context="ring")
    ids = torch.zeros(1, SEQ // 2, dtype=torch.int64)
    pos = torch.arange(SEQ // 2).unsqueeze(0)
    cases: dict[str, Any] = {
        "uneven": lambda: shard_sequence(torch.zeros(1, 10), mesh),
        "ulysses_heads": lambda: plait.prepare(
            odd, opt(odd), strategy="cp", mesh=mesh, context="ulysses"
        ),
        "no_attention": lambda: plait.prepare(
            nn.Linear(2, 2), None, strategy="cp", mesh=mesh, positions=False
        ),
        "no_positions": lambda: plait.strategies.context.style.context_parallel(_gpt(), mesh=mesh),
        "context": lambda: plait.prepare(_gpt(), None, strategy="cp", mesh=mesh, context="x"),
        "no_cp": lambda: plait.prepare(_gpt(), None, strategy="cp", mesh=plait.Mesh(dp=2)),
        "hf_positions": lambda: llama(input_ids=ids),
        "hf_padding": lambda: llama(
            input_ids=ids,
            position_ids=pos,
            attention_mask=torch.tensor([[0] + [1] * (SEQ // 2 - 1)]),
        ),
        "sliding_window": lambda: mistral(input_ids=ids, position_ids=pos),
        "pp_in_cp": lambda: plait.prepare(
            _gpt(), None, strategy="cp", mesh=plait.Mesh(cp=plait.world().size, pp=1)
        ),
        "cp_in_pipeline": lambda: plait.prepare(
            _gpt(),
            None,
            strategy="pipeline",
            mesh=plait.Mesh(pp=1, cp=plait.world().size),
            microbatches=2,
        ),
        "odd_tokens": lambda: ring_attention(
            *[torch.zeros(1, 2, 3, 4, dtype=torch.float64)] * 3, group=mesh.group("cp")
        ),
    }
    for name, fn in cases.items():
        catch(name, fn)
    return out


def cp_tp(family: str, context: str) -> dict[str, Any]:
    """Mesh(tp=2, cp=2): the model tensor-parallel over tp (its family's plan; the loss
    vocab-parallel where the head is split), its attention on each rank's heads
    context-parallel over cp; STEPS Adam steps."""
    from plait import checkpoint
    from plait.strategies.tensor import loss_fn

    mesh = plait.Mesh(tp=2, cp=2)
    model = _gpt() if family == "gpt" else _llama()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    runner, opt = plait.prepare(model, opt, strategy="cp", mesh=mesh, context=context)
    assert opt is not None
    loss_of = loss_fn(model)
    losses, grads = [], {}
    for step in range(STEPS):
        ids, targets = _tokens(step, 23)
        ids, pos = shard_sequence(ids, mesh)
        targets, _ = shard_sequence(targets, mesh)
        opt.zero_grad()
        loss = loss_of(_logits(runner, ids, None if family == "gpt" else pos), targets)
        loss.backward()
        mean = loss.detach().clone()
        comm.all_reduce(mean, "avg", group=mesh.group("cp"))
        losses.append(float(mean))
        opt.step()
    state = checkpoint.full_state_dict(model)
    return {"losses": losses, "grads": grads, "state": {k: v.clone() for k, v in state.items()}}
