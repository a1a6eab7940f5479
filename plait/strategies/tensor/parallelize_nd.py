"""``plait.parallelize(model, mesh, plan)`` with the styles ``"2d"``, ``"2.5d"``, ``"3d"``.

Every module with parameters is converted by type: ``nn.Linear`` -> :class:`LinearND`,
``nn.LayerNorm`` -> :class:`LayerNormND`, ``nn.Embedding`` -> :class:`EmbeddingND`. The
activations between them are split over batch and features everywhere (see ``layers_nd``),
so the plan must cover every module that holds parameters, and attention (which works on
whole heads of whole sequences) runs unchanged on this rank's heads and batch block.
``Style("3d", input="swapped")`` marks the second linear of a pair (attention's ``proj``,
the MLP's ``fc2``) under 3D; ``Style(mode, output="vocab")`` marks the output head (its
width is padded to the grid, its logits feed :func:`loss_fn`'s cross-entropy).

The model's first argument is cut along dim 0 on entry (a forward pre-hook): every rank
passes the same global batch, and keeps its block (2D: ``1/q``; 2.5D: ``1/(d q)``; 3D:
``1/q^2``). :func:`loss_fn` takes the head's logits and the global target and returns the
mean loss over the global batch on every rank. ``full_state_dict`` gives the dense keys and
shapes back. Collective: every rank of the mesh calls this with the same model and plan.

Refused up front, naming the module and what to change: a mesh that is not the mode's grid
(non-square / non-cube sizes name the nearest valid ones), mixed 1D and nD styles, a width,
head count or vocabulary the grid does not divide, parameters no plan entry covers, tied
parameters (the embedding table and the head are split differently), dropout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.strategies.tensor.checks import check_dropout, check_heads
from plait.strategies.tensor.convert import set_submodule
from plait.strategies.tensor.cross_entropy_nd import cross_entropy_nd
from plait.strategies.tensor.grid import MODES, Axis, block, grid_from_mesh
from plait.strategies.tensor.layers_nd import (
    EmbeddingND,
    LayerNormND,
    LinearND,
    Placement,
    placement,
)
from plait.strategies.tensor.optimizer import group_of_names, rebuild_optimizer
from plait.strategies.tensor.shards import full_state_dict
from plait.strategies.tensor.style import Style, resolve_styles

ND_KINDS = MODES


@dataclass
class NdInfo:
    """What :func:`parallelize_nd` did, kept on the model as ``model.plait_tensor_nd``."""

    mode: str
    where: Placement
    vocab_size: int | None
    algorithm: str

    def loss_axes(self) -> tuple[Axis, list[Axis], int, int]:
        """The head's vocabulary axis, its batch axes, and its batch block (index, parts)."""
        g = self.where.grid
        depth = [g.depth] if g.depth is not None else []
        if self.mode == "3d":
            # a "stream" head maps features to the column coordinate; its rows follow the row one
            return g.row, [g.col, *depth], g.k * g.q + g.i, g.q * g.q
        return g.row, [g.col, *depth], self.where.batch_index, self.where.batch_parts


def gpt_plan(mode: str, *, layers: int) -> dict[str, Any]:
    """The 2D / 2.5D / 3D plan of a :class:`plait.models.GPT` with ``layers`` blocks (untied)."""
    if mode not in MODES:
        raise ValueError(f"gpt_plan: mode {mode!r}; use one of {list(MODES)}")
    second = Style(mode, input="swapped") if mode == "3d" else mode
    plan: dict[str, Any] = {"tok": mode, "pos": mode, "ln_f": mode}
    for i in range(layers):
        b = f"blocks.{i}"
        plan |= {
            f"{b}.ln1": mode,
            f"{b}.attn.qkv": mode,
            f"{b}.attn.proj": second,
            f"{b}.ln2": mode,
            f"{b}.mlp.fc1": mode,
            f"{b}.mlp.fc2": second,
        }
    plan["head"] = Style(mode, output="vocab")
    return plan


def _convert(
    name: str, module: nn.Module, style: Any, where: Placement, algorithm: str
) -> nn.Module:
    if style.output not in (None, "vocab"):
        raise ValueError(f"style {style.kind!r} takes output=None or 'vocab', got {style.output!r}")
    if type(module) is nn.Linear:
        return LinearND(
            module,
            where=where,
            input=style.input or "stream",
            pad=style.output == "vocab",
            algorithm=algorithm,
        )
    if style.input is not None or style.output is not None:
        raise ValueError(f"input= / output= apply to nn.Linear only, not {type(module).__name__}")
    if type(module) is nn.LayerNorm:
        return LayerNormND(module, where=where, algorithm=algorithm)
    if type(module) is nn.Embedding:
        return EmbeddingND(module, where=where, algorithm=algorithm)
    raise TypeError(
        f"module {name!r} is a {type(module).__name__}; style {style.kind!r} applies to "
        f"nn.Linear, nn.LayerNorm and nn.Embedding"
    )


def _refuse_shared(model: nn.Module) -> None:
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{name}.{pname}" if name else pname)
    for paths in owners.values():
        if len(paths) > 1:
            raise ValueError(
                f"parameters {paths} are one shared tensor; 2d/2.5d/3d tensor parallelism "
                f"splits an embedding table and an output head differently, so tied weights "
                f"are not supported: untie them (GPTConfig(tied=False)) or use 1D ('vocab')"
            )


def parallelize_nd(
    model: nn.Module, mesh: Any, plan: Mapping[str, Any], *, algorithm: str = "auto"
) -> nn.Module:
    """Turn ``model`` into its 2D / 2.5D / 3D form (module doc). Returns ``model``, changed in
    place. Collective over the mesh."""
    styles = resolve_styles(model, plan)
    modes = {s.kind for s in styles.values()}
    if len(modes) != 1 or not modes <= set(MODES):
        raise ValueError(
            f"a 2d/2.5d/3d plan uses one mode for every entry; this one has {sorted(modes)}"
        )
    mode = modes.pop()
    grid = grid_from_mesh(mesh, mode)
    where = placement(grid)
    try:
        check_heads(model, styles, grid.q)
    except ValueError as exc:
        raise ValueError(
            f"{exc} (under {mode} the grid side q = {grid.q} splits the heads)"
        ) from exc
    check_dropout(model)
    _refuse_shared(model)
    for name, module in model.named_modules():
        if list(module.parameters(recurse=False)) and name not in styles:
            raise ValueError(
                f"under {mode} tensor parallelism every activation is split over batch and "
                f"features, but module {name!r} ({type(module).__name__}) holds parameters the "
                f"plan does not cover; give it the style {mode!r}"
            )
    modules = dict(model.named_modules())
    vocab: int | None = None
    for name in sorted(styles, key=list(modules).index):
        style = styles[name]
        try:
            new = _convert(name, modules[name], style, where, algorithm)
        except ValueError as exc:
            raise ValueError(f"module {name!r}: {exc}") from exc
        if style.output == "vocab":
            if vocab is not None:
                raise ValueError(f"module {name!r}: a plan has one output head ('vocab')")
            if mode == "3d" and style.input == "swapped":
                raise ValueError(
                    f"module {name!r}: under 3d the output head takes the stream's layout "
                    f"(input='stream'); put an even number of linears before it"
                )
            vocab = modules[name].out_features  # type: ignore[assignment]
        set_submodule(model, name, new)

    index, parts = where.batch_index, where.batch_parts

    def cut_batch(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        what = f"{mode} tensor parallelism: the model input's batch (block {index} of {parts})"
        return (block(args[0], 0, index, parts, what), *args[1:])

    model.register_forward_pre_hook(cut_batch)
    info = NdInfo(mode, where, vocab, algorithm)
    object.__setattr__(model, "plait_tensor_nd", info)
    object.__setattr__(model, "plait_full_state_dict", lambda: full_state_dict(model))
    return model


def prepare_nd(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    mesh: Any,
    mode: str,
    plan: Mapping[str, Any] | None = None,
    algorithm: str = "auto",
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """``parallelize_nd`` plus the optimizer rebuilt over the parameter shards (the same
    class, parameter groups and hyper-parameters; it must not have stepped). ``plan``: the
    model's (``plait.prepare`` looks up a family's, e.g. :func:`gpt_plan` for
    :class:`plait.models.GPT`). Collective over the mesh."""
    if plan is None:
        raise ValueError(
            f"tensor-parallel mode {mode!r} needs plan= for a {type(model).__name__} "
            f"(module path -> {mode!r}); no plan is known for its family"
        )
    groups = None if optimizer is None else group_of_names(optimizer, model)
    parallelize_nd(model, mesh, plan, algorithm=algorithm)
    if optimizer is None:
        return model, None
    return model, rebuild_optimizer(optimizer, model, groups)


def loss_fn(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The mean cross-entropy over the global batch for a 2D/2.5D/3D model's logits and the
    global target (see ``cross_entropy_nd``). Collective."""
    info: NdInfo | None = getattr(model, "plait_tensor_nd", None)
    if info is None or info.vocab_size is None:
        raise ValueError(
            "loss_fn: the model was not parallelized with a 2d/2.5d/3d head "
            "(Style(mode, output='vocab'))"
        )
    vocab_axis, batch_axes, index, parts = info.loss_axes()
    vocab_size = info.vocab_size

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy_nd(
            logits,
            target,
            vocab_axis=vocab_axis,
            batch_axes=batch_axes,
            batch_index=index,
            batch_parts=parts,
            vocab_size=vocab_size,
            algorithm=info.algorithm,
        )

    return loss


__all__ = ["ND_KINDS", "NdInfo", "gpt_plan", "loss_fn", "parallelize_nd", "prepare_nd"]
