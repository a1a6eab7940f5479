"""Rank functions for the tensor-parallel tests: each TP layer against its dense twin.

Every rank builds the same dense layer and inputs from one seed (float64), shards them the
way the layer does, and checks outputs and every gradient against the dense computation on
the spot (``torch.testing.assert_close`` raises, naming the case, on the failing rank).
Losses: replicated outputs use the same loss on every rank; sharded outputs use each
rank's slice of a weighted sum whose total is the dense loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import plait
from plait import comm
from plait.strategies.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

DT = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-12}
B, S, IN, HID, OUT, VOCAB = 3, 8, 6, 12, 10, 13  # S and HID divisible by 1, 2, 4; VOCAB not


def _group() -> Any:
    return plait.Mesh(tp=plait.world().size).group("tp")


def _sl(n: int, g: Any) -> slice:
    part = n // g.size
    return slice(g.rank * part, (g.rank + 1) * part)


def _close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{name}: {m}")


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def layers_match_dense() -> list[str]:
    """Run every layer case; return the names checked."""
    g = _group()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, IN, generator=gen, dtype=DT)
    h = torch.randn(B, S, HID, generator=gen, dtype=DT)
    w_hid = torch.randn(B, S, HID, generator=gen, dtype=DT)
    w_out = torch.randn(B, S, OUT, generator=gen, dtype=DT)
    torch.manual_seed(1)
    col_d = nn.Linear(IN, HID, dtype=DT)
    row_d = nn.Linear(HID, OUT, dtype=DT)
    emb_d = nn.Embedding(VOCAB, OUT, dtype=DT)
    ids = torch.randint(0, VOCAB, (B, S), generator=gen)
    checked: list[str] = []
    hs, ss = _sl(HID, g), _sl(S, g)

    def dense_grads(fn: Callable[[torch.Tensor], torch.Tensor], inp: torch.Tensor, w: Any) -> Any:
        for m in (col_d, row_d, emb_d):
            m.zero_grad()
        leaf = _leaf(inp) if inp.is_floating_point() else inp
        y = fn(leaf)
        (y * w).sum().backward()
        return y.detach(), (leaf.grad if inp.is_floating_point() else None)

    # column, replicated input, sharded output
    col = ColumnParallelLinear.from_dense(col_d, group=g)
    y_d, dx_d = dense_grads(col_d, x, w_hid)
    xl = _leaf(x)
    y = col(xl)
    (y * w_hid[..., hs]).sum().backward()
    _close("column out", y, y_d[..., hs])
    _close("column dX", xl.grad, dx_d)
    _close("column dW", col.weight.grad, col_d.weight.grad[hs])
    _close("column db", col.bias.grad, col_d.bias.grad[hs])
    checked.append("column")

    # column with gather_output
    colg = ColumnParallelLinear.from_dense(col_d, group=g, gather_output=True)
    xl = _leaf(x)
    y = colg(xl)
    (y * w_hid).sum().backward()
    _close("column gathered out", y, y_d)
    _close("column gathered dX", xl.grad, dx_d)
    _close("column gathered dW", colg.weight.grad, col_d.weight.grad[hs])
    checked.append("column_gather")

    # row, sharded input, replicated output
    row = RowParallelLinear.from_dense(row_d, group=g)
    y_d, dh_d = dense_grads(row_d, h, w_out)
    hl = _leaf(h[..., hs])
    y = row(hl)
    (y * w_out).sum().backward()
    _close("row out", y, y_d)
    _close("row dX", hl.grad, dh_d[..., hs])
    _close("row dW", row.weight.grad, row_d.weight.grad[:, hs])
    _close("row db", row.bias.grad, row_d.bias.grad)
    checked.append("row")

    # row, replicated input (sliced inside)
    rowr = RowParallelLinear.from_dense(row_d, group=g, input="replicate")
    hl = _leaf(h)
    y = rowr(hl)
    (y * w_out).sum().backward()
    _close("row replicated-input out", y, y_d)
    _close("row replicated-input dX", hl.grad, dh_d)
    checked.append("row_replicate")

    # column then row (an MLP), without and with sequence parallelism
    def mlp_d(t: torch.Tensor) -> torch.Tensor:
        return row_d(F.gelu(col_d(t)))

    y_d, dx_d = dense_grads(mlp_d, x, w_out)
    for sp in (False, True):
        c = ColumnParallelLinear.from_dense(col_d, group=g, input="sequence" if sp else "replicate")
        r = RowParallelLinear.from_dense(row_d, group=g, output="sequence" if sp else "replicate")
        xl = _leaf(x[:, ss] if sp else x)
        y = r(F.gelu(c(xl)))
        (y * (w_out[:, ss] if sp else w_out)).sum().backward()
        tag = "mlp+sp" if sp else "mlp"
        _close(f"{tag} out", y, y_d[:, ss] if sp else y_d)
        _close(f"{tag} dX", xl.grad, dx_d[:, ss] if sp else dx_d)
        _close(f"{tag} fc1 dW", c.weight.grad, col_d.weight.grad[hs])
        _close(f"{tag} fc1 db", c.bias.grad, col_d.bias.grad[hs])
        _close(f"{tag} fc2 dW", r.weight.grad, row_d.weight.grad[:, hs])
        _close(f"{tag} fc2 db", r.bias.grad, row_d.bias.grad)  # summed over ranks under SP
        checked.append(tag)

    # vocab-parallel embedding (vocabulary padded), replicated or sequence-sliced output
    y_d, _ = dense_grads(emb_d, ids, w_out)
    for sp in (False, True):
        emb = VocabParallelEmbedding.from_dense(
            emb_d, group=g, output="sequence" if sp else "replicate"
        )
        y = emb(ids)
        (y * (w_out[:, ss] if sp else w_out)).sum().backward()
        tag = "embedding+sp" if sp else "embedding"
        _close(f"{tag} out", y, y_d[:, ss] if sp else y_d)
        padded = torch.zeros(emb.part * g.size, OUT, dtype=DT)
        padded[:VOCAB] = emb_d.weight.grad
        _close(f"{tag} dW", emb.weight.grad, padded[emb.start : emb.start + emb.part])
        full = emb.full_state()["weight"]
        _close(f"{tag} full_state", full, emb_d.weight.detach())
        checked.append(tag)
    return checked


def cross_entropy_matches(smoothing: float) -> dict[str, Any]:
    """vocab_parallel_cross_entropy vs F.cross_entropy; returns collective counts."""
    g = _group()
    gen = torch.Generator().manual_seed(3)
    n = 17
    logits = torch.randn(n, VOCAB, generator=gen, dtype=DT) * 3
    target = torch.randint(0, VOCAB, (n,), generator=gen)
    target[::5] = -100  # ignored
    part = -(-VOCAB // g.size)
    padded = torch.full((n, part * g.size), 100.0, dtype=DT)  # junk in the padding
    padded[:, :VOCAB] = logits
    counts: dict[str, Any] = {}
    for reduction in ("mean", "sum", "none"):
        dense = _leaf(logits)
        want = F.cross_entropy(
            dense, target, label_smoothing=smoothing, ignore_index=-100, reduction=reduction
        )
        mine = _leaf(padded[:, g.rank * part : (g.rank + 1) * part])
        comm.reset_stats()
        got = vocab_parallel_cross_entropy(
            mine,
            target,
            group=g,
            vocab_size=VOCAB,
            label_smoothing=smoothing,
            reduction=reduction,
        )
        forward = comm.stats(reset=True)
        weights = torch.linspace(0.5, 1.5, n, dtype=DT)
        (want * (weights if reduction == "none" else 1)).sum().backward()
        (got * (weights if reduction == "none" else 1)).sum().backward()
        backward = comm.stats(reset=True)
        _close(f"ce {reduction} loss", got, want)
        grad = torch.zeros_like(padded)
        grad[:, :VOCAB] = dense.grad
        _close(f"ce {reduction} grad", mine.grad, grad[:, g.rank * part : (g.rank + 1) * part])
        counts[reduction] = (
            sum(s.calls for (c, _), s in forward.items() if c == "all_reduce"),
            sum(s.calls for s in backward.values()),
        )
    return counts


def train_on_feature_slices(steps: int) -> dict[str, torch.Tensor]:
    """Each rank sees only its slice of every sample's 12 features (seed 002's partitioning
    by dimension); the first layer is row-parallel. Returns the dense state dict."""
    from plait import checkpoint
    from plait.data import split_features
    from plait.models import MLP
    from plait.strategies.tensor import parallelize

    g = _group()
    model = parallelize(MLP((12, 8, 3), seed=0, dtype=DT), g, {"layers.0": "rowwise"})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = feature_batch(step)
        opt.zero_grad()
        mine = split_features(x, rank=g.rank, parts=g.size)
        assert mine.shape == (x.shape[0], 12 // g.size)
        F.mse_loss(model(mine), y).backward()
        opt.step()
    return checkpoint.full_state_dict(model)


def feature_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(50 + step)
    return torch.randn(16, 12, generator=gen, dtype=DT), torch.randn(16, 3, generator=gen, dtype=DT)


def feature_oracle(steps: int) -> dict[str, torch.Tensor]:
    """Whole rows, one process."""
    from plait.models import MLP

    model = MLP((12, 8, 3), seed=0, dtype=DT)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = feature_batch(step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return model.state_dict()
