"""``fully_shard``: choose the units, place each parameter in one flat shard, add the hooks.

Communication at wrap time (collective on ``group``): the parameter-list check of
:func:`plait.strategies.consistency.verify_same_parameters` (store round trips), one
broadcast of the module's buffers and one broadcast per new unit's flat buffer from group
rank 0 (none for a model on the meta device).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from plait import runtime
from plait.comm.group import Group
from plait.mesh import Mesh, data_parallel_group
from plait.precision import cast_floating
from plait.strategies.consistency import verify_same_parameters
from plait.strategies.data_parallel.ddp import broadcast_tensors
from plait.strategies.fsdp import streams
from plait.strategies.fsdp.module import FSDPModule
from plait.strategies.fsdp.policies import (
    MixedPrecisionPolicy,
    OffloadPolicy,
    resolve_mixed_precision,
    resolve_offload,
)
from plait.strategies.fsdp.schedule import _RootState
from plait.strategies.fsdp.unit import (
    NAMES_ATTR,
    SHARD_NAME,
    UNIT_ATTR,
    UNITS_ATTR,
    ShardedUnit,
    _Config,
)
from plait.strategies.reproducible.tree import Microbatches
from plait.trace import Tracer

Wrap = set[type[nn.Module]] | frozenset[type[nn.Module]] | tuple[type[nn.Module], ...] | int
Owned = list[tuple[nn.Module, str, nn.Parameter]]

# Modules whose forward reads their children's parameters without calling the children
# (nn.MultiheadAttention passes out_proj.weight and .bias to F.multi_head_attention_forward):
# a child of one of these can never be a unit, its parameters would never be gathered.
READS_CHILD_PARAMETERS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)

_FSDP_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


HOOKS_OUTSIDE_GRAPH = "plait FSDP hooks (all-gather, install views, reshard) run outside the graph"


def outside_graph(hook: Any) -> Any:
    """``hook`` run eagerly when a compiled model calls it, as PyTorch's FSDP2 runs its own
    (``torch/distributed/fsdp/_fully_shard/_fsdp_common.py``, ``_dynamo_disable``): it
    gathers and frees storage and swaps parameters, which a graph cannot hold. Under
    ``torch.compile`` of a wrapped model the graph breaks at each unit's boundary there, as
    it does for FSDP2 (compile each block instead, as torchtitan does, for one graph per
    block); the reason Dynamo gives names :data:`HOOKS_OUTSIDE_GRAPH`."""
    return torch.compiler.disable(hook, recursive=True, reason=HOOKS_OUTSIDE_GRAPH)


def _become_fsdp_module(module: nn.Module) -> None:
    cls = type(module)
    if issubclass(cls, FSDPModule):
        return
    new = _FSDP_CLASSES.get(cls)
    if new is None:
        new = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        _FSDP_CLASSES[cls] = new
    module.__class__ = new


def _check_units_are_called(
    root: nn.Module, earlier: list[nn.Module], targets: list[nn.Module], wrap: Wrap | None
) -> None:
    """Refuse a unit whose parent reads its parameters directly (READS_CHILD_PARAMETERS):
    it would never be gathered. Checked on every rank alike, before any communication."""
    chosen = {id(m): f"wrap={_wrap_repr(wrap)} makes" for m in targets}
    chosen.update({id(m): "an earlier fully_shard call made" for m in earlier})
    for parent_path, parent in root.named_modules():
        if not isinstance(parent, READS_CHILD_PARAMETERS):
            continue
        for name, child in parent.named_children():
            if id(child) not in chosen:
                continue
            path = f"{parent_path}.{name}" if parent_path else name
            enclosing = root.get_submodule(parent_path.rpartition(".")[0]) if parent_path else root
            if enclosing is root:  # the root is a unit already: suggest the parent itself
                enclosing = parent
            raise ValueError(
                f"fully_shard: {chosen[id(child)]} {path!r} ({_class_name(child)}) a unit, "
                f"but its parent {parent_path or '(root)'!r} ({_class_name(parent)}) reads its "
                f"parameters directly without calling its forward, so they would never be "
                f"gathered (the forward would fail on a 'meta' placeholder). Make an enclosing "
                f"module the unit instead (e.g. wrap={{{_class_name(enclosing)}}}), and leave "
                f"{_class_name(child)} out of wrap"
            )


def _class_name(module: nn.Module | type[nn.Module]) -> str:
    """``nn.Linear`` for torch.nn classes, the bare name otherwise; the class before
    ``fully_shard`` mixed FSDPModule into it."""
    given = module if isinstance(module, type) else type(module)
    cls = next(c for c in given.__mro__ if not issubclass(c, FSDPModule))
    return f"nn.{cls.__name__}" if getattr(nn, cls.__name__, None) is cls else cls.__name__


def _wrap_repr(wrap: Wrap | None) -> str:
    if isinstance(wrap, (set, frozenset, tuple)):
        return "{" + ", ".join(sorted(_class_name(c) for c in wrap)) + "}"
    return repr(wrap)


def _is_unit(module: nn.Module) -> bool:
    return UNITS_ATTR in module.__dict__


def _post_order(root: nn.Module, stop: set[int]) -> Iterator[nn.Module]:
    """Modules under ``root`` children first, each once, not entering units in ``stop``."""
    seen: set[int] = set()

    def visit(m: nn.Module) -> Iterator[nn.Module]:
        seen.add(id(m))
        for child in m.children():
            if id(child) not in seen and id(child) not in stop:
                yield from visit(child)
        yield m

    yield from visit(root)


def _wrap_targets(root: nn.Module, wrap: Wrap | None, stop: set[int]) -> list[nn.Module]:
    """The submodules ``wrap`` makes units of, children before parents (root excluded)."""
    if wrap is None:
        return []
    if isinstance(wrap, int) and not isinstance(wrap, bool):
        if wrap <= 0:
            raise ValueError(f"fully_shard: wrap={wrap} must be a positive parameter count")
        claimed: set[int] = set()
        targets = []
        for m in _post_order(root, stop):  # bottom-up: count what no chosen child holds
            if m is root:
                continue
            free = sum(p.numel() for _, _, p in _owned(m, stop | claimed))
            if free >= wrap:
                targets.append(m)
                claimed.add(id(m))
        return targets
    if isinstance(wrap, (set, frozenset, tuple)) and all(isinstance(c, type) for c in wrap):
        classes = tuple(wrap)
        return [m for m in _post_order(root, stop) if m is not root and isinstance(m, classes)]
    raise TypeError(
        f"fully_shard: wrap must be None, a set or tuple of module classes, or an int "
        f"(a parameter count); got {wrap!r}"
    )


def _owned(module: nn.Module, stop: set[int]) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Parameters of ``module``'s subtree outside the units in ``stop``, in module order."""
    found: list[tuple[nn.Module, str, nn.Parameter]] = []
    seen: set[tuple[int, str]] = set()
    for m in _pre_order(module, stop):
        for name, p in m._parameters.items():
            if p is not None and (id(m), name) not in seen:
                seen.add((id(m), name))
                found.append((m, name, p))
    return found


def _pre_order(root: nn.Module, stop: set[int]) -> Iterator[nn.Module]:
    seen: set[int] = set()

    def visit(m: nn.Module) -> Iterator[nn.Module]:
        seen.add(id(m))
        yield m
        for child in m.children():
            if id(child) not in seen and id(child) not in stop:
                yield from visit(child)

    yield from visit(root)


def _default_group(group: Group | None) -> Group | None:
    if group is not None:
        return group
    return runtime.world() if runtime.is_initialized() else None


def fully_shard(
    module: nn.Module,
    *,
    mesh: Mesh | Group | None = None,
    group: Group | None = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | str | None = None,
    offload_policy: OffloadPolicy | None = None,
    mixed_precision: MixedPrecisionPolicy | str | None = None,
    offload: OffloadPolicy | None = None,
    wrap: Wrap | None = None,
    prefetch: bool = True,
    algorithm: str = "auto",
    param_groups: Sequence[Iterable[nn.Parameter]] | None = None,
    tracer: Tracer | None = None,
    reproducible: bool = False,
    threads: int | None = 1,
) -> nn.Module:
    """Shard ``module``'s parameters over ``mesh`` (a :class:`~plait.Mesh`'s ``dp``
    dimension, or a group, as FSDP2's ``mesh=``; ``group=`` is accepted as well; default: the
    world) in place; return it.

    ``wrap``: which submodules become units of their own (a set or tuple of module
    classes; an int: a submodule whose subtree holds at least that many parameters not in
    a smaller unit, chosen bottom-up; None: the root only). Submodules sharded by earlier
    ``fully_shard`` calls (bottom-up nesting) stay units and join this root. A unit must
    run through its own ``forward``: a ``ValueError`` names any unit whose parent reads its
    parameters directly (any child of ``nn.MultiheadAttention``, so ``wrap={nn.Linear}``
    on a transformer is refused: use ``wrap={nn.TransformerEncoderLayer}``).
    A parameter shared by modules of several units (tied weights, e.g. an embedding and
    the output head) is placed in the innermost unit enclosing all of them (often the
    root), so it stays one tensor; a tie reaching into a unit sharded by an earlier call
    is refused, naming the parameter and both paths.
    ``reshard_after_forward``: free each unit's full parameters after its forward and
    gather them again for backward, except the root's and those backward needs first
    (False: keep all until their backward is done).
    ``mp_policy`` (alias ``mixed_precision``): a :class:`MixedPrecisionPolicy`
    (:mod:`plait.precision`: units gathered in ``param_dtype``, gradients reduce-scattered
    in ``reduce_dtype``, by default the shards' dtype, outputs of the root cast to
    ``output_dtype``), or ``"bf16"``/``"fp16"`` (compute in it, reduce in float32) or
    ``"fp32"``; shards stay in their dtype. ``offload_policy`` (alias ``offload``): an
    :class:`OffloadPolicy` keeping shards
    (and hence optimizer state) in CPU memory. ``prefetch``: overlap the next unit's
    all-gather with this unit's compute (``set_modules_to_forward_prefetch`` /
    ``set_modules_to_backward_prefetch`` choose explicitly). ``algorithm``: the all-gather
    and reduce-scatter algorithm (``plait.comm``'s names). ``param_groups``: the
    optimizer's parameter groups (lists of ``module``'s parameters): each unit gets one
    flat shard per group (and per dtype and ``requires_grad``), so an optimizer with
    per-group hyper-parameters can be built over :func:`shard_param_groups`
    (``plait.prepare`` does this). ``tracer``: record forward, backward and every
    all-gather and reduce-scatter (see :mod:`plait.trace`).

    ``reproducible=True`` (pass it to every ``fully_shard`` call of one model): each
    micro-batch step's unit gradients are summed (not averaged) with
    :func:`~plait.strategies.reproducible.collectives.tree_reduce_scatter` and the sums
    are added on the shards along the fixed micro-batch tree: bitwise the same for every
    algorithm, transport and world size. Rank ``r`` must run micro-batches ``r, r+W,
    r+2W, ...`` of the global batch, which a
    :class:`~plait.strategies.reproducible.ReproducibleRunner` does (its ``block``); a
    backward outside its ``step`` is refused. ``threads`` (default 1) pins the intra-op
    threads (docs/reproducible.md).

    A model built on the meta device is sharded without communication; then
    ``model.to_empty(device=...)`` and :func:`materialize` (or ``unshard``, init,
    ``reshard``) initialize it. ``model.state_dict()`` holds this rank's chunks, for
    ``torch.distributed.checkpoint``; whole tensors: :func:`full_state_dict` /
    :func:`load_full_state_dict`.

    Collective: every rank of ``group`` must call it, with the same module structure (a
    rank whose parameter names, shapes or dtypes differ is named in a ``ValueError`` on
    every rank); the initial broadcasts block on the group. Build the optimizer afterwards,
    from ``module.parameters()`` (the shards). Without ``plait.init`` and ``group``, it
    runs in one process without communication.
    """
    if _is_unit(module):
        raise ValueError(
            f"fully_shard: {type(module).__name__} is already sharded; call fully_shard "
            f"once per module (children first, then the root)"
        )
    mp = resolve_mixed_precision(_alias(mp_policy, mixed_precision, "mp_policy"))
    off = resolve_offload(_alias(offload_policy, offload, "offload_policy"))
    g = _default_group(data_parallel_group(mesh, group, who="fully_shard"))
    if g is not None and g.size > 1:
        verify_same_parameters(module.named_parameters(), g, who="fully_shard")
    first = next(module.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    config = _Config(
        group=g,
        algorithm=algorithm,
        reshard_after_forward=reshard_after_forward,
        param_dtype=mp.param_dtype,
        reduce_dtype=mp.reduce_dtype,
        compute_device=device,
        shards_on_cpu=off is not None and off.shards_on_cpu,
        tracer=tracer,
        microbatches=Microbatches(interleaved=True) if reproducible else None,
        side_streams=streams.for_device(device),
    )
    if reproducible and threads is not None:
        torch.set_num_threads(threads)
    earlier = [m for m in module.modules() if _is_unit(m)]
    stop = {id(m) for m in earlier}
    targets = _wrap_targets(module, wrap, stop)
    _check_units_are_called(module, earlier, targets, wrap)
    group_of = _group_indices(module, param_groups)
    buffers = [b for b in module.buffers()]
    if g is not None and g.size > 1 and buffers and not any(b.is_meta for b in buffers):
        broadcast_tensors(buffers, g, "auto")
    if mp.output_dtype is not None:
        module.register_forward_hook(_cast_outputs(mp.output_dtype))
    if mp.buffer_dtype is not None:
        for m in module.modules():
            for name, b in m._buffers.items():
                if b is not None and b.is_floating_point():
                    m._buffers[name] = b.to(mp.buffer_dtype)
    registered = {
        id(m): [n for n, p in m._parameters.items() if p is not None]
        for m in _pre_order(module, stop)
    }
    owned = _place_tied(module, [*targets, module], stop, earlier)
    new_units: list[ShardedUnit] = []
    roots: list[ShardedUnit] = []
    for m in [*targets, module]:
        units = _make_units(m, owned[id(m)], config, group_of)
        m.__dict__[UNITS_ATTR] = units
        m.__dict__[UNIT_ATTR] = units[0]
        for unit in units:
            m.register_forward_pre_hook(outside_graph(unit.pre_forward), with_kwargs=True)
            m.register_forward_hook(outside_graph(unit.post_forward))
        _become_fsdp_module(m)
        new_units += units
        roots = units
    slot_of: dict[tuple[int, str], tuple[ShardedUnit, int]] = {}
    for unit in new_units:
        for i, slots in enumerate(unit.slots):
            for m, name in slots:
                slot_of[(id(m), name)] = (unit, i)
    for m in _pre_order(module, stop):  # names in registration order, for state dicts
        names = [(n, *slot_of[(id(m), n)]) for n in registered.get(id(m), [])]
        if names:
            m.__dict__[NAMES_ATTR] = names
    all_units: list[ShardedUnit] = []
    for m in earlier:  # earlier roots hand their units (children first) to this root
        earlier_state = m.__dict__[UNITS_ATTR][0].state
        all_units += earlier_state.units if earlier_state is not None else []
    all_units = _unique([*all_units, *new_units])
    state = _RootState(all_units, roots, prefetch)
    if param_groups is not None:
        state.plain_groups = [
            [slot_of[_first_slot(p, new_units)] for p in params] for params in _listed(param_groups)
        ]
    paths = {id(m): name for name, m in module.named_modules()}
    for unit in all_units:
        unit.name(paths)
        if unit.config.group is not g and unit.config.group is not None:
            raise ValueError(
                "fully_shard: a submodule was sharded over another group; nested units "
                "must share the root's group"
            )
        unit.state = state
    return module


def _cast_outputs(dtype: torch.dtype) -> Callable[..., Any]:
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        return cast_floating(output, dtype)

    return hook


def _alias(new: Any, old: Any, name: str) -> Any:
    if new is not None and old is not None:
        old_name = {"mp_policy": "mixed_precision", "offload_policy": "offload"}[name]
        raise TypeError(f"fully_shard: pass {name}= or its alias {old_name}=, not both")
    return new if new is not None else old


def _listed(param_groups: Sequence[Iterable[nn.Parameter]]) -> list[list[nn.Parameter]]:
    return [list(params) for params in param_groups]


def _group_indices(
    module: nn.Module, param_groups: Sequence[Iterable[nn.Parameter]] | None
) -> dict[int, int]:
    """Parameter id to its group's index; refuses parameters not in ``module`` or in two
    groups."""
    if param_groups is None:
        return {}
    mine = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    out: dict[int, int] = {}
    for k, params in enumerate(_listed(param_groups)):
        for p in params:
            if id(p) not in mine:
                raise ValueError(
                    f"fully_shard: param_groups[{k}] holds a parameter of shape "
                    f"{tuple(p.shape)} that is not a parameter of this module"
                )
            if out.get(id(p), k) != k:
                raise ValueError(
                    f"fully_shard: parameter {mine[id(p)]!r} is in param_groups "
                    f"{out[id(p)]} and {k}; a parameter belongs to one group"
                )
            out[id(p)] = k
    return out


def _first_slot(p: nn.Parameter, units: list[ShardedUnit]) -> tuple[int, str]:
    for unit in units:
        for q, slots in zip(unit.params, unit.slots, strict=True):
            if q is p:
                m, name = slots[0]
                return id(m), name
    raise AssertionError("a grouped parameter was not placed in a unit")


def _make_units(
    module: nn.Module, owned: Owned, config: _Config, group_of: dict[int, int]
) -> list[ShardedUnit]:
    """One unit per (parameter group, dtype, requires_grad) among ``owned``, in order of
    first appearance (one empty unit if ``owned`` is empty: the hooks still run)."""
    buckets: dict[tuple[int | None, torch.dtype, bool], Owned] = {}
    for m, name, p in owned:
        key = (group_of.get(id(p)), p.dtype, p.requires_grad)
        buckets.setdefault(key, []).append((m, name, p))
    if not buckets:
        return [ShardedUnit(module, [], config)]
    units = []
    for k, ((group_index, _, _), entries) in enumerate(buckets.items()):
        name = SHARD_NAME if k == 0 else f"{SHARD_NAME}_{k}"
        units.append(ShardedUnit(module, entries, config, shard_name=name, group_index=group_index))
    return units


def _place_tied(
    root: nn.Module, unit_modules: list[nn.Module], stop: set[int], earlier: list[nn.Module]
) -> dict[int, Owned]:
    """What each new unit owns: ``_owned`` of each (children first), except that a
    parameter registered in several units' subtrees (tied weights) goes, with all its
    slots, to the innermost unit enclosing every module that registers it."""
    paths: dict[int, str] = {}
    for name, m in root.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), name)
    earlier_params = {
        id(p): (paths.get(id(u.module), "?"), u)
        for m in earlier
        for u in m.__dict__[UNITS_ATTR]
        for p in u.params
    }
    owned: dict[int, Owned] = {}
    seen_stop = set(stop)
    where: dict[int, list[tuple[nn.Module, str, nn.Parameter, nn.Module]]] = {}
    for u in unit_modules:
        owned[id(u)] = _owned(u, seen_stop)
        seen_stop.add(id(u))
        for m, name, p in owned[id(u)]:
            where.setdefault(id(p), []).append((m, name, p, u))
            if id(p) in earlier_params:
                unit_path, _ = earlier_params[id(p)]
                raise ValueError(
                    f"fully_shard: parameter {_slot_path(paths, m, name)!r} is tied to a "
                    f"parameter of unit {unit_path or '(root)'!r}, which an earlier "
                    f"fully_shard call sharded on its own (they would drift apart). Shard "
                    f"the module enclosing both in one call (e.g. with wrap=), so the tied "
                    f"parameter is placed in their common unit"
                )
    for entries in where.values():
        holders = {id(u) for *_, u in entries}
        if len(holders) < 2:
            continue
        slot_paths = [_slot_path(paths, m, "").rstrip(".") for m, _, _, _ in entries]
        common = _common_prefix(slot_paths)
        home = max(
            (u for u in unit_modules if _is_prefix(paths.get(id(u), ""), common)),
            key=lambda u: len(paths.get(id(u), "")),
        )
        for u_id in holders:
            owned[u_id] = [e for e in owned[u_id] if e[2] is not entries[0][2]]
        owned[id(home)] += [(m, name, p) for m, name, p, _ in entries]
    return owned


def _slot_path(paths: dict[int, str], m: nn.Module, name: str) -> str:
    prefix = paths.get(id(m), "?")
    return f"{prefix}.{name}" if prefix else name


def _common_prefix(paths: list[str]) -> str:
    split = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def _is_prefix(prefix: str, path: str) -> bool:
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


def _unique(units: Iterable[ShardedUnit]) -> list[ShardedUnit]:
    return list({id(u): u for u in units}.values())
