"""``plait.parallelize(model, mesh, plan)``: a dense model becomes its tensor-parallel form.

The plan maps module paths (``fnmatch`` patterns: ``"blocks.*.mlp.fc1"``) to styles:

=============  ==================  ==========================================================
style          module              becomes
=============  ==================  ==========================================================
"colwise"      ``nn.Linear``       :class:`ColumnParallelLinear` (output rows split)
"rowwise"      ``nn.Linear``       :class:`RowParallelLinear` (input columns split)
"vocab"        ``nn.Embedding``    :class:`VocabParallelEmbedding` (vocabulary rows split)
"vocab"        ``nn.Linear``       an output head split by vocabulary (padded), whose
                                   logits feed :func:`vocab_parallel_cross_entropy`
"sequence"     any                 runs on this rank's slice of the sequence; its parameters
                                   stay replicated and their gradients are summed over the
                                   group (the sequence-parallel LayerNorm)
"replicate"    any                 unchanged (its input and output are whole)
"2d", "2.5d",  ``nn.Linear``,      the 2D / 2.5D / 3D layers of ``layers_nd`` on the mesh's
"3d"           ``nn.LayerNorm``,   ``row`` x ``col`` (x ``depth``) grid; a plan uses one of
               ``nn.Embedding``    them for every entry (see ``parallelize_nd``)
=============  ==================  ==========================================================

A plan with any ``"sequence"`` entry turns on sequence parallelism for the whole model:
activations between the tensor-parallel regions are then sliced along the sequence (dim 1),
column-parallel layers all-gather their input instead of "f", row-parallel layers and the
vocab embedding reduce-scatter their output instead of "g". Under sequence parallelism
every parameter must be covered by the plan, so a LayerNorm whose gradient would silently
stay partial (Megatron-LM #1446, gpt-neox #1257) is refused by name instead.

The dense weights are sliced, not re-initialised: a model built and seeded the same on
every rank of the group becomes exactly its sharded form. Shared weights (an output head
tied to the embedding) stay shared when both modules are split the same way. The model is
changed in place and returned; ``plait.checkpoint.full_state_dict(model)`` gathers the
dense state dict (keys and shapes of the dense model). Collective: every rank of the group
must call ``parallelize`` with the same model and plan.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.comm.group import Group
from plait.strategies.tensor import mappings as M
from plait.strategies.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from plait.strategies.tensor.layers_nd import ND_LAYERS
from plait.strategies.zero.groups import constructor_kwargs

# the 2D / 2.5D / 3D styles, handled by parallelize_nd
ND_KINDS = ("2d", "2.5d", "3d")

KINDS = ("colwise", "rowwise", "vocab", "sequence", "replicate", *ND_KINDS)
PARALLEL_LAYERS = (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    *ND_LAYERS,
)


@dataclass(frozen=True)
class Style:
    """A plan entry. ``kind`` is one of :data:`KINDS`; ``input``/``output`` override the
    layouts the mode implies (``"replicate"``, ``"sequence"``, or for a row-parallel
    input ``"sharded"``). ``Style("sequence", input="replicate")`` slices a whole input
    along the sequence on entry (the position embedding's ids)."""

    kind: str
    input: str | None = None
    output: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown tensor-parallel style {self.kind!r}; use one of {KINDS}")


@dataclass
class TensorParallelInfo:
    """What :func:`parallelize` did, kept on the model as ``model.plait_tensor_parallel``."""

    group: Group
    sequence_parallel: bool
    styles: dict[str, Style]
    vocab_size: int | None  # the real vocabulary of a "vocab" head, for the loss
    algorithm: str = "auto"  # the collectives' algorithm, the loss's too


def _group_of(mesh: Any) -> Group:
    if isinstance(mesh, Group):
        return mesh
    group = getattr(mesh, "group", None)
    if callable(group):
        return group("tp")  # type: ignore[no-any-return]
    raise TypeError(
        f"parallelize: pass a plait.Mesh with a 'tp' dimension or a Group, got {mesh!r}"
    )


def _resolve(model: nn.Module, plan: Mapping[str, str | Style]) -> dict[str, Style]:
    """Module path -> style, every pattern matching at least one module."""
    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, Style] = {}
    for pattern, value in plan.items():
        style = Style(value) if isinstance(value, str) else value
        if not isinstance(style, Style):
            raise TypeError(f"plan[{pattern!r}]: expected a style name or Style, got {value!r}")
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(
                f"plan entry {pattern!r} matches no module of {type(model).__name__}; module "
                f"paths look like {names[:6]}"
            )
        for n in hits:
            if n in out and out[n] != style:
                raise ValueError(f"module {n!r} is given two styles: {out[n]} and {style}")
            out[n] = style
    return out


def _check_heads(model: nn.Module, styles: dict[str, Style], t: int) -> None:
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention) and any(
            s.startswith(f"{name}.") for s in styles
        ):
            raise ValueError(
                f"module {name!r} is an nn.MultiheadAttention, which reads its projections' "
                f"weights directly; tensor parallelism needs attention written with separate "
                f"nn.Linear projections (see plait.models.gpt.Attention)"
            )
        heads = getattr(module, "heads", getattr(module, "num_heads", None))
        if isinstance(heads, int) and heads % t and any(s.startswith(f"{name}.") for s in styles):
            raise ValueError(
                f"module {name!r} has {heads} attention heads, not divisible by the "
                f"tensor-parallel size {t}; choose a tensor-parallel size that divides {heads}"
            )


def _check_dropout(model: nn.Module) -> None:
    """Refuse dropout: every tensor-parallel rank holds the same RNG state, so dropout on a
    rank's heads or sequence slice would draw the same mask as its peers' (correlated
    across ranks, unlike the dense model's); plait has no per-rank RNG streams yet."""
    for name, module in model.named_modules():
        p = module.p if isinstance(module, nn.modules.dropout._DropoutNd) else None
        rate = getattr(module, "dropout", None)
        if isinstance(rate, float) and not isinstance(module, nn.MultiheadAttention):
            p = max(p or 0.0, rate)
        if p:
            raise ValueError(
                f"module {name or type(model).__name__!r} has dropout {p}: under tensor "
                f"parallelism every rank would draw the same dropout mask for different heads "
                f"or sequence slices (plait has no per-rank RNG streams yet); set dropout to 0"
            )


def _convert(
    name: str, module: nn.Module, style: Style, *, group: Group, sp: bool, algorithm: str
) -> nn.Module | None:
    """The parallel replacement of ``module`` (None: keep it, perhaps with hooks)."""
    kind = style.kind
    seq_or_rep = "sequence" if sp else "replicate"
    if kind in ("colwise", "rowwise") and type(module) is not nn.Linear:
        raise TypeError(
            f"module {name!r} is a {type(module).__name__}; style {kind!r} applies to "
            f"nn.Linear only"
        )
    if kind == "colwise":
        return ColumnParallelLinear.from_dense(
            module,  # type: ignore[arg-type]
            group=group,
            input=style.input or seq_or_rep,
            gather_output=style.output == "replicate",
            algorithm=algorithm,
        )
    if kind == "rowwise":
        return RowParallelLinear.from_dense(
            module,  # type: ignore[arg-type]
            group=group,
            input=style.input or "sharded",
            output=style.output or seq_or_rep,
            algorithm=algorithm,
        )
    if kind == "vocab":
        if type(module) is nn.Embedding:
            return VocabParallelEmbedding.from_dense(
                module, group=group, output=style.output or seq_or_rep, algorithm=algorithm
            )
        if type(module) is nn.Linear:
            return ColumnParallelLinear.from_dense(
                module, group=group, input=style.input or seq_or_rep, pad=True, algorithm=algorithm
            )
        raise TypeError(
            f"module {name!r} is a {type(module).__name__}; style 'vocab' applies to "
            f"nn.Embedding (input side) or nn.Linear (output head)"
        )
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


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_name, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, module)


def parallelize(
    model: nn.Module,
    mesh: Any,
    plan: Mapping[str, str | Style],
    *,
    algorithm: str = "auto",
) -> nn.Module:
    """Turn ``model`` into its tensor-parallel form over ``mesh.group("tp")`` (or a Group).

    Returns ``model`` itself, changed in place (see the module doc for the styles and the
    communication each adds). Raises ``ValueError``/``TypeError`` naming the module for a
    plan entry that matches nothing, a style that does not fit the module, a width, vocab
    or head count the tensor-parallel size does not divide, dropout (no per-rank RNG streams
    yet), and, under sequence parallelism, a parameter no plan entry covers. Collective over
    the group.
    """
    if any(getattr(v, "kind", v) in ND_KINDS for v in plan.values()):
        from plait.strategies.tensor.parallelize_nd import parallelize_nd

        return parallelize_nd(model, mesh, plan, algorithm=algorithm)
    group = _group_of(mesh)
    styles = _resolve(model, plan)
    sp = any(s.kind == "sequence" for s in styles.values())
    _check_heads(model, styles, group.size)
    _check_dropout(model)
    modules = dict(model.named_modules())
    if sp:
        covered = [n for n in styles]
        for name, module in model.named_modules():
            own = list(module.parameters(recurse=False))
            if own and not any(name == c or name.startswith(f"{c}.") for c in covered):
                raise ValueError(
                    f"under sequence parallelism module {name!r} ({type(module).__name__}) "
                    f"would see only this rank's slice of the sequence, but the plan does not "
                    f"cover it: give it the 'sequence' style (its gradients are then summed "
                    f"over the group) or 'replicate' if its input is whole"
                )
    owners: dict[int, list[str]] = {}
    for name, module in modules.items():
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{name}.{pname}" if name else pname)
    replaced: dict[str, nn.Module] = {}
    for name in sorted(styles, key=list(modules).index):
        style = styles[name]
        try:
            new = _convert(name, modules[name], style, group=group, sp=sp, algorithm=algorithm)
        except ValueError as exc:
            raise ValueError(f"module {name!r}: {exc}") from exc
        if new is not None:
            _set(model, name, new)
            replaced[name] = new
    _retie(modules, replaced, owners)
    vocab = [
        m.out_features
        for n, m in replaced.items()
        if styles[n].kind == "vocab" and isinstance(m, ColumnParallelLinear)
    ]
    info = TensorParallelInfo(group, sp, styles, vocab[0] if vocab else None, algorithm)
    object.__setattr__(model, "plait_tensor_parallel", info)
    object.__setattr__(model, "plait_full_state_dict", lambda: full_state_dict(model))
    return model


def _retie(
    before: dict[str, nn.Module], replaced: dict[str, nn.Module], owners: dict[int, list[str]]
) -> None:
    """Parameters the dense model shared stay shared if every sharer was split alike."""
    for paths in owners.values():
        if len(paths) < 2:
            continue
        mods = [p.rpartition(".") for p in paths]
        news = [replaced.get(m) for m, _, _ in mods]
        if all(n is None for n in news):
            continue
        if any(n is None for n in news):
            raise ValueError(
                f"parameters {paths} are one shared tensor, but the plan splits only some of "
                f"their modules; give them all the same style (e.g. 'vocab' for a tied head)"
            )
        first = getattr(news[0], mods[0][2])
        for n, (m, _, attr) in zip(news[1:], mods[1:], strict=True):
            mine = getattr(n, attr)
            starts = (getattr(news[0], "start", None), getattr(n, "start", None))
            if mine.shape != first.shape or starts[0] != starts[1]:
                raise ValueError(
                    f"{paths[0]} and {m}.{attr} are tied but split differently "
                    f"({tuple(first.shape)} vs {tuple(mine.shape)}); give them the same style"
                )
            setattr(n, attr, first)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The dense model's state dict (keys and shapes) on every rank: each parallel layer's
    shards all-gathered over its group, in module order. Collective."""
    state = model.state_dict()
    for name, module in model.named_modules():
        if isinstance(module, PARALLEL_LAYERS):
            prefix = f"{name}." if name else ""
            for key, value in module.full_state().items():
                state[prefix + key] = value
    return state


def rebuild_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
    """The same optimizer class and hyper-parameters over the parallelized parameters."""
    if len(optimizer.param_groups) != 1 or optimizer.state:
        raise ValueError(
            "strategy 'tp' re-creates the optimizer on the parameter shards: pass an optimizer "
            "with one parameter group that has not stepped yet"
        )
    # the constructor takes only some of the defaults (AdamW: not decoupled_weight_decay)
    hyper = constructor_kwargs(
        type(optimizer),
        {k: v for k, v in optimizer.param_groups[0].items() if k in optimizer.defaults},
    )
    return type(optimizer)(model.parameters(), **hyper)


def prepare_tp(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    mesh: Any,
    plan: Mapping[str, str | Style] | None = None,
    sequence_parallel: bool = False,
    mode: str = "1d",
    algorithm: str = "auto",
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """``plait.prepare(model, optimizer, strategy="tp", mesh=..., plan=..., mode=...)``.

    Without a plan, a :class:`plait.models.GPT` gets its own (``tp_plan``, with
    ``sequence_parallel``); other models must pass one. ``mode`` ``"2d"``, ``"2.5d"`` or
    ``"3d"`` runs :func:`~plait.strategies.tensor.parallelize_nd.prepare_nd` on the mesh's
    ``row`` x ``col`` (x ``depth``) grid (``grid_mesh(mode, n)`` builds one).
    """
    if mode != "1d":
        from plait.strategies.tensor.parallelize_nd import prepare_nd

        if mode not in ND_KINDS:
            raise ValueError(f"strategy 'tp': mode={mode!r}; use '1d' or one of {ND_KINDS}")
        if sequence_parallel:
            raise ValueError(f"strategy 'tp': sequence_parallel is 1D only (mode {mode!r})")
        return prepare_nd(model, optimizer, mesh=mesh, mode=mode, plan=plan, algorithm=algorithm)
    if plan is None:
        from plait.models.gpt import GPT, tp_plan

        if not isinstance(model, GPT):
            raise ValueError(
                f"strategy 'tp' needs plan= for a {type(model).__name__} (module path -> "
                f"'colwise' / 'rowwise' / 'vocab' / 'sequence'); only plait.models.GPT has a "
                f"default plan"
            )
        plan = tp_plan(layers=model.config.layers, sequence_parallel=sequence_parallel)
    elif sequence_parallel:
        raise ValueError("strategy 'tp': with an explicit plan, mark sequence regions in it")
    parallelize(model, mesh, plan, algorithm=algorithm)
    return model, None if optimizer is None else rebuild_optimizer(optimizer, model)


def loss_fn(model: nn.Module) -> Any:
    """The loss for a parallelized model's logits: the vocab-parallel cross-entropy when
    its head is split by vocabulary, otherwise ``F.cross_entropy`` (flattened)."""
    from plait.strategies.tensor.cross_entropy import vocab_parallel_cross_entropy

    if getattr(model, "plait_tensor_nd", None) is not None:
        from plait.strategies.tensor.parallelize_nd import loss_fn as loss_fn_nd

        return loss_fn_nd(model)
    info: TensorParallelInfo | None = getattr(model, "plait_tensor_parallel", None)

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if info is not None and info.vocab_size is not None:
            return vocab_parallel_cross_entropy(
                logits,
                target,
                group=info.group,
                vocab_size=info.vocab_size,
                algorithm=info.algorithm,
            )
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    return loss
