"""plait.models: the reference models and the text source (one process)."""

from __future__ import annotations

import math

import pytest
import torch

from plait.models import GPT, MLP, CharTokenizer, DigitsCNN, GPTConfig, python_docs, token_batches
from plait.models.gpt import loss


def test_gpt_is_seeded_and_shapes():
    cfg = GPTConfig(vocab=11, layers=2, heads=2, width=8, seq_len=6)
    a, b = GPT(cfg), GPT(cfg)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    ids = torch.randint(0, 11, (3, 6))
    assert a(ids).shape == (3, 6, 11)
    assert not torch.equal(
        GPT(GPTConfig(vocab=11, heads=2, width=8, seed=1)).tok.weight, a.tok.weight
    )
    with pytest.raises(ValueError, match="exceeds seq_len 6"):
        a(torch.zeros(1, 7, dtype=torch.int64))
    with pytest.raises(ValueError, match="width 10 is not a multiple of heads 4"):
        GPTConfig(width=10, heads=4)


def test_gpt_is_causal():
    model = GPT(GPTConfig(vocab=13, layers=1, heads=2, width=8, seq_len=8, dtype=torch.float64))
    ids = torch.randint(0, 13, (2, 8), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 13
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :5], b[:, :5], rtol=0, atol=0)
    assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_tied_head_shares_the_embedding():
    model = GPT(GPTConfig(vocab=11, heads=2, width=8, tied=True))
    assert model.head.weight is model.tok.weight
    untied = GPT(GPTConfig(vocab=11, heads=2, width=8))
    n_tied = sum(p.numel() for p in model.parameters())
    assert n_tied == sum(p.numel() for p in untied.parameters()) - 11 * 8


def test_gpt_learns_python_docs():
    tok = CharTokenizer()
    assert tok.vocab == 96
    text = python_docs(20_000)
    assert "assert" in text[:100] and len(text) == 20_000  # topics sorted: "assert" first
    ids = tok.encode(text)
    assert tok.decode(ids[:100]) == text[:100]
    model = GPT(GPTConfig(vocab=tok.vocab, layers=1, heads=2, width=32, seq_len=16))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(20):
        x, y = token_batches(ids, batch=8, seq_len=16, seed=step)
        opt.zero_grad()
        value = loss(model(x), y)
        value.backward()
        opt.step()
        losses.append(value.item())
    assert abs(losses[0] - math.log(96)) < 0.3  # starts near uniform
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0  # and learns the character statistics


def test_mlp_and_cnn():
    mlp = MLP((5, 7, 3), seed=0)
    assert mlp(torch.randn(4, 5)).shape == (4, 3)
    assert torch.equal(MLP((5, 7, 3), seed=0).layers[0].weight, mlp.layers[0].weight)
    with pytest.raises(ValueError, match="MLP sizes"):
        MLP((5,))
    assert DigitsCNN()(torch.randn(2, 1, 8, 8)).shape == (2, 10)
