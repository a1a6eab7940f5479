"""A block cut into ``t`` tensor-parallel ranks, run forward and backward in one process.

The proof of an inferred plan (:mod:`plait.models.verify_plan`) runs what
:func:`~plait.strategies.tensor.parallelize` would make of a block, one thread per simulated
rank, in float64, on the activations the model itself feeds that block. The ranks meet at
every collective on a :class:`_Bus` (a barrier and one slot per rank), so the communication
is the real layers' contract, forward and backward:

- a column-parallel linear keeps its rank's rows (per part when fused: ``blocks=k``) and
  enters the region through "f" (forward identity, backward all-reduce of ``dX``); a
  key/value projection with fewer heads than ranks stays whole, each rank computing the one
  head its queries read, its gradient summed over the ranks;
- a row-parallel linear keeps its rank's input columns, leaves through "g" (forward
  all-reduce, backward identity), its bias added on every rank after the sum;
- the attention module's head-count attributes are set to the rank's counts;
- every other parameter is replicated: its gradient on a rank is what that rank computed,
  unless its module is ``"per_head"`` (summed over the ranks, as the style does).

:func:`run_ranks` returns each rank's output and, given an upstream gradient, its
gradients: of the block's input and of every parameter, with how the dense parameter's
gradient is to be compared (:class:`Grad`). Every all-reduce sums the ranks' tensors in rank
order, so every rank gets bitwise the same sum. A rank that fails aborts the barrier (the
others raise too); a rank that makes fewer collectives than the others is found by the
barrier's timeout (:data:`TIMEOUT`).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from plait.strategies.tensor.parallelize import Style
from plait.strategies.tensor.plan import AttentionHeads

TIMEOUT = 60.0  # seconds a simulated rank waits for the others at a collective


class _Bus:
    """The simulated group: ``t`` threads meet at each all-reduce."""

    def __init__(self, t: int) -> None:
        self.t = t
        self.barrier = threading.Barrier(t, timeout=TIMEOUT)
        self.slots: list[torch.Tensor | None] = [None] * t

    def all_reduce(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        self.slots[rank] = x.detach()
        self.barrier.wait()
        total = torch.stack(self.slots).sum(0)  # type: ignore[arg-type]
        self.barrier.wait()  # every rank has read the slots before they are written again
        return total


class _F(torch.autograd.Function):
    """ "f": forward identity, backward all-reduce of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bus: _Bus, rank: int) -> torch.Tensor:
        ctx.bus, ctx.rank = bus, rank
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.bus.all_reduce(ctx.rank, grad), None, None


class _G(torch.autograd.Function):
    """ "g": forward all-reduce, backward identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bus: _Bus, rank: int) -> torch.Tensor:
        return bus.all_reduce(rank, x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _Column(nn.Module):
    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, bus: _Bus, rank: int, rows: Any
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.bias = None if bias is None else nn.Parameter(bias.clone())
        self.bus, self.rank, self.rows = bus, rank, rows  # rows: None, or a head kept whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _F.apply(x, self.bus, self.rank)
        if self.rows is None:
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias[self.rows]
        return F.linear(x, self.weight[self.rows], bias)


class _MultiQuery(nn.Module):
    """The query rows of a fused multi-query projection split, its key/value tail whole."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, bus: _Bus, rank: int, tail: int
    ) -> None:
        super().__init__()
        n = weight.shape[0] - tail
        rows = slice(rank * n // bus.t, (rank + 1) * n // bus.t)
        self.weight = nn.Parameter(weight[rows].clone())
        self.tail_weight = nn.Parameter(weight[n:].clone())
        self.bias = None if bias is None else nn.Parameter(bias[rows].clone())
        self.tail_bias = None if bias is None else nn.Parameter(bias[n:].clone())
        self.bus, self.rank = bus, rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _F.apply(x, self.bus, self.rank)
        head = F.linear(x, self.weight, self.bias)
        return torch.cat([head, F.linear(x, self.tail_weight, self.tail_bias)], dim=-1)


class _Row(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, bus: _Bus, rank: int):
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.bias = None if bias is None else nn.Parameter(bias.clone())
        self.bus, self.rank = bus, rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _G.apply(F.linear(x, self.weight), self.bus, self.rank)
        return out if self.bias is None else out + self.bias


@dataclass(frozen=True)
class Grad:
    """How rank ``r``'s gradient of a parameter relates to the dense one: ``"split"`` (it
    is ``part(dense)``), ``"replicated"`` (it is the dense gradient itself) or ``"summed"``
    (the sum over the ranks is the dense gradient, or ``part`` of it)."""

    dense: str  # the parameter's name in the dense block
    rule: str
    part: Callable[[torch.Tensor], torch.Tensor] | None = None  # of the dense gradient


def _column_part(k: int, t: int, rank: int, transposed: bool) -> Callable[..., torch.Tensor]:
    def part(x: torch.Tensor) -> torch.Tensor:
        x = x.t() if transposed and x.dim() == 2 else x
        n = x.shape[0]
        return x.reshape(k, t, n // (k * t), *x.shape[1:])[:, rank].reshape(-1, *x.shape[1:])

    return part


def _row_part(t: int, rank: int, transposed: bool) -> Callable[..., torch.Tensor]:
    def part(x: torch.Tensor) -> torch.Tensor:
        x = x.t() if transposed else x
        return x.reshape(x.shape[0], t, -1)[:, rank]

    return part


def shard(
    dense: nn.Module,
    *,
    rank: int,
    t: int,
    bus: _Bus,
    styles: dict[str, Style],
    attention: str,
    heads: AttentionHeads,
    per_head: tuple[str, ...] = (),
) -> tuple[nn.Module, dict[str, Grad]]:
    """Rank ``rank``'s part of the dense block, and how each of its parameters' gradients
    compares with the dense block's (by the shard's parameter name)."""
    block = copy.deepcopy(dense)
    local = heads.local(t)
    prefix = f"{attention}." if attention else ""
    kv_paths = {prefix + p for p in heads.key_value}
    grads: dict[str, Grad] = {}
    for path, style in styles.items():
        if style.kind not in ("colwise", "rowwise"):
            continue  # "per_head" comes as per_head=
        module = block.get_submodule(path)
        weight: torch.Tensor = module.weight.detach()  # type: ignore[operator]
        weight = weight.t() if style.transposed else weight
        bias = getattr(module, "bias", None)
        bias = None if bias is None else bias.detach()
        n_out, n_in = weight.shape
        names = {"weight": f"{path}.weight", "bias": f"{path}.bias"}
        new: nn.Module
        if style.kind == "colwise" and path in kv_paths and local["replicas"] > 1:
            width = n_out // (heads.kv_heads or heads.heads)
            head = rank // local["replicas"]
            new = _Column(weight, bias, bus, rank, slice(head * width, (head + 1) * width))
            grads.update({f"{path}.{n}": Grad(d, "summed") for n, d in names.items()})
        elif style.kind == "colwise" and style.tail:
            new = _MultiQuery(weight, bias, bus, rank, style.tail)
            n = n_out - style.tail
            query = _column_part(1, t, rank, False)
            rows = lambda d, q=query, n=n: q(d[:n])  # noqa: E731 - the query rows
            tail = lambda d, n=n: d[n:]  # noqa: E731 - the whole key and value
            for name, dense_name in names.items():
                grads[f"{path}.{name}"] = Grad(dense_name, "split", rows)
                grads[f"{path}.tail_{name}"] = Grad(dense_name, "summed", tail)
        elif style.kind == "colwise":
            part = _column_part(style.blocks, t, rank, style.transposed)
            w = _column_part(style.blocks, t, rank, False)(weight)
            b = None if bias is None else part(bias)
            new = _Column(w, b, bus, rank, None)
            grads.update({f"{path}.{n}": Grad(d, "split", part) for n, d in names.items()})
        else:
            w = _row_part(t, rank, False)(weight)
            new = _Row(w, bias, bus, rank)
            grads[f"{path}.weight"] = Grad(
                names["weight"], "split", _row_part(t, rank, style.transposed)
            )
            grads[f"{path}.bias"] = Grad(names["bias"], "replicated")
        parent, _, leaf = path.rpartition(".")
        setattr(block.get_submodule(parent) if parent else block, leaf, new)
    module = block.get_submodule(attention) if attention else block
    for name, kind in heads.attributes.items():
        if hasattr(module, name):
            setattr(module, name, local[kind])
    for name in heads.head_params:  # one entry per query head: this rank's heads
        p = getattr(module, name)
        part = lambda d: d.reshape(t, -1, *d.shape[1:])[rank]  # noqa: E731
        setattr(module, name, nn.Parameter(part(p.detach()).clone()))
        grads[prefix + name] = Grad(prefix + name, "split", part)
    for name, _ in block.named_parameters():
        if name not in grads:
            owner = name.rpartition(".")[0]
            summed = any(owner == p or owner.startswith(f"{p}.") for p in per_head)
            grads[name] = Grad(name, "summed" if summed else "replicated")
    return block, grads


def first_tensor(out: Any) -> torch.Tensor:
    """The block's output: a tensor, or the first of a tuple (Hugging Face's layers)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"the block returned a {type(out).__name__}, not a tensor")


def leaf_input(
    inputs: tuple[tuple[Any, ...], dict[str, Any]],
) -> tuple[tuple[Any, ...], dict[str, Any], torch.Tensor]:
    """A copy of ``inputs`` whose hidden states (the first positional tensor, else
    ``hidden_states=``) are a fresh leaf that requires its gradient."""
    args, kwargs = inputs
    if args and isinstance(args[0], torch.Tensor):
        x = args[0].detach().clone().requires_grad_(True)
        return (x, *args[1:]), dict(kwargs), x
    x = kwargs["hidden_states"].detach().clone().requires_grad_(True)
    return args, {**kwargs, "hidden_states": x}, x


@dataclass
class RankResult:
    """One simulated rank's output, and with an upstream gradient its input's and
    parameters' gradients (by the shard's parameter name) and their comparison rules."""

    out: torch.Tensor
    input_grad: torch.Tensor | None
    grads: dict[str, torch.Tensor | None]
    rules: dict[str, Grad]


def run_ranks(
    dense: nn.Module,
    inputs: tuple[tuple[Any, ...], dict[str, Any]],
    *,
    t: int,
    styles: dict[str, Style],
    attention: str,
    heads: AttentionHeads,
    upstream: torch.Tensor | None = None,
    per_head: tuple[str, ...] = (),
) -> list[RankResult]:
    """Every simulated rank's :class:`RankResult` on ``inputs`` (one thread per rank; the
    first failure of any rank is raised). Without ``upstream`` only the forward runs."""
    bus = _Bus(t)
    shards = [
        shard(
            dense,
            rank=r,
            t=t,
            bus=bus,
            styles=styles,
            attention=attention,
            heads=heads,
            per_head=per_head,
        )
        for r in range(t)
    ]
    results: list[RankResult | None] = [None] * t
    errors: list[BaseException | None] = [None] * t

    def rank_main(r: int) -> None:
        block, rules = shards[r]
        try:
            with torch.set_grad_enabled(upstream is not None):
                args, kwargs, x = leaf_input(inputs)
                out = first_tensor(block(*args, **kwargs))
                if upstream is not None:
                    out.backward(upstream)
            grads = {n: p.grad for n, p in block.named_parameters()}
            results[r] = RankResult(out.detach(), x.grad, grads, rules)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors[r] = exc
            bus.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(t)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT * 4)
    # the first failure that is not only another rank's abort
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real:
        raise real[0]
    if any(e is not None for e in errors) or any(r is None for r in results):
        raise ValueError(
            f"the simulated ranks did not meet at every collective within {TIMEOUT:.0f} s "
            f"(they called a different number of all-reduces)"
        )
    return results  # type: ignore[return-value]
