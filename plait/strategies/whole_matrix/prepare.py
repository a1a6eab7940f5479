"""``plait.prepare(model, [muon, adamw], strategy=...)``: several optimizers, some of them
whole-matrix, under one strategy; each comes back over what this rank keeps.

Per strategy:

- ``none``, ``naive``, ``ddp``, ``cp`` with ``zero=0`` (no ``tp`` dimension): every rank
  keeps every parameter whole and its gradient is averaged by the strategy, so the
  optimizers come back as given.
- ``zero1``, ``zero2``: each element-wise optimizer becomes its own
  :class:`~plait.strategies.zero.ZeroOptimizer`; a whole-matrix one is stepped by
  parameter ownership (:class:`~plait.strategies.whole_matrix.owners.ReplicatedSlot`).
- ``zero3``, ``fsdp`` (with or without ``offload``): one :func:`fully_shard` over the
  parameter groups of all the optimizers (each group its own flat shards); an
  element-wise optimizer is rebuilt over its shards, a whole-matrix one is stepped by
  ownership (:class:`~plait.strategies.whole_matrix.owners.FlatSlot`).
- ``pipeline``, ``ep``: each optimizer is rebuilt over this rank's stages or experts, as a
  single one is (whole parameters, gradients averaged by the strategy: exact as it is).
- ``tp`` (1D, with or without sequence parallelism): each optimizer is rebuilt over the
  parallelized parameters; a whole-matrix one is stepped by ownership over the
  tensor-parallel group on the full matrices
  (:class:`~plait.strategies.whole_matrix.owners.SlicedSlot`).

- ``cp`` with ``zero=1`` or ``2`` (no ``tp`` dimension): the recipe's ZeroOptimizer for the
  first element-wise optimizer, the others as under ``zero1``/``zero2`` on the same
  gradient group (cp x dp).
- ``ptdp`` with one whole-matrix optimizer, ``tp=1`` and ``zero=0``: whole parameters on
  every rank, so it runs as it is; with one element-wise optimizer, PTD-P's own.
- ``ptdp`` otherwise (several optimizers, or a whole-matrix one with ``tp`` > 1 or
  ZeRO over dp): PTD-P on a carrier optimizer, each optimizer re-created over this rank's
  pieces, whole-matrix ones stepped by ownership over tp, and every one by ownership over
  dp under ZeRO (:mod:`~plait.strategies.whole_matrix.ptdp`).

Refused, by name: a whole-matrix optimizer under ``ps``; under ``ptdp`` with a loss
scaler, ``reproducible=True`` or ``check_finite="skip"``; under ``cp`` with ``zero=3``, a
``tp`` dimension or only whole-matrix optimizers; under tp modes other than ``"1d"``.
Several optimizers under ``ps``; ``torch.optim.LBFGS`` under every strategy but
none/naive/ddp.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from plait import comm
from plait.strategies.consistency import verify_same_parameters
from plait.strategies.context.recipe import gradient_group
from plait.strategies.data_parallel.ddp import broadcast_tensors
from plait.strategies.fsdp.prepare import rebuilt_optimizer
from plait.strategies.fsdp.state import shard_param_groups
from plait.strategies.fsdp.unit import NAMES_ATTR
from plait.strategies.fsdp.wrap import fully_shard
from plait.strategies.tensor.parallelize import group_of_names, rebuild_optimizer
from plait.strategies.whole_matrix.kinds import check_declared, check_not_refused, is_whole_matrix
from plait.strategies.whole_matrix.owners import FlatSlot, ReplicatedSlot, Slot, own
from plait.strategies.whole_matrix.ptdp import prepare_ptdp_optimizers
from plait.strategies.whole_matrix.tensor import tensor_slots
from plait.strategies.zero import prepare_zero

Optimizer = torch.optim.Optimizer
REPLICATED = ("none", "naive", "ddp")
WHOLE_MATRIX_STRATEGIES = (
    "none",
    "naive",
    "ddp",
    "zero1",
    "zero2",
    "zero3",
    "fsdp",
    "tp",
    "pipeline",
    "ep",
    "cp",
    "ptdp",
)


def constructor(optimizer: Optimizer) -> dict[str, Any]:
    """The defaults of ``optimizer`` its class's constructor takes as keywords."""
    taken = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in taken.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in taken and k != "params"}


def _refuse(strategy: str, why: str) -> None:
    raise ValueError(f"plait.prepare(strategy={strategy!r}): {why}")


def prepare_optimizers(
    strategy: str,
    run: Callable[..., tuple[Any, Optimizer | None]],
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    options: dict[str, Any],
    *,
    declared: Sequence[Optimizer] = (),
) -> tuple[Any, list[Optimizer]]:
    """Prepare ``model`` with ``run`` (the strategy's entry) and return it with one
    optimizer per given optimizer, in order (module docstring). Collective as the strategy
    is."""
    check_declared(declared, optimizers)
    whole = [is_whole_matrix(o, declared) for o in optimizers]
    for o in optimizers:
        if strategy not in REPLICATED:
            check_not_refused(o, strategy)
        if o.state and strategy not in REPLICATED:
            _refuse(
                strategy,
                f"the {type(o).__name__} has stepped already; pass optimizers that "
                f"have not stepped (load their state after prepare)",
            )
    if strategy == "ptdp" and len(optimizers) == 1 and (_ptdp_whole(options) or not whole[0]):
        # PTD-P's own optimizer: element-wise, or whole parameters (tp=1, no ZeRO)
        wrapped, optimizer = run(model, optimizers[0], **options)
        assert optimizer is not None
        return wrapped, [optimizer]
    if strategy == "ptdp":
        return prepare_ptdp_optimizers(
            run, model, optimizers, whole, options, constructor=constructor
        )
    if any(whole) and strategy not in WHOLE_MATRIX_STRATEGIES:
        _refuse(
            strategy,
            f"whole-matrix optimizers ({_names(optimizers, whole)}) are not "
            f"supported here yet: its optimizer is rebuilt over per-rank pieces of the "
            f"parameters. Use zero1, zero2, fsdp, tp, pipeline, ep, cp (zero=0) or ddp",
        )
    if strategy in REPLICATED:
        wrapped, _ = run(model, None, **options)
        return wrapped, list(optimizers)
    if strategy == "cp":
        return _cp(run, model, optimizers, whole, options)
    if strategy in ("zero1", "zero2"):
        return model, _zero(int(strategy[-1]), model, optimizers, whole, options)
    if strategy in ("zero3", "fsdp"):
        return _fsdp(strategy, model, optimizers, whole, options)
    if strategy == "tp":
        return _tp(run, model, optimizers, whole, options)
    if strategy in ("pipeline", "ep"):
        return _rebuilt_each(strategy, run, model, optimizers, options)
    _refuse(strategy, "takes one optimizer, not a list")
    raise AssertionError  # unreachable


def _ptdp_whole(options: dict[str, Any]) -> bool:
    """PTD-P keeps whole parameters (every stage's, every expert's; gradients averaged over
    the replicas) when nothing splits a matrix: no tensor parallelism and no ZeRO."""
    shape = getattr(options.get("mesh"), "shape", None)
    tp = shape.get("tp", 1) if isinstance(shape, dict) else 1
    return tp == 1 and not options.get("zero", 0)


def _names(optimizers: Sequence[Optimizer], whole: Sequence[bool]) -> str:
    return ", ".join(type(o).__name__ for o, w in zip(optimizers, whole, strict=True) if w)


def _cp(
    run: Callable[..., Any],
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    whole: Sequence[bool],
    options: dict[str, Any],
) -> tuple[Any, list[Optimizer]]:
    mesh = options.get("mesh")
    tp = (
        getattr(mesh, "shape", {}).get("tp", 1)
        if isinstance(getattr(mesh, "shape", None), dict)
        else 1
    )
    zero = options.get("zero", 0)
    if zero in (1, 2) and tp == 1 and not all(whole):
        return _cp_zero(run, model, optimizers, whole, options)
    if zero != 0 or tp > 1:
        if any(whole):
            _refuse(
                "cp",
                f"a whole-matrix optimizer ({_names(optimizers, whole)}) with "
                f"zero={zero} and tp={tp} is not supported yet; use zero=0 without a tp "
                f"dimension (every rank keeps whole parameters), or strategy 'zero2'/'fsdp'",
            )
        if len(optimizers) > 1:
            _refuse(
                "cp",
                f"several optimizers with zero={zero} or a tp dimension are not "
                f"supported yet; pass one optimizer",
            )
        wrapped, optimizer = run(model, optimizers[0], **options)
        return wrapped, [optimizer]
    wrapped, _ = run(model, None, **options)
    return wrapped, list(optimizers)


def _cp_zero(
    run: Callable[..., Any],
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    whole: Sequence[bool],
    options: dict[str, Any],
) -> tuple[Any, list[Optimizer]]:
    """cp with ZeRO-1/2, no tp: the recipe runs with the first element-wise optimizer (its
    ZeroOptimizer over cp x dp, the finite check on it); the other optimizers go the
    zero1/zero2 way on the same gradient group (the parameters are whole on every rank,
    each rank's gradient is that of its chunks of the sequence)."""
    first = next(i for i, w in enumerate(whole) if not w)
    wrapped, prepared = run(model, optimizers[first], **options)
    zero_options = {"group": gradient_group(options["mesh"])}
    if "algorithm" in options:
        zero_options["algorithm"] = options["algorithm"]
    rest = [(o, w) for i, (o, w) in enumerate(zip(optimizers, whole, strict=True)) if i != first]
    others = iter(
        _zero(options["zero"], model, [o for o, _ in rest], [w for _, w in rest], zero_options)
    )
    out = [prepared if i == first else next(others) for i in range(len(optimizers))]
    return wrapped, out


def _zero(
    stage: int,
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    whole: Sequence[bool],
    options: dict[str, Any],
) -> list[Optimizer]:
    group = options.get("group") or comm.world()
    names = {id(p): n for n, p in model.named_parameters()}
    out: list[Optimizer] = []
    for o, w in zip(optimizers, whole, strict=True):
        if not w:
            out.append(prepare_zero(model, o, stage=stage, **options)[1])
            continue
        slots: list[list[Slot]] = [
            [ReplicatedSlot(names.get(id(p), "?"), p) for p in g["params"] if p.requires_grad]
            for g in o.param_groups
        ]
        params = [s.param for gs in slots for s in gs]  # type: ignore[attr-defined]
        if group.size > 1:
            verify_same_parameters(
                [(names.get(id(p), "?"), p) for p in params],
                group,
                who=f"zero{stage} {type(o).__name__}",
            )
            broadcast_tensors(params, group, options.get("algorithm", "auto"))
        out.append(own(o, slots, group, constructor=constructor(o)))
    return out


def _fsdp(
    strategy: str,
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    whole: Sequence[bool],
    options: dict[str, Any],
) -> tuple[nn.Module, list[Optimizer]]:
    groups = [g["params"] for o in optimizers for g in o.param_groups]
    options.setdefault("param_groups", groups)
    sharded = fully_shard(model, **options)
    shards = shard_param_groups(sharded)
    where: dict[int, tuple[Any, int]] = {}
    unit_group = None
    for unit in sharded.sharded_units():  # type: ignore[operator]
        unit_group = unit_group or unit.config.group
        for i, p in enumerate(unit.params):
            where[id(p)] = (unit, i)
    keys: dict[tuple[int, int], str] = {}
    for prefix, m in sharded.named_modules():
        for name, unit, i in m.__dict__.get(NAMES_ATTR, []):
            keys.setdefault((id(unit), i), f"{prefix}.{name}" if prefix else name)
    out: list[Optimizer] = []
    start = 0
    for o, w in zip(optimizers, whole, strict=True):
        count = len(o.param_groups)
        if not w:
            out.append(rebuilt_optimizer(o, shards[start : start + count], strategy))
        else:
            group = unit_group if unit_group is not None else comm.world()
            slots: list[list[Slot]] = []
            for g in o.param_groups:
                held = [where[id(p)] for p in g["params"] if id(p) in where]
                slots.append([FlatSlot(keys.get((id(u), i), "?"), u, i) for u, i in held])
            out.append(own(o, slots, group, constructor=constructor(o)))
        start += count
    return sharded, out


def _tp(
    run: Callable[..., Any],
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    whole: Sequence[bool],
    options: dict[str, Any],
) -> tuple[Any, list[Optimizer]]:
    if options.get("mode", "1d") != "1d" and any(whole):
        _refuse(
            "tp",
            f"a whole-matrix optimizer ({_names(optimizers, whole)}) with "
            f"mode={options.get('mode')!r} is not supported yet; use mode='1d'",
        )
    maps = [group_of_names(o, model) for o in optimizers]
    wrapped, first = run(model, optimizers[0], **options)
    rebuilt = [first] + [
        rebuild_optimizer(o, wrapped, m) for o, m in zip(optimizers[1:], maps[1:], strict=True)
    ]
    out = []
    for o, new, w in zip(optimizers, rebuilt, whole, strict=True):
        if w:
            slots, group = tensor_slots(wrapped, new)
            new = own(new, slots, group, constructor=constructor(o))
        out.append(new)
    return wrapped, out


def _rebuilt_each(
    strategy: str,
    run: Callable[..., Any],
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    options: dict[str, Any],
) -> tuple[Any, list[Optimizer]]:
    """pipeline, ep: the strategy rebuilds the first optimizer (and hooks it); the others
    are rebuilt by the same rule: what this rank still holds, one group per original
    group, a sliced expert weight in the group of the weight it was cut from."""
    wrapped, first = run(model, optimizers[0], **options)
    held = {id(p) for p in wrapped.parameters()}
    info = getattr(model, "plait_expert_parallel", None)
    replaced = info.replaced if info is not None else {}
    out = [first]
    for o in optimizers[1:]:
        groups = []
        for g in o.param_groups:
            params = [replaced.get(id(p), p) for p in g["params"]]
            groups.append(
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": [p for p in params if id(p) in held],
                }
            )
        if strategy == "pipeline":
            groups = [g for g in groups if g["params"]] or [{**groups[0], "params": []}]
        out.append(type(o)(groups, **constructor(o)))
    return wrapped, out
