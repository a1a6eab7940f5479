"""The proof behind an inferred tensor-parallel plan (:mod:`plait.models.infer`).

The model's first block is cut into ``t`` simulated ranks in one process, in float64, exactly
as :func:`~plait.strategies.tensor.parallelize` would cut it, and run on the activations the
model itself feeds that block:

- a column-parallel linear keeps its rank's rows (per part when fused: ``blocks=k``; a
  key/value projection with fewer heads than ranks keeps the one head its queries read);
- a row-parallel linear keeps its rank's input columns; its partial products are summed over
  the simulated ranks (the all-reduce), its bias added once;
- the attention module's head-count attributes are set to the rank's counts.

The ranks run one after another; the all-reduce is resolved in passes: pass ``j`` records
every rank's partial product of the ``j``-th row-parallel call (the calls before it return
the sums found by earlier passes), so a block with ``n`` row-parallel linears needs ``n + 1``
passes. Each rank's output must equal the whole block's to ``1e-9`` (relative to its largest
value). Wrong candidates fail loudly or numerically, so the proof chooses among them: how a
fused projection splits, and which attributes the forward reads.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from plait.strategies.tensor.parallelize import Style
from plait.strategies.tensor.plan import AttentionHeads

TOLERANCE = 1e-9  # float64: the shards sum in another order (~1e-15 relative)
MAX_PASSES = 16


class _Captured(Exception):
    """Raised by the hook once the first block's inputs are held: the rest need not run."""


def capture(
    model: nn.Module, block: nn.Module, example: Any, refuse: Callable[..., Exception]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword inputs the model gives ``block`` on ``example``."""
    from plait.models.infer import example_input  # deferred: infer imports this module

    args, kwargs = example if example is not None else example_input(model)
    held: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def grab(_: nn.Module, a: tuple[Any, ...], kw: dict[str, Any]) -> None:
        held.append((a, kw))
        raise _Captured

    hook = block.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(*args, **kwargs)
    except _Captured:
        pass
    except Exception as exc:  # noqa: BLE001 - any failure means: no proof without an input
        raise refuse(
            model,
            f"the model did not run on the example input ({type(exc).__name__}: {exc}); pass "
            f"infer_tp_plan(model, example=(args, kwargs)) with an input it takes",
        ) from exc
    finally:
        hook.remove()
    if not held:
        raise refuse(model, "its forward never called the first block on the example input")
    return _float64(held[0])


def _float64(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().to(torch.float64) if tree.is_floating_point() else tree
    if isinstance(tree, tuple | list):
        return type(tree)(_float64(x) for x in tree)
    if isinstance(tree, dict):
        return {k: _float64(v) for k, v in tree.items()}
    return tree


class _Ledger:
    """The simulated all-reduce: partial products of each row-parallel call, by call order."""

    def __init__(self) -> None:
        self.sums: list[torch.Tensor] = []
        self.parts: dict[int, list[torch.Tensor]] = {}
        self.calls = 0

    def reduce(self, part: torch.Tensor) -> torch.Tensor:
        i, self.calls = self.calls, self.calls + 1
        if i < len(self.sums):
            return self.sums[i]
        self.parts.setdefault(i, []).append(part)
        return torch.zeros_like(part)  # a placeholder: what follows is recomputed next pass


class _Column(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _Row(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ledger: _Ledger) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.ledger: _Ledger = ledger

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.ledger.reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def _shard(
    dense: nn.Module,
    *,
    rank: int,
    t: int,
    styles: dict[str, Style],
    attention: str,
    heads: AttentionHeads,
    ledger: _Ledger,
) -> nn.Module:
    """Rank ``rank``'s part of the dense block under ``styles`` and ``heads``."""
    block = copy.deepcopy(dense)
    local = heads.local(t)
    prefix = f"{attention}." if attention else ""
    kv_paths = {prefix + p for p in heads.key_value}
    for path, style in styles.items():
        module = block.get_submodule(path)
        weight: torch.Tensor = module.weight.detach()  # type: ignore[operator]
        weight = weight.t() if style.transposed else weight
        bias = getattr(module, "bias", None)
        bias = None if bias is None else bias.detach()
        n_out, n_in = weight.shape
        if style.kind == "colwise" and path in kv_paths and local["replicas"] > 1:
            head = rank // local["replicas"]
            width = n_out // (heads.kv_heads or heads.heads)
            rows = slice(head * width, (head + 1) * width)
            new: nn.Module = _Column(weight[rows], None if bias is None else bias[rows])
        elif style.kind == "colwise":
            k = style.blocks
            w = weight.reshape(k, t, n_out // (k * t), n_in)[:, rank].reshape(-1, n_in)
            b = None if bias is None else bias.reshape(k, t, -1)[:, rank].reshape(-1)
            new = _Column(w, b)
        else:
            w = weight.reshape(n_out, t, n_in // t)[:, rank]
            new = _Row(w, bias if rank == 0 else None, ledger)
        parent, _, leaf = path.rpartition(".")
        setattr(block.get_submodule(parent) if parent else block, leaf, new)
    module = block.get_submodule(attention) if attention else block
    for name, kind in heads.attributes.items():
        if hasattr(module, name):
            setattr(module, name, local[kind])
    return block


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"the block returned a {type(out).__name__}, not a tensor")


def run_ranks(
    dense: nn.Module,
    inputs: tuple[tuple[Any, ...], dict[str, Any]],
    *,
    t: int,
    styles: dict[str, Style],
    attention: str,
    heads: AttentionHeads,
) -> list[torch.Tensor]:
    """Every simulated rank's output of the block (module doc: the passes)."""
    args, kwargs = inputs
    ledger = _Ledger()
    shards = [
        _shard(dense, rank=r, t=t, styles=styles, attention=attention, heads=heads, ledger=ledger)
        for r in range(t)
    ]
    for _ in range(MAX_PASSES):
        ledger.parts.clear()
        outs = []
        for shard in shards:
            ledger.calls = 0
            outs.append(_first_tensor(shard(*args, **kwargs)))
        i = len(ledger.sums)
        if i not in ledger.parts:
            return outs
        if len(ledger.parts[i]) != t:
            raise ValueError(
                f"row-parallel call {i} was made by {len(ledger.parts[i])} of {t} ranks"
            )
        ledger.sums.append(torch.stack(ledger.parts[i]).sum(0))
    raise ValueError(f"more than {MAX_PASSES - 1} row-parallel calls in one block")


def prove(
    model: nn.Module,
    found: Any,
    *,
    tp: int,
    example: Any,
    refuse: Callable[..., Exception],
) -> tuple[dict[str, Style], dict[str, Any]]:
    """The block styles and :class:`AttentionHeads` fields that reproduce the first block at
    ``tp`` ranks: every fused split tried, then the candidate attributes, largest set
    first. Refuses (``refuse(model, why, example=...)``) when none does."""
    container = model.get_submodule(found.blocks)
    block = next(iter(container.children()))
    inputs = capture(model, block, example, refuse)
    dense = copy.deepcopy(block).to(torch.float64)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        want = _first_tensor(dense(*inputs[0], **inputs[1]))
    names = sorted(found.attributes)
    subsets = [c for n in range(len(names), -1, -1) for c in itertools.combinations(names, n)]
    splits = list(itertools.product(*found.fused.values()))
    base = dict(found.heads_fields)
    try:
        AttentionHeads("block", **base).local(tp)
    except ValueError as exc:
        raise ValueError(
            f"{type(model).__name__}: {exc}".replace("'block'", repr(found.where))
        ) from exc
    for path, style in found.styles.items():
        weight: torch.Tensor = dense.get_submodule(path).weight  # type: ignore[assignment]
        n_out, n_in = weight.shape[::-1] if style.transposed else weight.shape
        size, side = (n_out, "outputs") if style.kind == "colwise" else (n_in, "inputs")
        if size % tp:
            raise ValueError(
                f"{type(model).__name__}: linear '{found.blocks}.*.{path}' ({style.kind}) has "
                f"{size} {side}, not divisible by the tensor-parallel size {tp}; choose a "
                f"tensor-parallel size that divides {size}"
            )
    worst = ""
    for subset, split in itertools.product(subsets, splits):
        attributes = {n: found.attributes[n] for n in subset}
        width = "width" in attributes.values()
        heads = AttentionHeads(
            "block", **base, attributes=attributes, head_dim=found.head_dim if width else None
        )
        styles = dict(found.styles)
        for path, k in zip(found.fused, split, strict=True):
            styles[path] = Style("colwise", transposed=styles[path].transposed, blocks=k)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                outs = run_ranks(
                    dense, inputs, t=tp, styles=styles, attention=found.attention, heads=heads
                )
            scale = float(want.abs().max()) + 1.0
            err = max(float((o - want).abs().max()) for o in outs) / scale
        except Exception as exc:  # noqa: BLE001 - a wrong candidate may fail any way
            worst = worst or f"{type(exc).__name__}: {exc}"
            continue
        if err <= TOLERANCE:
            fields = {k: v for k, v in base.items()}
            fields |= {"attributes": attributes, "head_dim": heads.head_dim}
            return styles, fields
        worst = worst or f"outputs differ from the whole block by {err:.1e} (relative)"
    raise refuse(
        model,
        f"no split of block '{found.where}' cut into {tp} simulated ranks reproduces it "
        f"(tried {len(subsets) * len(splits)} candidates: fused splits {found.fused or 'none'}, "
        f"attributes {names or 'none'}; first failure: {worst}). The forward may read head "
        f"counts from a shared config, or hold per-head parameters",
        example=found.example,
    )
