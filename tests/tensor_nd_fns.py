"""Rank functions for tests/test_tensor_nd.py: 2D / 2.5D / 3D operations against dense ones.

Every rank builds the same dense tensors from one seed (float64), cuts its own blocks the
way the grid lays them out (read from the layer's placement, never from a global rank
formula), runs the distributed operation, and checks its output and gradient blocks
against the dense computation on the spot (``assert_close`` raises on the failing rank,
naming the case). Parameter gradients are compared after gathering them to dense shape.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import plait
from plait import checkpoint, comm
from plait.models import GPT
from plait.strategies.tensor import loss_fn, parallelize
from plait.strategies.tensor.grid import Grid, block, grid_from_mesh, grid_shape
from plait.strategies.tensor.layers_nd import (
    EmbeddingND,
    LayerNormND,
    LinearND,
    Placement,
    placement,
)
from plait.strategies.tensor.parallelize_nd import gpt_plan
from plait.strategies.tensor.summa import matmul_ab, matmul_abt, matmul_atb
from tests import tensor_gpt_fns

DT = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-12}
B, S, IN, OUT, VOCAB = 8, 3, 8, 12, 13  # B divisible by q^2 and d q; IN, OUT by q^2


def make_mesh(mode: str, permuted: bool) -> Any:
    """The grid of ``mode`` over the world: the default layout, or the world's ranks reversed
    and the dimensions in another order (a group's numbering then differs from the mesh's
    coordinates, which every operation must follow)."""
    n = plait.world().size
    dims = grid_shape(mode, n, depth=2 if mode == "2.5d" else None)
    if not permuted:
        return plait.Mesh(**dims)
    order = list(reversed(list(dims)))  # innermost first: col fastest (default: row/depth)
    return plait.Mesh(ranks=list(reversed(range(n))), order=order, **dims)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}: {m}")


def _stream(t: torch.Tensor, where: Placement) -> torch.Tensor:
    """This rank's block of a stream tensor ``[b, ..., h]``."""
    rows = block(t, 0, where.batch_index, where.batch_parts, "batch")
    return block(rows, -1, where.features.coord, where.features.size, "features").contiguous()


def _output(t: torch.Tensor, layer: LinearND) -> torch.Tensor:
    """This rank's block of a linear layer's output ``[b, ..., out]``."""
    where, g = layer.where, layer.where.grid
    if g.mode != "3d":
        return _stream(t, where)
    _, a_axis, o_axis = layer.axes
    rows = block(t, 0, g.k * g.q + a_axis.coord, g.q * g.q, "batch")
    return block(rows, -1, o_axis.coord, g.q, "features").contiguous()


def _input(t: torch.Tensor, layer: LinearND) -> torch.Tensor:
    where, g = layer.where, layer.where.grid
    if g.mode != "3d" or layer.input == "stream":
        return _stream(t, where)
    _, a_axis, o_axis = layer.axes
    rows = block(t, 0, g.k * g.q + o_axis.coord, g.q * g.q, "batch")
    return block(rows, -1, a_axis.coord, g.q, "features").contiguous()


def _full_grads(layer: nn.Module) -> dict[str, torch.Tensor]:
    """The layer's parameter gradients gathered to dense shape (its full_state of .grad)."""
    saved = {n: p.data for n, p in layer.named_parameters()}
    for _, p in layer.named_parameters():
        assert p.grad is not None
        p.data = p.grad
    out = layer.full_state()  # type: ignore[operator]
    for n, p in layer.named_parameters():
        p.data = saved[n]
    return out


def ops(mode: str, permuted: bool) -> dict[str, Any]:
    """Every nD operation against its dense twin; returns what each rank saw."""
    mesh = make_mesh(mode, permuted)
    grid = grid_from_mesh(mesh, mode)
    where = placement(grid)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=DT)

    out: dict[str, Any] = {"coords": (grid.k, grid.i, grid.j)}
    if mode == "2d":
        _products(grid, where, rand)
    for input_side in ("stream", "swapped") if mode == "3d" else ("stream",):
        _linear(where, rand, input_side)
    _layernorm(where, rand)
    _embedding(where, rand)
    out["loss"] = _classifier(where, rand)
    return out


def _products(grid: Grid, where: Placement, rand: Any) -> None:
    """The SUMMA matmul and its two backward products, block by block."""
    x, w, dy = rand(B, S, IN), rand(OUT, IN), rand(B, S, OUT)
    q = grid.q
    xb = _stream(x, where)
    wb = block(block(w, 0, grid.j, q, "w"), 1, grid.i, q, "w").contiguous()
    dyb = _stream(dy, where)
    _close(matmul_ab(xb, wb, grid, "auto"), _stream(F.linear(x, w), where), "Y = X W^T")
    _close(matmul_abt(dyb, wb, grid, "auto"), _stream(dy @ w, where), "dX = dY W")
    dw = dy.reshape(-1, OUT).t() @ x.reshape(-1, IN)
    want = block(block(dw, 0, grid.j, q, "dw"), 1, grid.i, q, "dw")
    _close(matmul_atb(dyb, xb, grid, "auto"), want, "dW = dY^T X")


def _linear(where: Placement, rand: Any, input_side: str) -> None:
    dense = nn.Linear(IN, OUT, dtype=DT)
    with torch.no_grad():
        dense.weight.copy_(rand(OUT, IN))
        dense.bias.copy_(rand(OUT))
    x, g = rand(B, S, IN).requires_grad_(True), rand(B, S, OUT)
    (F.linear(x, dense.weight, dense.bias) * g).sum().backward()
    layer = LinearND(dense, where=where, input=input_side)
    y_want = dense(x).detach()
    xb = _input(x.detach(), layer).requires_grad_(True)
    y = layer(xb)
    what = f"LinearND({where.grid.mode}, input={input_side})"
    _close(y, _output(y_want, layer), f"{what} output")
    (y * _output(g, layer)).sum().backward()
    assert x.grad is not None and xb.grad is not None
    _close(xb.grad, _input(x.grad, layer), f"{what} dX")
    grads = _full_grads(layer)
    _close(grads["weight"], dense.weight.grad, f"{what} dW")  # type: ignore[arg-type]
    _close(grads["bias"], dense.bias.grad, f"{what} db")  # type: ignore[arg-type]
    state = layer.full_state()
    _close(state["weight"], dense.weight.detach(), f"{what} full_state")


def _layernorm(where: Placement, rand: Any) -> None:
    dense = nn.LayerNorm(IN, dtype=DT)
    with torch.no_grad():
        dense.weight.copy_(rand(IN))
        dense.bias.copy_(rand(IN))
    x, g = rand(B, S, IN).requires_grad_(True), rand(B, S, IN)
    (dense(x) * g).sum().backward()
    layer = LayerNormND(dense, where=where)
    xb = _stream(x.detach(), where).requires_grad_(True)
    y = layer(xb)
    _close(y, _stream(dense(x).detach(), where), "LayerNormND output")
    (y * _stream(g, where)).sum().backward()
    assert x.grad is not None and xb.grad is not None
    _close(xb.grad, _stream(x.grad, where), "LayerNormND dX")
    grads = _full_grads(layer)
    _close(grads["weight"], dense.weight.grad, "LayerNormND dweight")  # type: ignore[arg-type]
    _close(grads["bias"], dense.bias.grad, "LayerNormND dbias")  # type: ignore[arg-type]


def _embedding(where: Placement, rand: Any) -> None:
    dense = nn.Embedding(VOCAB, IN, dtype=DT)
    with torch.no_grad():
        dense.weight.copy_(rand(VOCAB, IN))
    ids = torch.arange(B * S).reshape(B, S) % VOCAB
    g = rand(B, S, IN)
    (dense(ids) * g).sum().backward()
    layer = EmbeddingND(dense, where=where)
    rows = block(ids, 0, where.batch_index, where.batch_parts, "ids")
    y = layer(rows)
    _close(y, _stream(dense(ids).detach(), where), "EmbeddingND output")
    (y * _stream(g, where)).sum().backward()
    _close(_full_grads(layer)["weight"], dense.weight.grad, "EmbeddingND dweight")  # type: ignore[arg-type]


def _classifier(where: Placement, rand: Any) -> float:
    """A vocabulary head (padded to the grid) and the loss on batch shards: the global mean
    cross-entropy on every rank, and the dense gradients."""
    from plait.strategies.tensor.parallelize_nd import NdInfo
    from plait.strategies.tensor.parallelize_nd import loss_fn as nd_loss

    dense = nn.Linear(IN, VOCAB, bias=False, dtype=DT)
    with torch.no_grad():
        dense.weight.copy_(rand(VOCAB, IN))
    x = rand(B, S, IN).requires_grad_(True)
    target = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    target[0, 0] = -100  # ignored
    want = F.cross_entropy(dense(x).reshape(-1, VOCAB), target.reshape(-1))
    want.backward()
    head = LinearND(dense, where=where, pad=True)
    holder = nn.Module()
    holder.head = head
    object.__setattr__(holder, "plait_tensor_nd", NdInfo(where.grid.mode, where, VOCAB, "auto"))
    xb = _stream(x.detach(), where).requires_grad_(True)
    loss = nd_loss(holder)(head(xb), target)
    _close(loss, want.detach(), "loss")
    loss.backward()
    assert x.grad is not None and xb.grad is not None
    _close(xb.grad, _stream(x.grad, where), "classifier dX")
    _close(_full_grads(head)["weight"], dense.weight.grad, "classifier dW")  # type: ignore[arg-type]
    return loss.item()


# --- the GPT ----------------------------------------------------------------------------
GPT_BATCH = 4  # divisible by q (2D), d q (2.5D) and q^2 (3D)


def train_gpt(mode: str, permuted: bool) -> dict[str, Any]:
    """The GPT of tests/tensor_gpt_fns.py under ``mode``; Adam steps on the global batch."""
    cfg = tensor_gpt_fns.config(tied=False)
    mesh = make_mesh(mode, permuted)
    model = GPT(cfg)
    dense_numel = sum(p.numel() for p in model.parameters())
    opt: Any = torch.optim.Adam(model.parameters(), lr=1e-2)
    if mode == "2.5d":  # through prepare: the family's plan and the rebuilt optimizer
        model, opt = plait.prepare(model, opt, strategy="tp", mesh=mesh, mode=mode)
    else:
        parallelize(model, mesh, gpt_plan(mode, layers=cfg.layers))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_of = loss_fn(model)
    losses = []
    for step in range(tensor_gpt_fns.STEPS):
        x, y = tensor_gpt_fns.batch(step, cfg, GPT_BATCH)
        opt.zero_grad()
        loss = loss_of(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {
        "state": checkpoint.full_state_dict(model),
        "losses": losses,
        "local_numel": sum(p.numel() for p in model.parameters()),
        "dense_numel": dense_numel,
    }


def refusals() -> dict[str, str]:
    """Bad meshes and plans at world 4; the error of each."""
    from plait.models import GPTConfig
    from plait.strategies.tensor.parallelize_nd import gpt_plan as plan_of

    mesh = plait.Mesh(row=2, col=2)
    small = GPTConfig(vocab=16, heads=2, width=8, layers=1)
    cases: dict[str, Any] = {
        "three_d_on_4": lambda: grid_shape("3d", 4),
        "not_square": lambda: grid_shape("2d", 8),
        "tp_mesh": lambda: parallelize(GPT(small), plait.Mesh(tp=4), plan_of("2d", layers=1)),
        "heads": lambda: parallelize(
            GPT(GPTConfig(vocab=16, heads=3, width=12, layers=1)), mesh, plan_of("2d", layers=1)
        ),
        "tied": lambda: parallelize(
            GPT(GPTConfig(vocab=16, heads=2, width=8, layers=1, tied=True)),
            mesh,
            plan_of("2d", layers=1),
        ),
        "uncovered": lambda: parallelize(
            GPT(small), mesh, {k: v for k, v in plan_of("2d", layers=1).items() if k != "ln_f"}
        ),
        "mixed": lambda: parallelize(GPT(small), mesh, {"tok": "2d", "head": "colwise"}),
        "width": lambda: parallelize(
            GPT(GPTConfig(vocab=16, heads=2, width=6, layers=1)), mesh, plan_of("2d", layers=1)
        ),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
        except (ValueError, TypeError) as exc:
            out[name] = str(exc)
        else:
            out[name] = "NOT REFUSED"
    return out


def linear_bytes(mode: str, tokens: int, width_in: int, width_out: int) -> dict[str, int]:
    """Bytes this rank sent for one linear layer's forward + backward (ring algorithms)."""
    from plait.strategies.tensor.layers import ColumnParallelLinear

    n = plait.world().size
    gen = torch.Generator().manual_seed(0)
    dense = nn.Linear(width_in, width_out, bias=False)
    x = torch.randn(tokens, width_in, generator=gen)
    if mode == "1d":
        mesh = plait.Mesh(tp=n)
        layer: nn.Module = ColumnParallelLinear.from_dense(
            dense, group=mesh.group("tp"), algorithm="ring"
        )
        xb = x
    else:
        mesh = make_mesh(mode, permuted=False)
        where = placement(grid_from_mesh(mesh, mode))
        layer = LinearND(dense, where=where, algorithm="ring")
        xb = _stream(x, where)
    xb.requires_grad_(True)
    comm.reset_stats()
    layer(xb).sum().backward()
    return {f"{c}/{a}": s.bytes_sent for (c, a), s in comm.stats(reset=True).items()}


def gpt_step_sent(mode: str) -> int:
    """Bytes this rank sent in one training step of the test GPT (ring algorithms)."""
    cfg = tensor_gpt_fns.config(tied=False)
    model = parallelize(
        GPT(cfg),
        make_mesh(mode, permuted=False),
        gpt_plan(mode, layers=cfg.layers),
        algorithm="ring",
    )
    loss_of = loss_fn(model)
    x, y = tensor_gpt_fns.batch(0, cfg, GPT_BATCH)
    loss_of(model(x), y).backward()  # a new group's first collectives are not counted
    comm.reset_stats()
    loss_of(model(x), y).backward()
    return sum(s.bytes_sent for s in comm.stats(reset=True).values())


def train_dp_2d() -> dict[str, torch.Tensor]:
    """8 ranks as dp 2 x (2 x 2): the GPT in 2D over the grid, plait's DDP over dp; each
    dp replica trains on its half of a global batch of 2 * GPT_BATCH."""
    from plait.strategies.tensor.grid import grid_mesh

    cfg = tensor_gpt_fns.config(tied=False)
    mesh = grid_mesh("2d", 4, dp=2)
    model = parallelize(GPT(cfg), mesh, gpt_plan("2d", layers=cfg.layers))
    ddp = plait.DistributedDataParallel(model, group=mesh.group("dp"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_of = loss_fn(model)
    d, rows = mesh.rank("dp"), GPT_BATCH
    for step in range(tensor_gpt_fns.STEPS):
        x, y = tensor_gpt_fns.batch(step, cfg, 2 * rows)
        opt.zero_grad()
        loss_of(ddp(x[d * rows : (d + 1) * rows]), y[d * rows : (d + 1) * rows]).backward()
        opt.step()
    return checkpoint.full_state_dict(model)
