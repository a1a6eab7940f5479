"""One entry point for every strategy: ``model, optimizer = plait.prepare(...)``.

The returned model and optimizer are used by a plain PyTorch training loop as they are
(``loss = loss_fn(model(x), y); loss.backward(); optimizer.step()``); both are still
``nn.Module`` and ``torch.optim.Optimizer`` instances, so learning-rate schedulers keep
working. With a ``tracer``, optimizer steps are recorded as ``optimizer`` spans.

Strategies: ``"ddp"`` (:class:`~plait.strategies.DistributedDataParallel`), ``"naive"``
(:class:`~plait.strategies.NaiveDataParallel`), ``"zero1"``/``"zero2"``
(:class:`~plait.strategies.zero.ZeroOptimizer`), ``"zero3"``/``"fsdp"``
(:func:`~plait.strategies.fsdp.fully_shard`), ``"ps"``
(:class:`~plait.strategies.ps.ParameterServer`: on server ranks ``prepare`` serves until
the workers finish and returns ``(model, None)``; workers call ``optimizer.finish()``
after their last step), ``"tp"`` (:func:`~plait.strategies.tensor.parallelize` with
``mesh=`` and ``plan=``, by default the plan of the model's family from
:func:`plait.models.plans.plan_for` (plait's GPT, Hugging Face Llama / Mistral / Qwen2 /
Qwen3 / GPT-2, torchtitan's Llama 3), ``sequence_parallel=``, ``check_finite=``; a new
optimizer over the shards with the same parameter groups), ``"ep"``
(:func:`~plait.strategies.moe.prepare_ep` with ``mesh=Mesh(ep=..., dp=...)``: each rank keeps
its experts, plait's own MoE layers or the model's own blocks through its family's MoE plan
(Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE) or ``plan=``; a new optimizer over what it
keeps, one group per original group), ``"pipeline"``
(:class:`~plait.strategies.pipeline.PipelineParallel` on ``mesh.group("pp")`` with
``schedule=`` and ``microbatches=``; call ``model.step(x, y)``; a new optimizer over this
rank's stages), ``"ptdp"`` (:func:`~plait.strategies.compose.compose`: tensor, pipeline and
data parallelism (plain or ZeRO-1/2 over ``dp``) on ``mesh=Mesh(pp=..., dp=..., tp=...)``,
with the pipeline and tensor-parallel plans of the model's family (``plans=plan_for``);
returns the :class:`~plait.strategies.compose.PTDP` object, trained with ``.step(x, y)``, and
its optimizer with the same parameter groups), ``"cp"``
(:func:`~plait.strategies.context.recipe.prepare_cp`: context parallelism on
``mesh=Mesh(cp=...[, dp=...][, tp=...])`` with ``context="ring"|"ulysses"`` and ``zero=0|1|2|3``
(gradients all-reduced, or ZeRO-1/2 / FSDP over cp x dp); each rank feeds its
chunk of the sequence from ``shard_sequence``), ``"none"`` (single process, unchanged).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, overload

import torch
from torch import nn

from plait import precision
from plait.mesh import data_parallel_group
from plait.models.gpt import GPT
from plait.models.plans import plan_for
from plait.strategies import DistributedDataParallel, NaiveDataParallel
from plait.strategies.compose import prepare_ptdp
from plait.strategies.context.recipe import prepare_cp
from plait.strategies.fsdp.prepare import prepare_fsdp
from plait.strategies.moe import moe_layers, prepare_ep
from plait.strategies.moe.stacked import gather_router_logits
from plait.strategies.pipeline import prepare_pipeline
from plait.strategies.ps import ParameterServer
from plait.strategies.reproducible.runner import REFUSED as REPRODUCIBLE_REFUSED
from plait.strategies.reproducible.runner import SUPPORTED as REPRODUCIBLE
from plait.strategies.reproducible.runner import ReproducibleRunner
from plait.strategies.tensor import prepare_tp as _prepare_tp
from plait.strategies.whole_matrix import is_whole_matrix, prepare_optimizers
from plait.strategies.whole_matrix.kinds import is_refused
from plait.strategies.zero import prepare_zero
from plait.trace import Tracer

_NAIVE_OPTIONS = {"group", "algorithm", "tracer", "check_finite"}
Optimizer = torch.optim.Optimizer
Prepared = tuple[nn.Module, Optimizer | None]


def _none(model: nn.Module, optimizer: Optimizer | None, **options: Any) -> Prepared:
    if options:
        raise TypeError(f"strategy 'none' takes no options, got {sorted(options)}")
    return model, optimizer


def _naive(model: nn.Module, optimizer: Optimizer | None, **options: Any) -> Prepared:
    unknown = set(options) - _NAIVE_OPTIONS
    if unknown:
        raise TypeError(
            f"strategy 'naive' does not take {sorted(unknown)}; its options are "
            f"{sorted(_NAIVE_OPTIONS)}"
        )
    return NaiveDataParallel(model, **options), optimizer


def _ddp(model: nn.Module, optimizer: Optimizer | None, **options: Any) -> Prepared:
    return DistributedDataParallel(model, **options), optimizer


def _zero(stage: int) -> Callable[..., Prepared]:
    def wrap(model: nn.Module, optimizer: Optimizer | None, **options: Any) -> Prepared:
        if optimizer is None:
            raise ValueError(
                f"strategy 'zero{stage}' shards the optimizer: pass the optimizer built on "
                f"model.parameters() to plait.prepare"
            )
        return prepare_zero(model, optimizer, stage=stage, **options)

    return wrap


def _fsdp(name: str) -> Callable[..., Prepared]:
    def wrap(model: nn.Module, optimizer: Optimizer | None, **options: Any) -> Prepared:
        return prepare_fsdp(model, optimizer, strategy=name, **options)

    return wrap


def _tp(model: nn.Module, optimizer: Optimizer | None, **options: Any) -> Prepared:
    """Tensor parallelism with the plan of the model's family when none is given. Under
    sequence parallelism, a model whose family has an MoE plan with routers (Mixtral,
    Qwen-MoE: each rank routes its slice of the sequence) gets its router logits gathered
    over the group for its auxiliary loss (:func:`gather_router_logits`)."""
    if options.get("plan") is None:
        mode = options.get("mode", "1d")
        extra: dict[str, Any] = {"mode": mode} if mode != "1d" else {}
        if mode == "1d" and options.pop("sequence_parallel", False):
            extra["sequence_parallel"] = True
        shape = getattr(options.get("mesh"), "shape", {})
        if isinstance(shape, dict) and shape.get("tp", 1) > 1:
            extra["tp"] = shape["tp"]  # an inferred plan is proven at this size
        options["plan"] = plan_for(model, "tp", **extra)
    elif options.get("sequence_parallel"):
        raise ValueError("strategy 'tp': with an explicit plan, mark sequence regions in it")
    prepared, optimizer = _prepare_tp(model, optimizer, **options)
    info = getattr(prepared, "plait_tensor_parallel", None)
    if info is not None and info.sequence_parallel and not moe_layers(prepared):
        moe = plan_for(prepared, "moe")
        if moe is not None:
            gather_router_logits(
                prepared, moe, group=info.group, algorithm=info.algorithm, replicated_loss=True
            )
    return prepared, optimizer


def _ep(model: nn.Module, optimizer: Optimizer | None, **options: Any) -> Prepared:
    """Expert parallelism: plait's own MoE layers need no plan; a model with its own MoE
    blocks (Mixtral, Qwen-MoE) gets its family's MoE-block plan unless ``plan=`` is given."""
    if "plan" not in options and not moe_layers(model):
        plan = plan_for(model, "moe")
        if plan is None:
            raise ValueError(
                f"strategy 'ep': {type(model).__name__} has no plait.moe.MoE layer and no "
                f"known MoE plan; pass plan=plait.moe.MoEPlan(experts=('MyExperts',), "
                f"stacked=('w1', 'w2'), run_expert=lambda box, e, x: ..., routers=...) "
                f"describing its sparse blocks"
            )
        options["plan"] = plan
    return prepare_ep(model, optimizer, **options)


def _pipeline(model: Any, optimizer: Optimizer | None, **options: Any) -> Prepared:
    """The model's pipeline plan (its family's, from :func:`plait.models.plans.plan_for`)
    unless ``plan=`` is given; an ``nn.Sequential`` or a list of stages needs none."""
    if "plan" not in options and isinstance(model, nn.Module):
        plan = plan_for(model, "pipeline")
        if plan is not None:
            options["plan"] = plan
    return prepare_pipeline(model, optimizer, **options)


def _ptdp(model: nn.Module, optimizer: Optimizer | None, **options: Any) -> tuple[Any, Optimizer]:
    """PTD-P with the plans of the model's family (:func:`plait.models.plans.plan_for`:
    its tensor-parallel and pipeline plans) unless ``plans=`` is given."""
    options.setdefault("plans", plan_for)
    shape = getattr(options.get("mesh"), "shape", {})
    if isinstance(shape, dict) and shape.get("cp", 1) > 1 and "positions" not in options:
        where = options["plans"](model, "context")  # plait's GPT: its module "pos"
        if where is not None:
            options["positions"] = where
    return prepare_ptdp(model, optimizer, **options)


def _ps(model: nn.Module, optimizer: Optimizer | None, **options: Any) -> Prepared:
    if optimizer is None:
        raise ValueError(
            "strategy 'ps' runs the optimizer on the servers: pass the optimizer built on "
            "model.parameters() to plait.prepare"
        )
    ps = ParameterServer(**options)
    wrapped, worker_optimizer = ps.wrap(model, optimizer)
    object.__setattr__(wrapped, "_plait_ps", ps)  # read back by plait.strategies.ps.ps_of
    return wrapped, worker_optimizer


def _blocks(model: nn.Module) -> set[type[nn.Module]] | None:
    """The FSDP units of a model whose family plait knows: plait's GPT's blocks, a Hugging
    Face model's decoder layers (the classes its ``_no_split_modules`` names); None (the
    root only) otherwise."""
    if isinstance(model, GPT):
        return {type(model.blocks[0])}
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    return found or None


def _cp(model: nn.Module, optimizer: Optimizer | None, **options: Any) -> Prepared:
    """Context parallelism; ``positions=`` from the model's context plan (plait's GPT: its
    module ``"pos"``; torchtitan's Llama: its rotary table ``"freqs_cis"``), a tp dimension
    the tp plan of the model's family, ``zero=3`` the model's blocks as FSDP units
    (:func:`_blocks`) unless ``wrap=`` is given."""
    if "positions" not in options:
        where = plan_for(model, "context")
        if where is not None:
            options["positions"] = where
    if options.get("zero") == 3 and options.get("wrap") is None:
        options["wrap"] = _blocks(model)
    shape = getattr(options.get("mesh"), "shape", {})
    if isinstance(shape, dict) and shape.get("tp", 1) > 1 and options.get("plan") is None:
        extra = {"sequence_parallel": True} if options.pop("sequence_parallel", False) else {}
        options["plan"] = plan_for(model, "tp", **extra)  # cp x tp: the family's tp plan
    if "moe_plan" not in options and not moe_layers(model):
        options["moe_plan"] = plan_for(model, "moe")  # routers whose logits the aux loss reads
    return prepare_cp(model, optimizer, **options)


# name -> (model, optimizer, **options) -> (model, optimizer); the optimizer may be replaced
# ("ptdp" returns a PTDP object, trained with .step(x, y), not an nn.Module)
STRATEGIES: dict[str, Callable[..., tuple[Any, Optimizer | None]]] = {
    "none": _none,
    "naive": _naive,
    "ddp": _ddp,
    "zero1": _zero(1),
    "zero2": _zero(2),
    "zero3": _fsdp("zero3"),
    "fsdp": _fsdp("fsdp"),
    "ps": _ps,
    "tp": _tp,
    "ep": _ep,
    "pipeline": _pipeline,
    "ptdp": _ptdp,
    "cp": _cp,
}


# PyTorch's spellings, accepted as they are (a user of DDP, FSDP2 or torch pipelining types them)
PYTORCH_NAMES = {
    "process_group": "mesh",
    "device_mesh": "mesh",
    "bucket_cap_mb": "bucket_mb",
    "n_microbatches": "microbatches",
    "mp_policy": "mixed_precision",
}
# plait's earlier names: still accepted for one release, with a DeprecationWarning
OLD_NAMES = {"group": "mesh", "tp_plan": "plan", "tp_mode": "mode"}
# strategies that run on one group of ranks (they take the group as ``group=``)
_ONE_GROUP = ("naive", "ddp", "zero1", "zero2", "zero3", "fsdp", "ps")


def vocabulary(strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` in plait's one vocabulary, then in the names ``strategy`` takes.

    One name per idea across strategies: where it runs is ``mesh=`` (a :class:`~plait.Mesh`
    or a group; a data-parallel strategy takes the mesh's only dimension, or its ``dp``), the
    tensor-parallel plan ``plan=``, its mode ``mode=``, the micro-batch count
    ``microbatches=``, the bucket size ``bucket_mb=``. PyTorch's spellings
    (:data:`PYTORCH_NAMES`) are accepted as aliases; plait's earlier names
    (:data:`OLD_NAMES`) too, with a ``DeprecationWarning`` naming the new one. Giving one
    idea twice under two names is refused.
    """
    out: dict[str, Any] = {}
    source: dict[str, str] = {}
    for key, value in options.items():
        name = PYTORCH_NAMES.get(key) or OLD_NAMES.get(key) or key
        if key in OLD_NAMES:
            warnings.warn(
                f"plait.prepare: {key}= is deprecated; use {name}=",
                DeprecationWarning,
                stacklevel=3,
            )
        if name in out:
            raise TypeError(
                f"plait.prepare(strategy={strategy!r}): {source[name]}= and {key}= name the "
                f"same setting ({name}); pass one"
            )
        out[name], source[name] = value, key
    if "mesh" in out and strategy in _ONE_GROUP:
        out["group"] = data_parallel_group(out.pop("mesh"), who=f"strategy {strategy!r}")
    if strategy == "ptdp":
        for new, theirs in (("plan", "tp_plan"), ("mode", "tp_mode")):
            if new in out:
                out[theirs] = out.pop(new)
    return out


@overload
def prepare(
    module: nn.Module | None = None,
    optimizer: Optimizer | None = None,
    *,
    strategy: str = "ddp",
    tracer: Tracer | None = None,
    model: nn.Module | None = None,
    whole_matrix: list[Optimizer] | tuple[Optimizer, ...] = (),
    **options: Any,
) -> Prepared: ...


@overload
def prepare(
    module: nn.Module | None = None,
    optimizer: list[Optimizer] | tuple[Optimizer, ...] = ...,
    *,
    strategy: str = "ddp",
    tracer: Tracer | None = None,
    model: nn.Module | None = None,
    whole_matrix: list[Optimizer] | tuple[Optimizer, ...] = (),
    **options: Any,
) -> tuple[Any, list[Optimizer]]: ...


def prepare(
    module: nn.Module | None = None,
    optimizer: Optimizer | list[Optimizer] | tuple[Optimizer, ...] | None = None,
    *,
    strategy: str = "ddp",
    tracer: Tracer | None = None,
    model: nn.Module | None = None,
    whole_matrix: list[Optimizer] | tuple[Optimizer, ...] = (),
    **options: Any,
) -> Any:
    """Wrap ``model`` (and ``optimizer``) for ``strategy``; return both.

    ``options`` go to the strategy (for ``"ddp"``: ``group`` (or ``process_group``),
    ``bucket_mb``, ``algorithm``, ``broadcast_buffers``, ``find_unused_parameters``,
    ``gradient_as_bucket_view``, ``check_finite``, ``device_ids``, ``output_device``; for
    ``"naive"``: ``group``, ``algorithm``, ``check_finite``; for ``"zero1"``/``"zero2"``:
    ``group``, ``algorithm``, ``bucket_mb``; for ``"zero3"``/``"fsdp"``: the options of
    :func:`~plait.strategies.fsdp.fully_shard`; for ``"ps"``: those of
    :class:`~plait.strategies.ps.ParameterServer`). Create the optimizer on
    ``model.parameters()`` before calling. Data-parallel strategies return the caller's
    optimizer itself; ZeRO-1/2 return a :class:`~plait.strategies.zero.ZeroOptimizer` built
    from its class and hyper-parameters (and state, if any); ZeRO-3/FSDP return a new
    optimizer of the same class over the parameter shards, one group per original group
    with all its entries (each unit gets one flat shard per group, so per-group
    hyper-parameters apply exactly; any ``torch.optim`` optimizer).

    What comes back, by one rule: ``(runner, optimizer)``. The runner is the module itself
    (changed in place by tp and ep, wrapped by ddp, naive, fsdp and ps: call it as before,
    its forward is the model's own) for every strategy whose training loop is
    ``loss = f(model(x)); loss.backward(); optimizer.step()``; for ``"pipeline"`` and
    ``"ptdp"``, whose forward and backward interleave across ranks, it is an object
    trained with ``runner.step(x, y)``. The optimizer is the caller's, or the same class
    with the same per-group hyper-parameters over what this rank keeps.

    ``reproducible=True`` (off by default): bitwise the same parameters for every
    data-parallel world size, all-reduce algorithm, transport and pipeline depth
    (:mod:`plait.strategies.reproducible`). For ``"none"``, ``"ddp"``, ``"zero1"``,
    ``"zero2"``, ``"zero3"``/``"fsdp"`` it needs ``microbatch_size=`` and ``loss_fn=``
    (the mean over a micro-batch) and returns a
    :class:`~plait.strategies.reproducible.runner.ReproducibleRunner`, trained with
    ``loss = runner.step(x, y); optimizer.step()`` on this rank's contiguous block of the
    global batch (``runner.block(x)``); ``"pipeline"`` keeps its ``step`` and sums its
    ``microbatches`` (a power of two) on the same tree; ``threads=`` (default 1) pins the
    intra-op threads. ``"ptdp"`` keeps its ``step`` too, for dp x pp with tp=1 (its
    refusals: :mod:`plait.strategies.compose.reproducible`). Strategies that split a
    matmul's reduction (tp, ep, cp) and ps, naive are refused by name.

    ``mixed_precision=`` (alias ``mp_policy=``): ``"bf16"``, ``"fp16"`` or a
    :class:`~plait.precision.MixedPrecisionPolicy`, the same for every strategy but
    ``"ps"`` (:mod:`plait.precision`: float32 masters, the forward under autocast,
    gradients reduced in ``reduce_dtype``, float32 by default; under fp16 the optimizer's
    :func:`~plait.precision.loss_scaler`).

    Keywords follow one vocabulary (:func:`vocabulary`): ``mesh=`` for where every strategy
    runs, ``plan=``, ``mode=``, ``microbatches=``, ``bucket_mb=``; PyTorch's spellings
    (``process_group``, ``device_mesh``, ``bucket_cap_mb``, ``n_microbatches``) are
    accepted. ``model=`` is the deprecated name of ``module``.

    Several optimizers (``prepare(model, [muon, adamw], ...)``, each over its own
    parameters) come back as a list in the same order, each over what this rank keeps.
    Whole-matrix optimizers (torch's ``Muon`` and ``Adafactor``, and any named in
    ``whole_matrix=[...]`` or whose class sets ``plait_whole_matrix = True``) are stepped
    on whole parameters under every sharded layout, by parameter ownership
    (:mod:`plait.strategies.whole_matrix`, docs/optimizers.md); ``LBFGS`` is refused by
    name under every strategy but none/naive/ddp.
    """
    if model is not None:
        if module is not None:
            raise TypeError("plait.prepare: pass the module once (module=, not model= too)")
        warnings.warn(
            "plait.prepare: model= is deprecated; pass the module first (or module=)",
            DeprecationWarning,
            stacklevel=2,
        )
        module = model
    if module is None:
        raise TypeError("plait.prepare: the module to prepare is missing")
    model = module
    options = vocabulary(strategy, options)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {sorted(STRATEGIES)}")
    traced = ("ddp", "naive", "zero1", "zero2", "zero3", "fsdp", "ps", "pipeline")
    if strategy in traced and tracer is not None:
        options["tracer"] = tracer
    reproducible = options.pop("reproducible", False)
    policy = _mixed_precision(strategy, model, options, reproducible=reproducible)
    if reproducible and (isinstance(optimizer, (list, tuple)) or whole_matrix):
        raise ValueError(
            f"plait.prepare(strategy={strategy!r}, reproducible=True) takes one element-wise "
            f"optimizer; several or whole-matrix optimizers are not supported in that mode yet"
        )
    if reproducible:
        assert not isinstance(optimizer, (list, tuple))
        wrapped, optimizer = _reproducible(strategy, model, optimizer, options, policy)
        if optimizer is not None and tracer is not None:
            _trace_steps(optimizer, tracer)
        return wrapped, optimizer
    for key in ("microbatch_size", "threads"):
        if key in options:
            raise TypeError(
                f"plait.prepare(strategy={strategy!r}): {key}= is an option of "
                f"reproducible=True; pass reproducible=True too"
            )
    several = isinstance(optimizer, (list, tuple))
    if (
        several
        or whole_matrix
        or (
            optimizer is not None
            and not several
            and (is_whole_matrix(optimizer) or is_refused(optimizer))  # type: ignore[arg-type]
            and strategy not in ("none", "naive", "ddp")
        )
    ):
        return _optimizers(strategy, model, optimizer, options, whole_matrix, policy, tracer)
    try:
        wrapped, optimizer = STRATEGIES[strategy](model, optimizer, **options)
    except TypeError as exc:
        text = str(exc)
        if any(k in text for k in ("unexpected keyword", "takes no", "does not take")):
            raise TypeError(f"plait.prepare(strategy={strategy!r}): {exc}") from exc
        raise
    if policy is not None:
        precision.apply(strategy, wrapped, optimizer, policy, options)
    if optimizer is not None and tracer is not None:
        _trace_steps(optimizer, tracer)
    return wrapped, optimizer


def _optimizers(
    strategy: str,
    model: nn.Module,
    given: Any,
    options: dict[str, Any],
    declared: Any,
    policy: precision.MixedPrecisionPolicy | None,
    tracer: Tracer | None,
) -> Any:
    """Several optimizers, or whole-matrix ones (:func:`prepare_optimizers`): the same
    return shape as given (a list, or one optimizer)."""
    several = isinstance(given, (list, tuple))
    optimizers = list(given) if several else [given]
    if any(o is None for o in optimizers) or not optimizers:
        raise TypeError("plait.prepare: the list of optimizers is empty or holds None")
    if policy is not None and policy.param_dtype == torch.float16:
        raise ValueError(
            f"plait.prepare(strategy={strategy!r}): mixed_precision= in fp16 with several "
            f"or whole-matrix optimizers is not supported yet (its loss scaler skips the "
            f"steps of one optimizer); use bf16"
        )
    wrapped, out = prepare_optimizers(
        strategy, STRATEGIES[strategy], model, optimizers, options, declared=list(declared)
    )
    if policy is not None:  # bf16: autocast on the forward; masters and state float32
        precision.apply(strategy, wrapped, None, policy, options)
    if tracer is not None:
        for o in out:
            _trace_steps(o, tracer)
    return wrapped, (out if several else out[0])


def _mixed_precision(
    strategy: str, model: nn.Module, options: dict[str, Any], *, reproducible: bool
) -> precision.MixedPrecisionPolicy | None:
    """The ``mixed_precision=`` policy (:mod:`plait.precision`), checked against the
    strategy and the model, its strategy options set; None for full precision."""
    policy = precision.resolve_mixed_precision(options.pop("mixed_precision", None))
    if policy.is_full:
        return None
    if reproducible and policy.param_dtype == torch.float16:
        raise ValueError(
            f"plait.prepare(strategy={strategy!r}, reproducible=True): fp16 needs a loss "
            f"scaler, which the reproducible step does not apply; use bf16"
        )
    precision.check(strategy, policy, model)
    precision.options_for(strategy, policy, options)
    return policy


def _reproducible(
    strategy: str,
    model: nn.Module,
    optimizer: Optimizer | None,
    options: dict[str, Any],
    policy: precision.MixedPrecisionPolicy | None,
) -> tuple[Any, Optimizer | None]:
    """``reproducible=True``: the strategy as usual, driven by a
    :class:`~plait.strategies.reproducible.runner.ReproducibleRunner` (data-parallel
    strategies) or with its accumulation on the fixed tree (pipeline); ``policy`` applied
    to what the strategy returned, inside the runner."""
    if strategy in REPRODUCIBLE_REFUSED:
        raise ValueError(
            f"plait.prepare(strategy={strategy!r}, reproducible=True) is refused: "
            f"{REPRODUCIBLE_REFUSED[strategy]}. The mode supports {list(REPRODUCIBLE)}"
        )
    if strategy in ("pipeline", "ptdp"):  # each keeps its step(x, y); ptdp with tp=1 only
        runs, optimizer = STRATEGIES[strategy](model, optimizer, reproducible=True, **options)
        if policy is not None:
            precision.apply(strategy, runs, optimizer, policy, options)
        return runs, optimizer
    mode = {k: options.pop(k) for k in ("microbatch_size", "loss_fn", "threads") if k in options}
    missing = [k for k in ("microbatch_size", "loss_fn") if k not in mode]
    if missing:
        raise TypeError(
            f"plait.prepare(strategy={strategy!r}, reproducible=True) needs "
            f"{' and '.join(k + '=' for k in missing)}: the fixed micro-batch size and the "
            f"loss (mean over a micro-batch) the runner's step(x, y) computes"
        )
    if strategy != "none":
        options["reproducible"] = True
        if "threads" in mode:
            options["threads"] = mode["threads"]
    wrapped, optimizer = STRATEGIES[strategy](model, optimizer, **options)
    if policy is not None:
        precision.apply(strategy, wrapped, optimizer, policy, options)
    runner = ReproducibleRunner(wrapped, optimizer, **mode)
    return runner, optimizer


def _trace_steps(optimizer: torch.optim.Optimizer, tracer: Tracer) -> None:
    tokens: list[int] = []

    def before(opt: Any, args: Any, kwargs: Any) -> None:
        tokens.append(tracer.begin("optimizer", stream="compute"))

    def after(opt: Any, args: Any, kwargs: Any) -> None:
        tracer.end(tokens.pop())

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)
