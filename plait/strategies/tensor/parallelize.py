"""``plait.parallelize(model, mesh, plan)``: a dense model becomes its tensor-parallel form.

The plan maps module paths (``fnmatch`` patterns: ``"blocks.*.mlp.fc1"``) to styles:

=============  ==================  ==========================================================
style          module              becomes
=============  ==================  ==========================================================
"colwise"      ``nn.Linear``       :class:`ColumnParallelLinear` (output rows split); a
                                   key/value projection with fewer heads than ranks:
                                   :class:`HeadSelectLinear` (see ``plan.AttentionHeads``)
"rowwise"      ``nn.Linear``       :class:`RowParallelLinear` (input columns split)
"vocab"        ``nn.Embedding``    :class:`VocabParallelEmbedding` (vocabulary rows split,
                                   ``padding_idx`` kept)
"vocab"        ``nn.Linear``       an output head split by vocabulary (padded), whose
                                   logits feed :func:`vocab_parallel_cross_entropy`, or with
                                   ``Style("vocab", output="replicate")`` are all-gathered
                                   (the full logits, for a model's own loss)
"sequence"     any                 runs on this rank's slice of the sequence; its parameters
                                   stay replicated and their gradients are summed over the
                                   group (the sequence-parallel LayerNorm)
"per_head"     any                 applied to this rank's heads only (a per-head norm:
                                   Qwen3's ``q_norm``/``k_norm``): its parameters stay whole
                                   and each backward's gradient is summed over the group
"scatter"      any                 sequence parallelism: its first input is whole and is
                                   sliced along the sequence on entry (backward: all-gather)
"gather"       any                 its first input (or its ``hidden_states``) enters the
                                   tensor-parallel region once for all its column-parallel
                                   layers, which take ``Style("colwise", input="gathered")``:
                                   "f" (backward: one all-reduce of ``dX`` instead of one
                                   per layer) or, under sequence parallelism, an all-gather
                                   of the sequence (backward: reduce-scatter), for a module
                                   that needs the whole sequence (attention reshaping by its
                                   input's length). Exact only when every use of that input
                                   inside the module is column-parallel
"replicate"    any                 unchanged (its input and output are whole)
"2d", "2.5d",  ``nn.Linear``,      the 2D / 2.5D / 3D layers of ``layers_nd`` on the mesh's
"3d"           ``nn.LayerNorm``,   ``row`` x ``col`` (x ``depth``) grid; a plan uses one of
               ``nn.Embedding``    them for every entry (see ``parallelize_nd``)
=============  ==================  ==========================================================

``nn.Linear``/``nn.Embedding`` include subclasses that keep the base class's ``forward``, and
linears whose own forward is checked, on a random input, to compute ``x @ W.T + b``
(:func:`computes_linear`: Falcon's ``FalconLinear``); any other is refused by name.
``Style(transposed=True)`` splits a linear storing its weight as ``[in, out]`` (GPT-2's
``Conv1D``), ``Style(blocks=k)`` a fused projection part by part. A
:class:`~plait.strategies.tensor.plan.TensorPlan` adds the attention heads: their counts are
checked against ``t`` by name and the attributes that hold them set to this rank's.

A plan with any ``"sequence"`` (or ``"scatter"``) entry turns on sequence parallelism for
the whole model: activations between the tensor-parallel regions are then sliced along the
sequence (dim 1), column-parallel layers all-gather their input instead of "f",
row-parallel layers and the vocab embedding reduce-scatter their output instead of "g".
Under sequence parallelism every parameter must be covered by the plan, so a LayerNorm
whose gradient would silently stay partial (Megatron-LM #1446, gpt-neox #1257) is refused
by name instead.

The dense weights are sliced, not re-initialised: a model built and seeded the same on
every rank of the group becomes exactly its sharded form. Shared weights (an output head
tied to the embedding) stay shared when both modules are split the same way. The model is
changed in place and returned; ``plait.checkpoint.full_state_dict(model)`` gathers the
dense state dict (keys and shapes of the dense model). Collective: every rank of the group
must call ``parallelize`` with the same model and plan; before slicing,
:func:`~plait.strategies.tensor.agreement.check_agreement` verifies that they did (one
all-gather of two numbers per parameter), naming the ranks and the first parameter that
differs. Every parameter left on a rank is placed
(:mod:`plait.strategies.placement`: split ones shard over the group, the others replicate
over it), so ``plait.clip_grad_norm_(model.parameters(), max_norm)`` is the global norm.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from plait.comm.group import Group
from plait.renames import accepts_model
from plait.strategies.data_parallel.grad_sync import check_policy
from plait.strategies.placement import place
from plait.strategies.tensor import mappings as M
from plait.strategies.tensor.agreement import check_agreement
from plait.strategies.tensor.cross_entropy import vocab_parallel_cross_entropy
from plait.strategies.tensor.finite import watch_finite
from plait.strategies.tensor.layers import (
    ColumnParallelLinear,
    HeadSelectLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from plait.strategies.tensor.layers_nd import ND_LAYERS
from plait.strategies.tensor.multi_query import MultiQueryLinear
from plait.strategies.tensor.parallelize_nd import loss_fn as loss_fn_nd
from plait.strategies.tensor.parallelize_nd import parallelize_nd, prepare_nd
from plait.strategies.tensor.plan import AttentionHeads, TensorPlan, as_plan
from plait.strategies.zero.groups import constructor_kwargs

# the 2D / 2.5D / 3D styles, handled by parallelize_nd
ND_KINDS = ("2d", "2.5d", "3d")

KINDS = (
    "colwise",
    "rowwise",
    "vocab",
    "sequence",
    "per_head",
    "scatter",
    "gather",
    "replicate",
    *ND_KINDS,
)
# styles that only move activations at a module's entry: they split no parameter
HOOKS = ("scatter", "gather")
PARALLEL_LAYERS = (
    MultiQueryLinear,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    HeadSelectLinear,
    *ND_LAYERS,
)


@dataclass(frozen=True)
class Style:
    """A plan entry. ``kind`` is one of :data:`KINDS`; ``input``/``output`` override the
    layouts the mode implies (``"replicate"``, ``"sequence"``, or for a row-parallel
    input ``"sharded"``). ``Style("sequence", input="replicate")`` slices a whole input
    along the sequence on entry (the position embedding's ids).

    ``transposed``: the module stores its weight as ``[in, out]`` and computes
    ``x @ weight + bias`` (Hugging Face's ``Conv1D`` in GPT-2); it is split as the linear it
    is and ``full_state_dict`` gives its weight back in its own layout. ``blocks``: a fused
    column-parallel projection whose output is ``blocks`` equal parts (GPT-2's ``c_attn``:
    queries, keys, values): each part is split separately, so every rank holds its slice
    of each. ``tail``: a fused multi-query projection whose last ``tail`` outputs (the one
    shared key and value head) stay whole on every rank while the query rows are split
    (:class:`~plait.strategies.tensor.multi_query.MultiQueryLinear`)."""

    kind: str
    input: str | None = None
    output: str | None = None
    transposed: bool = False
    blocks: int = 1
    tail: int = 0

    def __post_init__(self) -> None:
        if self.tail and (self.kind != "colwise" or self.blocks != 1 or self.transposed):
            raise ValueError(
                f"Style({self.kind!r}, tail={self.tail}): a whole tail (multi-query key and "
                f"value) is for a plain 'colwise' linear without blocks"
            )
        if self.kind not in KINDS:
            raise ValueError(f"unknown tensor-parallel style {self.kind!r}; use one of {KINDS}")
        if self.blocks < 1 or (self.blocks > 1 and self.kind != "colwise"):
            raise ValueError(
                f"Style({self.kind!r}, blocks={self.blocks}): blocks (a fused projection's "
                f"parts) is for 'colwise' only, at least 1"
            )
        if self.transposed and self.kind not in ("colwise", "rowwise"):
            raise ValueError(f"Style({self.kind!r}, transposed=True): for linears only")


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
        for attr in ("dropout", "attention_dropout"):
            rate = getattr(module, attr, None)
            if isinstance(rate, float) and not isinstance(module, nn.MultiheadAttention):
                p = max(p or 0.0, rate)
        if p:
            raise ValueError(
                f"module {name or type(model).__name__!r} has dropout {p}: under tensor "
                f"parallelism every rank would draw the same dropout mask for different heads "
                f"or sequence slices (plait has no per-rank RNG streams yet); set dropout to 0"
            )


def computes_linear(module: nn.Module) -> bool:
    """Whether ``module``, an ``nn.Linear`` (or a subclass with its own forward: Falcon's
    ``FalconLinear``), computes ``x @ weight.T + bias``: checked on a random input of
    ``2 x 3`` rows, not assumed. A module on the ``meta`` device cannot be checked (False)."""
    if not isinstance(module, nn.Linear):
        return False
    if type(module).forward is nn.Linear.forward:
        return True
    weight = module.weight
    if weight.device.type == "meta":
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, module.in_features, generator=g, dtype=torch.float64)
    x = x.to(device=weight.device, dtype=weight.dtype)
    try:
        with torch.no_grad():
            got = module(x)
            want = F.linear(x, weight, module.bias)
    except Exception:  # noqa: BLE001 - a forward that cannot take a plain input is no linear
        return False
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return False
    tol = (
        1e-12 if weight.dtype == torch.float64 else 1e-5 if weight.dtype == torch.float32 else 1e-2
    )
    scale = float(want.abs().max()) or 1.0
    return float((got - want).abs().max()) <= tol * scale


def _plain(name: str, module: nn.Module, base: type[nn.Module], kind: str) -> None:
    """Refuse ``module`` unless it computes what ``base`` computes: ``base`` itself, a
    subclass that keeps ``base.forward`` (torchtitan's and others' own Linear/Embedding
    classes that only change initialisation), or a linear whose own forward is checked to
    be plain (:func:`computes_linear`)."""
    if not isinstance(module, base):
        raise TypeError(
            f"module {name!r} is a {type(module).__name__}; style {kind!r} applies to "
            f"nn.{base.__name__} (or a subclass of it)"
        )
    if type(module).forward is not base.forward and not (
        base is nn.Linear and computes_linear(module)
    ):
        raise TypeError(
            f"module {name!r} is a {type(module).__name__}, a subclass of nn.{base.__name__} "
            f"with its own forward that computes something else than nn.{base.__name__}'s "
            f"(checked on a random input); style {kind!r} would replace it. Give it the style "
            f"'replicate', or split it yourself"
        )


def _copy(x: torch.Tensor, *, group: Group, algorithm: str) -> torch.Tensor:
    return M.copy_to_tp(x, group=group, algorithm=algorithm)


def _as_linear(name: str, module: nn.Module) -> nn.Linear:
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


def _convert(
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
        module = _as_linear(name, module)
    elif kind in ("colwise", "rowwise"):
        _plain(name, module, nn.Linear, kind)
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
            _plain(name, module, nn.Embedding, kind)
            return VocabParallelEmbedding.from_dense(
                module, group=group, output=style.output or seq_or_rep, algorithm=algorithm
            )
        if isinstance(module, nn.Linear):
            _plain(name, module, nn.Linear, kind)
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


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_name, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, module)


def _attention(
    model: nn.Module, plan: TensorPlan, styles: dict[str, Style], t: int
) -> tuple[dict[str, tuple[int, int]], list[tuple[nn.Module, dict[str, int], AttentionHeads]]]:
    """Check every :class:`AttentionHeads` entry against ``t`` (naming the module); return
    the key/value projections to keep whole (path -> ``(head_dim, replicas)``) and the
    attention modules whose head-count attributes become this rank's."""
    keep_whole: dict[str, tuple[int, int]] = {}
    counted: list[tuple[nn.Module, dict[str, int], AttentionHeads]] = []
    names = [n for n, _ in model.named_modules() if n]
    for heads in plan.attention:
        hits = [n for n in names if fnmatch.fnmatchcase(n, heads.modules)]
        if not hits:
            raise ValueError(
                f"AttentionHeads pattern {heads.modules!r} matches no module of "
                f"{type(model).__name__}; module paths look like {names[:6]}"
            )
        local = heads.local(t)
        for n in hits:
            module = model.get_submodule(n)
            counted.append((module, local, heads))
            if local["replicas"] == 1:
                continue
            for child in heads.key_value:
                path = f"{n}.{child}"
                proj = module.get_submodule(child)
                if styles.get(path, Style("replicate")).kind != "colwise":
                    raise ValueError(
                        f"attention {n!r}: key/value projection {path!r} must have the style "
                        f"'colwise' (it is kept whole and each rank computes its own head)"
                    )
                kv = heads.kv_heads or heads.heads
                out = getattr(proj, "out_features", 0)
                if out % kv:
                    raise ValueError(f"attention {n!r}: {path!r} has {out} outputs, not {kv} heads")
                keep_whole[path] = (out // kv, local["replicas"])
    return keep_whole, counted


@accepts_model()
def parallelize(
    module: nn.Module,
    mesh: Any,
    plan: TensorPlan | Mapping[str, str | Style],
    *,
    algorithm: str = "auto",
    check: bool = True,
) -> nn.Module:
    """Turn ``model`` into its tensor-parallel form over ``mesh.group("tp")`` (or a Group).

    ``plan``: a :class:`~plait.strategies.tensor.plan.TensorPlan` (styles and attention
    heads) or a plain ``{pattern: style}`` mapping. Returns ``model`` itself, changed in
    place (see the module doc for the styles and the communication each adds). Every
    parameter left on a rank is placed (:func:`plait.strategies.placement.place`): split
    weights shard over the group, the rest replicate over it, so
    ``plait.clip_grad_norm_(model.parameters(), ...)`` is global.

    Raises ``ValueError``/``TypeError`` naming the module for a plan entry that matches
    nothing, a style that does not fit the module, a width, vocab or head count the
    tensor-parallel size does not divide, dropout (no per-rank RNG streams yet), and, under
    sequence parallelism, a parameter no plan entry covers. With ``check`` (the default),
    first verifies that every rank holds the same parameters, values and plan
    (:func:`~plait.strategies.tensor.agreement.check_agreement`: one all-gather). Collective
    over the group.
    """
    model = module
    if not isinstance(plan, TensorPlan) and any(
        getattr(v, "kind", v) in ND_KINDS for v in plan.values()
    ):
        return parallelize_nd(model, mesh, plan, algorithm=algorithm)
    tplan = as_plan(plan)
    group = _group_of(mesh)
    styles = _resolve(model, tplan.styles)
    sp = any(s.kind in ("sequence", "scatter") for s in styles.values())
    _check_heads(model, styles, group.size)
    keep_whole, counted = _attention(model, tplan, styles, group.size)
    _check_dropout(model)
    if check:
        lines = [f"{n}: {s}" for n, s in styles.items()] + [repr(h) for h in tplan.attention]
        check_agreement(list(model.named_parameters()), lines, group)
    modules = dict(model.named_modules())
    if sp:
        covered = [n for n, s in styles.items() if s.kind not in HOOKS]
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
            new = _convert(
                name,
                modules[name],
                style,
                group=group,
                sp=sp,
                algorithm=algorithm,
                kv_replicas=keep_whole.get(name),
            )
        except ValueError as exc:
            raise ValueError(f"module {name!r}: {exc}") from exc
        if new is not None:
            _set(model, name, new)
            replaced[name] = new
    _retie(modules, replaced, owners)
    for module, local, heads in counted:
        for attr, what in heads.attributes.items():
            if hasattr(module, attr):
                setattr(module, attr, local[what])
        _split_head_params(module, heads, group)
    _place(model, group)
    vocab = [
        m.out_features
        for n, m in replaced.items()
        if styles[n].kind == "vocab" and isinstance(m, ColumnParallelLinear) and not m.gather_output
    ]
    info = TensorParallelInfo(group, sp, styles, vocab[0] if vocab else None, algorithm)
    object.__setattr__(model, "plait_tensor_parallel", info)
    object.__setattr__(model, "plait_full_state_dict", lambda: full_state_dict(model))
    return model


# (layer type, parameter name) whose elements differ across the group's ranks
_SPLIT = {
    (ColumnParallelLinear, "weight"),
    (ColumnParallelLinear, "bias"),
    (RowParallelLinear, "weight"),
    (VocabParallelEmbedding, "weight"),
    (MultiQueryLinear, "weight"),
    (MultiQueryLinear, "bias"),
}


def _split_head_params(module: nn.Module, heads: AttentionHeads, group: Group) -> None:
    """This rank's entries of the attention's per-head parameters (``head_params``): a
    slice of dimension 0, noted on the module for :func:`full_state_dict`."""
    if not heads.head_params or hasattr(module, "plait_head_params"):
        return
    for name in heads.head_params:
        p = getattr(module, name, None)
        if not isinstance(p, nn.Parameter) or p.dim() < 1 or p.shape[0] != heads.heads:
            got = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            raise ValueError(
                f"attention {heads.modules!r}: head_params {name!r} must be a parameter with "
                f"one entry per query head ({heads.heads}) on dimension 0; got {got}"
            )
        part = heads.heads // group.size
        rows = slice(group.rank * part, (group.rank + 1) * part)
        setattr(module, name, nn.Parameter(p.detach()[rows].clone(), p.requires_grad))
    object.__setattr__(module, "plait_head_params", (heads.head_params, group))


def _place(model: nn.Module, group: Group) -> None:
    """Record every parameter's placement: slices of a split weight shard over ``group``,
    everything else (LayerNorms, row-parallel biases, whole key/value projections,
    modules the plan leaves alone) is a copy on every rank, replicated over it."""
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            split = any(isinstance(module, cls) and pname == n for cls, n in _SPLIT)
            split = split or pname in getattr(module, "plait_head_params", ((), None))[0]
            place(p, shard=(group,) if split else (), replicate=() if split else (group,))


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
    shards all-gathered over its group, in module order. Collective. A model also sharded
    by ``fully_shard`` (``strategy="cp"`` with tp and ``zero=3``) is first put together over
    its FSDP group (:func:`~plait.strategies.fsdp.full_state_dict`), its units gathered
    while the tp shards are, then freed again."""
    from plait.strategies.fsdp.module import FSDPModule  # deferred: fsdp is optional here

    if not isinstance(model, FSDPModule):
        return _gather_tp(model, model.state_dict())
    from plait.strategies.fsdp.state import (
        full_state_dict as fsdp_full_state_dict,
    )  # deferred: as above

    state = fsdp_full_state_dict(model)
    model.unshard()
    try:
        return _gather_tp(model, state)
    finally:
        model.reshard()


def _gather_tp(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for name, module in model.named_modules():
        names, group = getattr(module, "plait_head_params", ((), None))
        for pname in names:  # per-head parameters: every rank's heads, in rank order
            assert isinstance(group, Group)
            key = f"{name}.{pname}" if name else pname
            state[key] = M.all_gather_dim(getattr(module, pname).detach(), 0, group, "auto")
        if isinstance(module, PARALLEL_LAYERS):
            prefix = f"{name}." if name else ""
            for key, value in module.full_state().items():
                state[prefix + key] = value
            for key in getattr(module, "local_only", ()):
                state.pop(prefix + key, None)
    return state


def group_of_names(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, int]:
    """Parameter name (every name a shared parameter has) -> its optimizer group's index,
    read before the model is parallelized. Refuses an optimizer that has stepped (its
    state is per dense parameter) or that holds a tensor that is not the model's."""
    if optimizer.state:
        raise ValueError(
            "tensor parallelism re-creates the optimizer on the parameter shards: pass an "
            "optimizer that has not stepped yet (load its state after prepare)"
        )
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    out: dict[str, int] = {}
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"tensor parallelism: parameter group {i} of the optimizer holds a tensor "
                    f"of shape {tuple(p.shape)} that is not a parameter of the "
                    f"{type(model).__name__}; build the optimizer on model.parameters()"
                )
            for n in names[id(p)]:
                out[n] = i
    return out


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    groups: Mapping[str, int] | None = None,
) -> torch.optim.Optimizer:
    """The same optimizer class over the parallelized parameters: one group per original
    group, every group entry kept (per-group ``lr``, ``weight_decay``, ...), each new
    parameter in the group its dense parameter was in (``groups``: name -> group index,
    from :func:`group_of_names` before parallelizing; None: every parameter in the one
    group of ``optimizer``). Parameters the optimizer did not hold stay out of it."""
    if groups is None:
        if len(optimizer.param_groups) != 1:
            raise ValueError(
                "rebuild_optimizer: an optimizer with several parameter groups needs "
                "groups= (group_of_names(optimizer, model) before parallelizing)"
            )
        groups = {n: 0 for n, _ in model.named_parameters(remove_duplicate=False)}
    params: list[list[nn.Parameter]] = [[] for _ in optimizer.param_groups]
    for name, p in model.named_parameters():
        path, _, leaf = name.rpartition(".")
        # a parallel layer's own parameter stands for part of a dense one (its whole tail)
        owner = model.get_submodule(path) if path else model
        dense = getattr(owner, "dense_names", {}).get(leaf)
        key = name if dense is None else (f"{path}.{dense}" if path else dense)
        if key in groups:
            params[groups[key]].append(p)
    cls = type(optimizer)
    # the constructor takes only some of the defaults (AdamW: not decoupled_weight_decay);
    # every group keeps all its entries
    defaults = constructor_kwargs(cls, dict(optimizer.defaults))
    rebuilt = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": ps}
        for g, ps in zip(optimizer.param_groups, params, strict=True)
    ]
    return cls(rebuilt, **defaults)


def prepare_tp(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    mesh: Any,
    plan: TensorPlan | Mapping[str, str | Style] | None = None,
    sequence_parallel: bool = False,
    mode: str = "1d",
    algorithm: str = "auto",
    check: bool = True,
    check_finite: str | None = "raise",
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """``plait.prepare(model, optimizer, strategy="tp", mesh=..., plan=..., mode=...)``.

    ``plan``: the model's :class:`~plait.strategies.tensor.plan.TensorPlan` (``prepare``
    looks it up from the model's family with ``sequence_parallel``) or a mapping. The
    optimizer is rebuilt over the shards with its parameter groups and their
    hyper-parameters (:func:`rebuild_optimizer`). ``mode`` ``"2d"``, ``"2.5d"`` or ``"3d"``
    runs :func:`~plait.strategies.tensor.parallelize_nd.prepare_nd` on the mesh's ``row`` x
    ``col`` (x ``depth``) grid (``grid_mesh(mode, n)`` builds one). ``check``: the
    wrap-time agreement check of :func:`parallelize`. ``check_finite`` (1D): ``"raise"``
    (default), ``"skip"`` or None, what every rank does before ``optimizer.step()`` when a
    rank's gradient holds inf or NaN (:mod:`~plait.strategies.tensor.finite`: one
    all-reduce of ``t`` integers per step). Collective over the mesh.
    """
    if mode != "1d":
        if mode not in ND_KINDS:
            raise ValueError(f"strategy 'tp': mode={mode!r}; use '1d' or one of {ND_KINDS}")
        if sequence_parallel:
            raise ValueError(f"strategy 'tp': sequence_parallel is 1D only (mode {mode!r})")
        if isinstance(plan, TensorPlan):
            raise ValueError(f"strategy 'tp': mode {mode!r} takes a mapping plan, not a TensorPlan")
        return prepare_nd(model, optimizer, mesh=mesh, mode=mode, plan=plan, algorithm=algorithm)
    if plan is None:
        raise ValueError(
            f"strategy 'tp' needs plan= for a {type(model).__name__}: no plan is known for "
            f"its family. Pass a mapping of module paths to 'colwise' / 'rowwise' / 'vocab' "
            f"/ 'sequence', e.g. plan={{'layers.*.fc1': 'colwise', 'layers.*.fc2': "
            f"'rowwise'}}, or a plait.strategies.tensor.TensorPlan with the attention heads"
        )
    check_policy(check_finite)
    if sequence_parallel:
        raise ValueError(
            "strategy 'tp': with an explicit plan, mark sequence regions in it (a family's "
            "plan takes the option: plan_for(model, 'tp', sequence_parallel=True))"
        )
    groups = None if optimizer is None else group_of_names(optimizer, model)
    parallelize(model, mesh, plan, algorithm=algorithm, check=check)
    if optimizer is None:
        return model, None
    rebuilt = rebuild_optimizer(optimizer, model, groups)
    watch_finite(rebuilt, model, _group_of(mesh), check_finite)
    return model, rebuilt


def loss_fn(model: nn.Module) -> Any:
    """The loss for a parallelized model's logits: the vocab-parallel cross-entropy when
    its head is split by vocabulary, otherwise ``F.cross_entropy`` (flattened)."""

    if getattr(model, "plait_tensor_nd", None) is not None:
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
