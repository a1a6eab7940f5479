"""Refuse, before any group is used, a PTD-P layout the mesh and the model cannot build.

Every check names the constraint and what to change. :func:`check_layout` runs at
construction (mesh, the model's plans, schedule, ZeRO stage, MoE blocks against ``ep``,
the tensor-parallel mode and the sizes its plan splits); :func:`check_batch` at every step
(the global batch against ``dp * ep * microbatches`` and the sequence against ``tp`` under
sequence parallelism). Pure functions: testable without processes.

The model is known only through its plans (DESIGN decision 7): the pipeline plan (its
layers, their context, its loss) and the tensor-parallel plan (styles, attention heads),
asked of ``plans`` (:func:`plait.models.plans.plan_for`, which ``plait.prepare`` passes) or
of the model's own ``plait_plan`` (:func:`resolve_plans`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.mesh import Mesh
from plait.strategies.moe.layer import moe_layers
from plait.strategies.moe.stacked import containers as stacked_containers
from plait.strategies.pipeline.schedules import default_chunks

DIMS = ("pp", "dp", "tp")
OPTIONAL_DIMS = ("ep", "cp")  # expert parallelism (carved out of dp), context parallelism
ZERO_STAGES = (0, 1, 2)


@dataclass(frozen=True)
class Sizes:
    """The mesh's sizes and the step's options, as :func:`check_layout` saw them. ``ep``:
    the expert-parallel size (1 without an ``ep`` dimension); the batch is split over
    ``dp * ep`` replicas (:attr:`replicas`)."""

    pp: int
    dp: int
    tp: int
    microbatches: int
    zero: int
    sequence_parallel: bool
    ep: int = 1
    cp: int = 1

    @property
    def replicas(self) -> int:
        """How many slices the global batch is cut into: ``dp * ep``."""
        return self.dp * self.ep

    @property
    def averaged(self) -> int:
        """How many ranks average the dense gradients and the loss: ``dp * ep * cp`` (a cp
        rank holds other tokens of the same rows)."""
        return self.replicas * self.cp


def mesh_sizes(shape: dict[str, int]) -> tuple[int, int, int, int]:
    """``(pp, dp, tp, ep)`` of a mesh's ``shape`` (each 1 when absent: see
    :func:`complete_mesh`); every other dimension is refused."""
    extra = [d for d in shape if d not in DIMS + OPTIONAL_DIMS]
    if extra:
        raise ValueError(
            f"ptdp: the mesh has dimensions {list(shape)}; build it from pp=.., dp=.., "
            f"tp=.. (an absent one is size 1), plus ep=.. for MoE blocks and cp=.. for "
            f"context parallelism; {extra} are not composed here"
        )
    return shape.get("pp", 1), shape.get("dp", 1), shape.get("tp", 1), shape.get("ep", 1)


def complete_mesh(mesh: Any) -> Any:
    """``mesh`` with every dimension PTD-P reads: ``pp``, ``dp`` and ``tp`` that the user
    left out are added at size 1 (``Mesh(pp=2, tp=2)`` means ``dp=1``, as ``Mesh(tp=2)``
    means no data parallelism elsewhere). A mesh that has all three is returned as it is;
    otherwise a new :class:`~plait.mesh.Mesh` over the same ranks, with the same placement
    (a dimension of size 1 moves no rank), is built: collective, like every mesh, and its
    groups live until :func:`plait.shutdown` (or the rank pool's run) ends them."""
    shape = mesh.shape
    missing = [d for d in DIMS if d not in shape]
    if not missing or any(d not in DIMS + OPTIONAL_DIMS for d in shape):
        return mesh  # complete, or refused by name in mesh_sizes
    innermost_first = [*missing, *reversed(mesh.names)]
    return Mesh(
        ranks=list(mesh.layout.ranks),
        order=innermost_first,
        timeout=getattr(mesh, "_timeout", None),
        **shape,
        **{d: 1 for d in missing},
    )


def plan_source(model: nn.Module, plans: Callable[..., Any] | None) -> Callable[..., Any]:
    """``(kind, **options) -> plan or None`` for ``model``: ``plans(model, kind, **options)``
    when given (:func:`plait.models.plans.plan_for`, which ``plait.prepare`` passes), else
    the model's own ``plait_plan(kind, **options)`` (plait's GPT carries one), else none."""
    if plans is not None:
        return lambda kind, **options: plans(model, kind, **options)
    own = getattr(model, "plait_plan", None)
    if callable(own):
        return own  # type: ignore[no-any-return]
    return lambda kind, **options: None


def _no_plan(model: nn.Module, kind: str, why: str) -> ValueError:
    return ValueError(
        f"ptdp: no {kind} plan for a {type(model).__name__}: PTD-P cuts the model's layers "
        f"into pipeline stages by its pipeline plan and splits every stage by its "
        f"tensor-parallel plan ({why}). plait.models.GPT carries its own; for the families "
        f"plait.models.plans knows (Hugging Face Llama/Mistral/Qwen2/Qwen3, GPT-2) use "
        f"plait.prepare(model, opt, strategy='ptdp', mesh=...) or compose(model, opt, "
        f"mesh=..., plans=plait.models.plans.plan_for); for another model give it a method "
        f"plait_plan(kind, **options) returning a PipelinePlan for 'pipeline' and a "
        f"TensorPlan for 'tp' (see plait.strategies.pipeline.plan, "
        f"plait.strategies.tensor.plan)"
    )


def resolve_plans(
    model: nn.Module,
    *,
    plans: Callable[..., Any] | None,
    tp: int,
    sequence_parallel: bool,
    tp_plan: Any = None,
) -> tuple[Any, Any]:
    """``(tensor-parallel plan, pipeline plan)`` of ``model``: ``tp_plan`` if given (None
    when ``tp == 1``), the pipeline plan from :func:`plan_source`. A missing one is refused
    naming what to pass. The pipeline plan returned here holds the dense modules: ask again
    after the model is cut (``PTDP`` does)."""
    ask = plan_source(model, plans)
    pipeline = ask("pipeline")
    if pipeline is None:
        raise _no_plan(model, "pipeline", "every layout, pp=1 included, runs the pipeline")
    if tp > 1 and tp_plan is None:
        tp_plan = ask("tp", **({"sequence_parallel": True} if sequence_parallel else {}))
        if tp_plan is None:
            raise _no_plan(model, "tensor-parallel", f"tp={tp}")
    return tp_plan, pipeline


def plan_slices_sequence(plan: Any) -> bool:
    """Whether a tensor-parallel plan (a TensorPlan or a mapping) marks sequence regions."""
    styles = getattr(plan, "styles", plan)
    return any(getattr(v, "kind", v) in ("sequence", "scatter") for v in styles.values())


def check_layout(
    model: nn.Module,
    *,
    shape: dict[str, int],
    microbatches: int,
    zero: int,
    schedule: str,
    chunks: int | None,
    sequence_parallel: bool,
    custom_plan: bool,
    tp_mode: str = "1d",
    plans: Callable[..., Any] | None = None,
    tp_plan: Any = None,
    pipeline_plan: Any = None,
) -> Sizes:
    """Refuse what the mesh cannot build from ``model`` (see the module docstring). The
    model's plans come from ``tp_plan``/``pipeline_plan`` when given, else as
    :func:`resolve_plans` finds them (``plans``, or the model's own)."""
    pp, dp, tp, ep = mesh_sizes(shape)
    if tp_mode != "1d":
        raise ValueError(
            f"ptdp: tp_mode={tp_mode!r} is not composed with pipeline and data parallelism: "
            f"2D/2.5D/3D tensor parallelism needs a row x col (x depth) grid mesh and its "
            f"own layers' gradient and state rules, which PTD-P does not carry yet; use "
            f"tp_mode='1d' here, or strategy='tp' with mode={tp_mode!r} alone"
        )
    if pipeline_plan is None:
        tp_plan, pipeline_plan = resolve_plans(
            model, plans=plans, tp=tp, sequence_parallel=sequence_parallel, tp_plan=tp_plan
        )
    _check_moe(
        model,
        ep=ep,
        zero=zero,
        sequence_parallel=sequence_parallel,
        own=plan_source(model, plans)("moe") if ep > 1 and not moe_layers(model) else None,
    )
    if zero not in ZERO_STAGES:
        raise ValueError(f"ptdp: zero={zero!r}; use 0 (plain averaging over dp), 1 or 2")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"ptdp: microbatches={microbatches!r}; use a positive integer")
    if tp > 1:
        check_tensor_sizes(model, tp_plan, tp)
    if sequence_parallel and custom_plan and not plan_slices_sequence(tp_plan):
        raise ValueError("ptdp: with an explicit tp_plan, mark sequence regions in the plan")
    sliced = sequence_parallel or plan_slices_sequence(tp_plan or {})
    if sliced and tp > 1 and pp > 1 and pipeline_plan.context is not None:
        raise ValueError(
            f"ptdp: sequence parallelism with pp={pp}: the {pipeline_plan.name or 'model'}'s "
            f"pipeline plan rebuilds a per-stage context (rotary embeddings, the causal mask) "
            f"from each stage's input, which under sequence parallelism is this rank's 1/{tp} "
            f"of the sequence; use sequence_parallel=False, or pp=1"
        )
    layers = list(pipeline_plan.layers)
    v = chunks if chunks is not None else default_chunks(schedule)
    units = len(layers)  # what the pipeline can cut between (pipeline/split.py)
    if pp * v > units:
        raise ValueError(
            f"ptdp: pp={pp} ranks x {v} stage(s) each = {pp * v} pipeline stages, but the "
            f"{pipeline_plan.name or 'model'}'s pipeline plan has only {units} layers to cut "
            f"({layers[0].name}, ..., {layers[-1].name}); use pp * chunks <= {units} or more "
            f"layers"
        )
    if zero == 2 and (pp > 1 or microbatches > 1):
        raise ValueError(
            f"ptdp: zero=2 with pp={pp} and microbatches={microbatches} is not supported: "
            f"ZeRO-2 reduce-scatters the gradients inside every backward, and the pipeline "
            f"runs one backward per micro-batch, so it would send the gradients "
            f"{microbatches} times a step; use zero=1 (Megatron's distributed optimizer) "
            f"with pp > 1, or pp=1 and microbatches=1 for ZeRO-2"
        )
    shared = shared_between_layers(layers)
    if zero and pp > 1 and shared:
        raise ValueError(
            f"ptdp: zero={zero} with pp={pp} and a tied parameter ({shared}, held by layers "
            f"that may sit on two stages, such as a tied embedding and head): the pipeline "
            f"sums the tied gradient between the first and last stage after backward, which "
            f"ZeRO's gradient guards forbid; untie it (GPTConfig(tied=False), "
            f"tie_word_embeddings=False), use zero=0, or pp=1"
        )
    return Sizes(pp, dp, tp, microbatches, zero, sequence_parallel, ep, shape.get("cp", 1))


def shared_between_layers(layers: list[Any]) -> str | None:
    """The first parameter two pipeline layers share (a tied embedding and head), named as
    the first layer holds it, or None."""
    seen: dict[int, str] = {}
    for layer in layers:
        mine: dict[int, str] = {}
        for dotted, module in layer.modules:
            for n, p in module.named_parameters():
                mine.setdefault(id(p), f"{dotted}.{n}")
        for key, name in mine.items():
            if key in seen:
                return seen[key]
            seen[key] = name
    return None


def check_tensor_sizes(model: nn.Module, plan: Any, tp: int) -> None:
    """Refuse, before any group is used, a tensor-parallel size the plan's splits do not
    allow, naming the module: each :class:`~plait.strategies.tensor.plan.AttentionHeads`
    (query and key/value heads), every attention module under a plan entry that says its
    head count (``heads``/``num_heads``), and every column-parallel output / row-parallel
    input width (per part of a fused projection). The vocabulary is padded: any size fits."""
    styles = dict(getattr(plan, "styles", plan))
    names = [n for n, _ in model.named_modules() if n]
    kept_whole: set[str] = set()  # key/value projections with fewer heads than ranks
    for heads in getattr(plan, "attention", ()):
        try:
            local = heads.local(tp)
        except ValueError as exc:
            raise ValueError(f"ptdp: tp={tp}: {exc}") from exc
        if local["replicas"] > 1:
            hits = [n for n in names if fnmatch.fnmatchcase(n, heads.modules)]
            kept_whole |= {f"{n}.{child}" for n in hits for child in heads.key_value}
    resolved: dict[str, Any] = {}
    for pattern, style in styles.items():
        for n in names:
            if fnmatch.fnmatchcase(n, pattern):
                resolved[n] = style
    for name, module in model.named_modules():
        count = getattr(module, "heads", getattr(module, "num_heads", None))
        if (
            isinstance(count, int)
            and count % tp
            and any(r.startswith(f"{name}.") for r in resolved)
        ):
            raise ValueError(
                f"ptdp: tp={tp} does not divide the attention heads = {count} of module "
                f"{name!r}; choose a tensor-parallel size that divides {count}"
            )
    for name, style in resolved.items():
        kind = getattr(style, "kind", style)
        if kind not in ("colwise", "rowwise") or name in kept_whole:
            continue
        weight = getattr(model.get_submodule(name), "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue  # parallelize names what does not fit the style
        out_features, in_features = weight.shape
        if getattr(style, "transposed", False):  # stored [in, out] (GPT-2's Conv1D)
            out_features, in_features = in_features, out_features
        blocks = getattr(style, "blocks", 1)
        n, what = (
            (out_features // blocks, "outputs" + (f" per part (of {blocks})" if blocks > 1 else ""))
            if kind == "colwise"
            else (in_features, "inputs")
        )
        if n % tp:
            raise ValueError(
                f"ptdp: tp={tp} does not divide the {n} {what} of module {name!r} "
                f"({kind} in the tensor-parallel plan); choose a tensor-parallel size that "
                f"divides {n}"
            )


def _check_moe(
    model: nn.Module, *, ep: int, zero: int, sequence_parallel: bool, own: Any = None
) -> None:
    """The model's MoE blocks (:class:`plait.moe.MoE` layers, or the model's own sparse
    blocks its MoE plan ``own`` names) against the ``ep`` dimension (see :mod:`.experts`)."""
    layers = moe_layers(model)
    if not layers and ep > 1 and own is not None:
        _check_own_moe(model, own, ep=ep, zero=zero, sequence_parallel=sequence_parallel)
        return
    if not layers:
        if ep > 1:
            raise ValueError(
                f"ptdp: the mesh has ep={ep} but the {type(model).__name__} has no MoE "
                f"blocks PTD-P can split over ep: no plait.moe.MoE layers and no MoE plan "
                f"(plait.moe.MoEPlan) for its own sparse blocks; drop ep from the mesh, give "
                f"the model an MoE plan (plait_plan('moe')), or build plait's GPT with "
                f"GPTConfig(moe=MoEConfig(...))"
            )
        return
    bad = next((n for n, m in layers.items() if m.num_experts % ep), None)
    if bad is not None:
        num = layers[bad].num_experts
        raise ValueError(
            f"ptdp: ep={ep} does not divide the num_experts={num} of MoE block {bad!r}; "
            f"choose ep dividing {num}"
        )
    if sequence_parallel:
        raise ValueError(
            "ptdp: sequence parallelism with MoE blocks is not supported: the MoE would "
            "route each rank's slice of a sequence as its own group (other capacities than "
            "one process); use sequence_parallel=False"
        )
    if zero and ep > 1:
        raise ValueError(
            f"ptdp: zero={zero} with ep={ep}: ZeRO shards one gradient over the dp group, but "
            f"expert gradients average over dp and the others over dp x ep; use zero=0 with "
            f"expert parallelism, or ep=1"
        )
    for name, moe in layers.items():
        if moe.aux_loss != "gshard" and moe.aux_loss_weight:
            raise ValueError(
                f"ptdp: MoE block {name!r} has aux_loss={moe.aux_loss!r}, a statistic of the "
                f"whole batch: summed over micro-batches and replicas it is not one "
                f"process's loss; use aux_loss='gshard' (a mean over groups) or "
                f"aux_loss_weight=0"
            )
        if moe.bias_update_rate > 0:
            raise ValueError(
                f"ptdp: MoE block {name!r}: auxiliary-loss-free balancing (bias_update_rate "
                f"> 0) is not composed yet; use bias_update_rate=0 (the GShard auxiliary "
                f"loss balances)"
            )


def _check_own_moe(
    model: nn.Module, plan: Any, *, ep: int, zero: int, sequence_parallel: bool
) -> None:
    """The model's own stacked-expert blocks (an MoE plan, :mod:`plait.strategies.moe.stacked`)
    against ``ep``: containers found, ``ep`` dividing every expert count, no ZeRO and no
    sequence parallelism with them."""
    boxes = stacked_containers(model, plan)
    if not boxes:
        raise ValueError(
            f"ptdp: ep={ep}: the {type(model).__name__}'s MoE plan names expert containers "
            f"of class {' / '.join(plan.experts)}, and the model has none"
        )
    for name, box in boxes.items():
        num = getattr(box, plan.num_experts, None)
        if not isinstance(num, int) or num % ep:
            raise ValueError(
                f"ptdp: ep={ep} does not divide the {plan.num_experts}={num} of expert "
                f"container {name!r}; choose ep dividing it"
            )
    if sequence_parallel:
        raise ValueError(
            f"ptdp: sequence parallelism with experts split over ep={ep} is not composed: "
            f"each tensor-parallel rank would dispatch its slice of the sequence; use "
            f"sequence_parallel=False, or ep=1 (the sparse blocks then run whole per stage)"
        )
    if zero:
        raise ValueError(
            f"ptdp: zero={zero} with ep={ep}: ZeRO shards one gradient over the dp group, but "
            f"expert gradients average over dp and the others over dp x ep; use zero=0 with "
            f"expert parallelism, or ep=1"
        )


def check_batch(inputs: torch.Tensor, targets: torch.Tensor, sizes: Sizes) -> None:
    """Refuse a global batch the layout cannot split evenly."""
    if inputs.shape[:2] != targets.shape[:2]:
        raise ValueError(
            f"ptdp: inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} differ in "
            f"batch or sequence size"
        )
    b = inputs.shape[0]
    rows = sizes.replicas * sizes.microbatches
    if b % rows:
        who = f"dp={sizes.dp}" + (f" x ep={sizes.ep}" if sizes.ep > 1 else "")
        raise ValueError(
            f"ptdp: a global batch of {b} does not split into {who} replicas x "
            f"microbatches={sizes.microbatches} equal micro-batches; use a batch that is a "
            f"multiple of {rows}"
        )
    if sizes.sequence_parallel and inputs.shape[1] % sizes.tp:
        raise ValueError(
            f"ptdp: sequence parallelism over tp={sizes.tp} needs a sequence length that is a "
            f"multiple of {sizes.tp}; got {inputs.shape[1]}"
        )
