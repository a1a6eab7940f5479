"""The proof behind an inferred tensor-parallel plan (:mod:`plait.models.infer`).

An inferred plan is proven on the whole model before it is used, in float64, on the
activations the model itself feeds each block (one forward of the example input, every
block's inputs recorded):

1. **Candidates, on the first block**: every fused split (``blocks=k``) and every set of
   candidate head-count attributes is tried, largest set first; the block cut into ``t``
   simulated ranks (:mod:`plait.models.simulate_ranks`) must give every rank the whole
   block's output to :data:`TOLERANCE` (1e-6, relative to its largest value). Wrong candidates
   fail loudly or numerically, so this chooses among them.
2. **Every kind of block, forward and backward**: the blocks are grouped by what they are
   (their modules' classes and scalar attributes, their parameters' shapes, what the model
   feeds them: another mask, other rotary tables; the layer index left out). The first
   block of each kind and the last block are run on the simulated ranks with a random
   upstream gradient: each rank's output, its input's gradient and every parameter's
   gradient must be the whole block's (a split parameter's: its slice). A replicated
   parameter whose gradient is right only summed over the ranks (a per-head norm inside
   the attention: Gemma 3's and Qwen 3's ``q_norm``/``k_norm``) gets the ``"per_head"``
   style, which sums it; any other difference refuses the model, naming the block, how its
   kind differs from the first block's, and the output or parameter that differs.

What runs around the blocks is not cut: the embedding and head are split only as plain
``nn.Embedding``/``nn.Linear`` by vocabulary with the full logits gathered (exact by the
layers' own tests), so scaled embeddings, final norms, soft-capping and the model's own loss
run whole on every rank on the full logits.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.models.infer_find import example_input
from plait.models.simulate_ranks import RankResult, first_tensor, leaf_input, run_ranks
from plait.strategies.tensor.parallelize import Style
from plait.strategies.tensor.plan import AttentionHeads

# relative: float64 shards summed in another order agree to ~1e-15, but some families compute
# inside a float64 model in float32 (Gemma's RMSNorm, DeepSeek's router: ~1e-7 apart); a
# wrong split or a partial gradient is off by 1e-2 or more
TOLERANCE = 1e-6
# attributes that number a block rather than say what it computes
POSITION_NAMES = ("layer_idx", "layer_id", "layer_index", "layer_number", "block_idx", "idx")


def capture(
    model: nn.Module, blocks: list[nn.Module], example: Any, refuse: Callable[..., Exception]
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The positional and keyword inputs the model gives each of ``blocks`` on ``example``
    (float64 copies)."""
    args, kwargs = example if example is not None else example_input(model)
    held: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def grab(i: int) -> Callable[..., None]:
        def hook(_: nn.Module, a: tuple[Any, ...], kw: dict[str, Any]) -> None:
            held.setdefault(i, _float64((a, kw)))

        return hook

    hooks = [b.register_forward_pre_hook(grab(i), with_kwargs=True) for i, b in enumerate(blocks)]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure means: no proof without an input
        raise refuse(
            model,
            f"the model did not run on the example input ({type(exc).__name__}: {exc}); pass "
            f"infer_tp_plan(model, example=(args, kwargs)) with an input it takes",
        ) from exc
    finally:
        for hook in hooks:
            hook.remove()
    missing = [i for i in range(len(blocks)) if i not in held]
    if missing:
        raise refuse(model, f"its forward never called block {missing[0]} on the example input")
    return [held[i] for i in range(len(blocks))]


def _describe(value: Any) -> Any:
    """What a block input is, for telling kinds of block apart (not its activations)."""
    if isinstance(value, torch.Tensor):
        v = value.detach().double().nan_to_num(0.0, 1e30, -1e30)
        # a mask's large negative entries counted, the rest summed (a sum would overflow)
        summary = (int((v <= -1e4).sum()), round(float(v.clamp(-1e4, 1e4).sum()), 6))
        return (tuple(value.shape), str(value.dtype), summary)
    if isinstance(value, tuple | list):
        return tuple(_describe(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _describe(v)) for k, v in value.items()))
    return value if isinstance(value, int | float | str | bool | type(None)) else type(value)


def kind(block: nn.Module, inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> dict[str, Any]:
    """What a block is, as ``{what: value}``: its modules' classes and scalar attributes,
    its parameters' shapes, the model's inputs to it other than the hidden states."""
    out: dict[str, Any] = {}
    for path, module in block.named_modules():
        out[f"{path or '.'} class"] = type(module).__name__
        for name, value in vars(module).items():
            scalar = isinstance(value, int | float | str | bool | type(None))
            if scalar and not name.startswith("_") and name not in POSITION_NAMES:
                out[f"{path}.{name}" if path else name] = value
    for name, p in block.named_parameters():
        out[f"{name} shape"] = tuple(p.shape)
    args, kwargs = inputs
    for i, a in enumerate(args[1:], 1):
        out[f"input {i}"] = _describe(a)
    for name, v in kwargs.items():
        if name != "hidden_states":
            out[f"input {name}"] = _describe(v)
    return out


def _difference(mine: dict[str, Any], first: dict[str, Any]) -> str:
    keys = [k for k in {**first, **mine} if mine.get(k, "absent") != first.get(k, "absent")]
    shown = [
        f"{k}={_short(mine.get(k, 'absent'))} (block 0: {_short(first.get(k, 'absent'))})"
        for k in keys[:3]
    ]
    return "; ".join(shown) + (f"; and {len(keys) - 3} more" if len(keys) > 3 else "")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _float64(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().to(torch.float64) if tree.is_floating_point() else tree
    if isinstance(tree, tuple | list):
        return type(tree)(_float64(x) for x in tree)
    if isinstance(tree, dict):
        return {k: _float64(v) for k, v in tree.items()}
    return tree


def _error(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    """The largest difference relative to the largest value of ``want`` (inf: one lacks)."""
    if got is None or want is None:
        return 0.0 if got is None and want is None else float("inf")
    if got.shape != want.shape:
        return float("inf")
    scale = float(want.abs().max()) if want.numel() else 0.0
    return float((got - want).abs().max()) / (scale or 1.0) if want.numel() else 0.0


def _dense_run(
    dense: nn.Module, inputs: tuple[tuple[Any, ...], dict[str, Any]], upstream: bool
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor | None], torch.Tensor | None]:
    """The whole block's output, and with ``upstream`` a random upstream gradient, the
    input's and parameters' gradients."""
    dense.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(upstream):
        args, kwargs, x = leaf_input(inputs)
        out = first_tensor(dense(*args, **kwargs))
        if not upstream:
            return out.detach(), None, {}, None
        g = torch.Generator().manual_seed(1)
        grad = torch.randn(out.shape, generator=g, dtype=out.dtype).to(out.device)
        out.backward(grad)
    return out.detach(), x.grad, {n: p.grad for n, p in dense.named_parameters()}, grad


def _check_grads(
    results: list[RankResult], want: dict[str, torch.Tensor | None], input_grad: Any
) -> tuple[list[str], list[str]]:
    """(the modules whose parameters are right only summed over the ranks, what differs)."""
    summed: list[str] = []
    wrong: list[str] = []
    err = max(_error(r.input_grad, input_grad) for r in results)
    if err > TOLERANCE:
        wrong.append(f"the gradient of its input differs by {err:.1e} (relative)")
    for name, rule in results[0].rules.items():
        dense = want.get(rule.dense)
        mine = [r.grads.get(name) for r in results]
        if rule.rule == "split":
            parts = [r.rules[name].part for r in results]
            err = max(
                _error(m, None if dense is None or p is None else p(dense))
                for m, p in zip(mine, parts, strict=True)
            )
        elif rule.rule == "summed":
            total = None if any(m is None for m in mine) else torch.stack(mine).sum(0)  # type: ignore[arg-type]
            if dense is not None and rule.part is not None:
                dense = rule.part(dense)
            err = _error(total, dense)
        else:
            err = max(_error(m, dense) for m in mine)
            if err > TOLERANCE and all(m is not None for m in mine):
                if _error(torch.stack(mine).sum(0), dense) <= TOLERANCE:  # type: ignore[arg-type]
                    summed.append(name.rpartition(".")[0])
                    continue
        if err > TOLERANCE:
            wrong.append(f"the gradient of '{rule.dense}' ({rule.rule}) differs by {err:.1e}")
    return summed, wrong


def prove(
    model: nn.Module,
    found: Any,
    *,
    tp: int,
    example: Any,
    refuse: Callable[..., Exception],
) -> tuple[dict[str, Style], dict[str, Any]]:
    """The block styles (``"per_head"`` entries included) and :class:`AttentionHeads`
    fields that reproduce every kind of block at ``tp`` ranks, forward and backward (module
    doc). Refuses (``refuse(model, why, example=...)``) when none does."""
    blocks = list(model.get_submodule(found.blocks).children())
    inputs = capture(model, blocks, example, refuse)
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
    dense = _float64_copy(blocks[0])
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
    with torch.random.fork_rng(devices=[]):
        want = _dense_run(dense, inputs[0], upstream=False)[0]
    worst = ""
    chosen: tuple[dict[str, Style], AttentionHeads] | None = None
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
            with torch.random.fork_rng(devices=[]):
                outs = run_ranks(
                    dense, inputs[0], t=tp, styles=styles, attention=found.attention, heads=heads
                )
            err = max(_error(o.out, want) for o in outs)
        except Exception as exc:  # noqa: BLE001 - a wrong candidate may fail any way
            worst = worst or f"{type(exc).__name__}: {exc}"
            continue
        if err <= TOLERANCE:
            chosen = styles, heads
            break
        worst = worst or f"outputs differ from the whole block by {err:.1e} (relative)"
    if chosen is None:
        raise refuse(
            model,
            f"no split of block '{found.where}' cut into {tp} simulated ranks reproduces it "
            f"(tried {len(subsets) * len(splits)} candidates: fused splits "
            f"{found.fused or 'none'}, attributes {names or 'none'}; first failure: {worst}). "
            f"The forward may read head counts from a shared config, or hold per-head "
            f"parameters",
            example=found.example,
        )
    styles, heads = chosen
    per_head = _prove_kinds(model, found, blocks, inputs, tp, styles, heads, refuse)
    styles |= {path: Style("per_head") for path in per_head}
    fields = dict(base) | {"attributes": dict(heads.attributes), "head_dim": heads.head_dim}
    return styles, fields


def _float64_copy(block: nn.Module) -> nn.Module:
    return copy.deepcopy(block).to(torch.float64)


def _prove_kinds(
    model: nn.Module,
    found: Any,
    blocks: list[nn.Module],
    inputs: list[tuple[tuple[Any, ...], dict[str, Any]]],
    tp: int,
    styles: dict[str, Style],
    heads: AttentionHeads,
    refuse: Callable[..., Exception],
) -> list[str]:
    """Step 2 of the module doc: the first block of each kind and the last, forward and
    backward; the modules that need ``"per_head"``, or a refusal naming the block."""
    kinds = [kind(b, x) for b, x in zip(blocks, inputs, strict=True)]
    chosen: list[int] = []
    for i, k in enumerate(kinds):
        if all(k != kinds[j] for j in chosen):
            chosen.append(i)
    if len(blocks) - 1 not in chosen:
        chosen.append(len(blocks) - 1)
    per_head: list[str] = []
    for i in chosen:
        dense = _float64_copy(blocks[i])
        what = f"block {i} of '{found.blocks}'"
        if i:
            differ = _difference(kinds[i], kinds[0])
            what += f" (of another kind than block 0: {differ})" if differ else ""
        try:
            with torch.random.fork_rng(devices=[]):
                want, input_grad, grads, upstream = _dense_run(dense, inputs[i], upstream=True)
                results = run_ranks(
                    dense, inputs[i], t=tp, styles=styles, attention=found.attention,
                    heads=heads, upstream=upstream, per_head=tuple(per_head),
                )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the plan fails this block
            raise refuse(
                model,
                f"the plan proven on block 0 fails {what} on {tp} simulated ranks "
                f"({type(exc).__name__}: {exc})",
                example=found.example,
            ) from exc
        err = max(_error(r.out, want) for r in results)
        summed, wrong = _check_grads(results, grads, input_grad)
        if err > TOLERANCE:
            wrong.insert(0, f"its output differs by {err:.1e} (relative)")
        if not wrong:
            per_head += [p for p in summed if p not in per_head]
            continue
        raise refuse(
            model,
            f"the plan proven on block 0 does not reproduce {what} on {tp} simulated ranks: "
            f"{'; '.join(wrong[:3])}",
            example=found.example,
        )
    return per_head
