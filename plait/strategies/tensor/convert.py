"""Module rewriting: each plan entry's dense module becomes its parallel layer
(:class:`ColumnParallelLinear`, :class:`RowParallelLinear`, :class:`VocabParallelEmbedding`,
:class:`HeadSelectLinear`, :class:`MultiQueryLinear`), its weights sliced, not re-initialised;
or keeps its module and gains hooks (``"scatter"``/``"gather"`` at its entry, gradient sums
for ``"sequence"`` and ``"per_head"``).

Communication added per style (on the tensor-parallel group, in forward / backward): see the
layers' docstrings and :mod:`~plait.strategies.tensor.mappings`; ``"scatter"`` slices the
sequence (backward: all-gather), ``"gather"`` is "f" (backward: all-reduce) or, under sequence
parallelism, a sequence all-gather (backward: reduce-scatter); ``"sequence"`` and
``"per_head"`` all-reduce their parameters' gradients in backward."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.comm.group import Group
from plait.strategies.tensor import mappings as M
from plait.strategies.tensor.checks import check_plain
from plait.strategies.tensor.layers import (
    ColumnParallelLinear,
    HeadSelectLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from plait.strategies.tensor.multi_query import MultiQueryLinear
from plait.strategies.tensor.style import HOOKS, Style


def _copy(x: torch.Tensor, *, group: Group, algorithm: str) -> torch.Tensor:
    return M.copy_to_tp(x, group=group, algorithm=algorithm)


def as_linear(name: str, module: nn.Module) -> nn.Linear:
    """The ``nn.Linear`` a transposed linear (weight ``[in, out]``, ``x @ weight + bias``)
    computes, sharing nothing with it (its slices are copied out)."""
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(
            f"module {name!r} is a {type(module).__name__} without a 2-D weight; "
            f"Style(transposed=True) is for linears storing their weight as [in, out]"
        )
    n_in, n_out = weight.shape
    linear = nn.Linear(n_in, n_out, bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach().t(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return linear


def convert(
    name: str,
    module: nn.Module,
    style: Style,
    *,
    group: Group,
    sp: bool,
    algorithm: str,
    kv_replicas: tuple[int, int] | None = None,
) -> nn.Module | None:
    """The parallel replacement of ``module`` (None: keep it, perhaps with hooks).
    ``kv_replicas``: ``(head_dim, replicas)`` for a key/value projection whose heads are
    fewer than the ranks (kept whole, each rank computing one head)."""
    kind = style.kind
    seq_or_rep = "sequence" if sp else "replicate"
    if style.transposed:
        module = as_linear(name, module)
    elif kind in ("colwise", "rowwise"):
        check_plain(name, module, nn.Linear, kind)
    if kind == "colwise" and kv_replicas is not None:
        head_dim, replicas = kv_replicas
        return HeadSelectLinear.from_dense(
            module,  # type: ignore[arg-type]
            group=group,
            head_dim=head_dim,
            replicas=replicas,
            input=style.input or seq_or_rep,
            algorithm=algorithm,
        )
    if kind == "colwise" and style.tail:
        return MultiQueryLinear.from_dense(
            module,  # type: ignore[arg-type]
            group=group,
            tail=style.tail,
            input=style.input or seq_or_rep,
            algorithm=algorithm,
        )
    if kind == "colwise":
        return ColumnParallelLinear.from_dense(
            module,  # type: ignore[arg-type]
            group=group,
            input=style.input or seq_or_rep,
            gather_output=style.output == "replicate",
            blocks=style.blocks,
            transposed=style.transposed,
            algorithm=algorithm,
        )
    if kind == "rowwise":
        return RowParallelLinear.from_dense(
            module,  # type: ignore[arg-type]
            group=group,
            input=style.input or "sharded",
            output=style.output or seq_or_rep,
            transposed=style.transposed,
            algorithm=algorithm,
        )
    if kind == "vocab":
        if isinstance(module, nn.Embedding):
            check_plain(name, module, nn.Embedding, kind)
            return VocabParallelEmbedding.from_dense(
                module, group=group, output=style.output or seq_or_rep, algorithm=algorithm
            )
        if isinstance(module, nn.Linear):
            check_plain(name, module, nn.Linear, kind)
            return ColumnParallelLinear.from_dense(
                module,
                group=group,
                input=style.input or seq_or_rep,
                pad=True,
                gather_output=style.output == "replicate",
                algorithm=algorithm,
            )
        raise TypeError(
            f"module {name!r} is a {type(module).__name__}; style 'vocab' applies to "
            f"nn.Embedding (input side) or nn.Linear (output head)"
        )
    if kind in HOOKS:
        if kind == "scatter" and not sp:
            raise AssertionError("a 'scatter' entry turns sequence parallelism on")
        move = (
            M.scatter_to_sequence if kind == "scatter" else M.gather_from_sequence if sp else _copy
        )

        def enter(
            _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            if args:
                return (move(args[0], group=group, algorithm=algorithm), *args[1:]), kwargs
            if "hidden_states" not in kwargs:
                raise TypeError(
                    f"module {name!r} (style {kind!r}) was called without a positional input "
                    f"or hidden_states="
                )
            moved = move(kwargs["hidden_states"], group=group, algorithm=algorithm)
            return args, {**kwargs, "hidden_states": moved}

        module.register_forward_pre_hook(enter, with_kwargs=True)
        return None
    if kind == "per_head":
        # each rank's gradient covers its heads only; the dense gradient is their sum
        for p in module.parameters(recurse=True):
            M.sum_gradient_across(p, group=group, algorithm=algorithm)
        return None
    if kind == "sequence":
        if not sp:
            raise AssertionError("a 'sequence' entry turns sequence parallelism on")
        for p in module.parameters(recurse=True):
            M.sum_gradient_across(p, group=group, algorithm=algorithm)
        if style.input == "replicate":

            def slice_input(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
                return (M.scatter_to_sequence(args[0], group=group, algorithm=algorithm), *args[1:])

            module.register_forward_pre_hook(slice_input)
        elif style.input not in (None, "sequence"):
            raise ValueError(
                f"module {name!r}: style 'sequence' takes input 'sequence' or 'replicate'"
            )
        return None
    return None  # "replicate"


def set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_name, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, module)
