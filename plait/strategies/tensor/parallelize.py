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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.comm.group import Group
from plait.renames import accepts_model
from plait.strategies.data_parallel.grad_sync import check_policy
from plait.strategies.tensor.agreement import check_agreement
from plait.strategies.tensor.checks import check_dropout, check_heads, computes_linear
from plait.strategies.tensor.convert import convert, set_submodule
from plait.strategies.tensor.cross_entropy import vocab_parallel_cross_entropy
from plait.strategies.tensor.finite import watch_finite
from plait.strategies.tensor.layers import ColumnParallelLinear
from plait.strategies.tensor.optimizer import group_of_names, rebuild_optimizer
from plait.strategies.tensor.parallelize_nd import loss_fn as loss_fn_nd
from plait.strategies.tensor.parallelize_nd import parallelize_nd, prepare_nd
from plait.strategies.tensor.plan import TensorPlan, as_plan
from plait.strategies.tensor.shards import (
    PARALLEL_LAYERS,
    full_state_dict,
    place_parameters,
    retie,
    split_head_params,
)
from plait.strategies.tensor.style import (
    HOOKS,
    KINDS,
    ND_KINDS,
    Style,
    resolve_attention,
    resolve_styles,
)


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
    styles = resolve_styles(model, tplan.styles)
    sp = any(s.kind in ("sequence", "scatter") for s in styles.values())
    check_heads(model, styles, group.size)
    keep_whole, counted = resolve_attention(model, tplan, styles, group.size)
    check_dropout(model)
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
            new = convert(
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
            set_submodule(model, name, new)
            replaced[name] = new
    retie(modules, replaced, owners)
    for module, local, heads in counted:
        for attr, what in heads.attributes.items():
            if hasattr(module, attr):
                setattr(module, attr, local[what])
        split_head_params(module, heads, group)
    place_parameters(model, group)
    vocab = [
        m.out_features
        for n, m in replaced.items()
        if styles[n].kind == "vocab" and isinstance(m, ColumnParallelLinear) and not m.gather_output
    ]
    info = TensorParallelInfo(group, sp, styles, vocab[0] if vocab else None, algorithm)
    object.__setattr__(model, "plait_tensor_parallel", info)
    object.__setattr__(model, "plait_full_state_dict", lambda: full_state_dict(model))
    return model


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


# what this module's callers import from it; each lives in the module named above
__all__ = [
    "HOOKS",
    "KINDS",
    "ND_KINDS",
    "PARALLEL_LAYERS",
    "Style",
    "TensorParallelInfo",
    "computes_linear",
    "full_state_dict",
    "group_of_names",
    "loss_fn",
    "parallelize",
    "prepare_tp",
    "rebuild_optimizer",
]
