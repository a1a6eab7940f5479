"""State dicts of plait models that ``torch.distributed.checkpoint`` (DCP) saves and loads.

The calls a PyTorch FSDP2 or torchtitan user writes work on a plait model::

    import torch.distributed.checkpoint as dcp
    from plait.checkpoint.dcp import get_optimizer_state_dict, set_optimizer_state_dict

    dcp.save({"model": model.state_dict(),
              "optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=d)

    state = {"model": model.state_dict(),
             "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=d)          # each rank reads only its slices
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])

Keys are the one-process model's own (as ``torch.distributed.checkpoint.state_dict``'s
functions give them for FSDP2 and DDP: no ``module.`` prefix), the optimizer state in
PyTorch's FQN-keyed format (``{"state": {fqn: {...}}, "param_groups": [{..., "params":
[fqn, ...]}]}``, or flattened as torchtitan saves it with
``StateDictOptions(flatten_optimizer_state_dict=True)``). So a directory saved here loads
into PyTorch FSDP2 at any world size, and into one process with ``no_dist=True``; one saved
by FSDP2 or torchtitan loads here. DCP's own planner and storage do everything else
(deduplicating replicated tensors, resharding by overlapping chunks).

What each layout's tensors are:

=====================  ===================================================================
layout                 the values (model, and element-wise optimizer state)
=====================  ===================================================================
plain, DDP, context    the live tensors, whole (replicated: DCP writes each once)
parallel
pipeline               this rank's stages' tensors, whole, under the dense names
tensor (1D), expert    split layers' tensors as
parallel               :class:`~plait.strategies.dcp_chunks.ShardChunks`: rectangles of
                       the one-process tensor, views of the local shard
                       (``dcp_tensor.py``; stacked experts: rows ``first ..``); plait's
                       MoE experts whole under their global ``experts.<e>`` keys; the
                       rest whole
PTD-P                  pass the layout (``get_model_state_dict(ptdp)``,
(``ptdp``)             ``get_optimizer_state_dict(ptdp, ptdp.optimizer)``): its stages'
                       tensors as above (tp slices as chunks, dp replicas' identical
                       chunks written once by DCP's planner); under ``zero=1`` the
                       optimizer state as ZeRO's pieces, cut into rectangles of each
                       block of a tp slice (``dcp_zero.py``)
ZeRO-1/2               the model whole; of each parameter's optimizer state, this rank's
                       piece of the ZeRO partition as ``ShardChunks`` (``dcp_zero.py``)
FSDP, ZeRO-3           ``ShardChunks``: this rank's flat range of each parameter as
                       rectangles of its global shape, views of the flat shards and of
                       the optimizer's state, so ``dcp.load`` writes into them
                       (``dcp_fsdp.py``); buffers and unsharded parameters whole
=====================  ===================================================================

2D/2.5D/3D tensor parallelism, and ZeRO-1/2 over a tensor-parallel weight stored transposed
(GPT-2's ``Conv1D``), are refused by name (use plait's own ``checkpoint.save``/``load``,
which reshard across all of them, or ``full_state_dict``).

No function here communicates, except :func:`get_optimizer_state_dict` in the nested format
where ranks hold different parameters (one ``all_gather_object`` of the names, see there);
an optimizer without state is first given its state by one local step with zero gradients
and lr 0, as PyTorch's ``get_optimizer_state_dict`` does. ``dcp.save``/``dcp.load``
themselves are collective over the default process group: DCP gathers every rank's plan to
the coordinator and scatters the global plan back (and gathers the write results on save);
only pickled plans and metadata travel, each rank writing and reading its own tensor bytes.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from plait.checkpoint import dcp_tensor, dcp_zero
from plait.checkpoint.full import pipeline_of, unwrap
from plait.strategies.fsdp import FSDPModule
from plait.strategies.fsdp import dcp as dcp_fsdp
from plait.strategies.tensor.layers_nd import ND_LAYERS
from plait.strategies.zero import ZeroOptimizer

__all__ = [
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
]

STATE, GROUPS, PARAMS = "state", "param_groups", "params"


# --- which layout --------------------------------------------------------------------------
def _layout(model: Any, optimizer: torch.optim.Optimizer | None, who: str) -> str:
    """``"fsdp"``, ``"zero"`` (ZeRO-1/2's optimizer: over a model, or a pipeline's or
    PTD-P's stages, whole or tensor-parallel slices) or ``"modules"`` (tensors
    held by the modules, whole or split: plain, DDP, context, pipeline, tensor and expert
    parallel, PTD-P); anything else is refused naming the layout."""
    inner = unwrap(model)
    if not isinstance(inner, nn.Module) and pipeline_of(inner) is None:
        _refuse(who, f"a {type(inner).__name__} (no modules, no pipeline stages)")
    if getattr(optimizer, "plait_state_slots", None) is not None:
        _refuse(who, "an optimizer stepped by parameter ownership (a whole-matrix optimizer)")
    if isinstance(inner, FSDPModule):
        return "fsdp"
    for root in _roots(inner):
        for name, m in root.named_modules():
            if isinstance(m, ND_LAYERS):
                _refuse(who, f"{name!r} is a {type(m).__name__} (2D/2.5D/3D tensor parallel)")
    if isinstance(optimizer, ZeroOptimizer):
        return "zero"
    return "modules"


def _refuse(who: str, layout: str) -> NoReturn:
    raise NotImplementedError(
        f"plait.checkpoint.dcp.{who}: DCP state dicts are not supported yet for this "
        f"layout: {layout}. Save with plait.checkpoint.save (it reshards across every "
        f"layout), or write a DCP checkpoint of plait.checkpoint.full_state_dict(model) "
        f"from one rank; supported here: plain, DDP, ZeRO-1/2, FSDP/ZeRO-3, 1D tensor, "
        f"expert and context parallelism, pipelines and PTD-P"
    )


def _roots(inner: Any) -> list[nn.Module]:
    """The modules holding this rank's tensors under the model's own names: a pipeline's
    (or a PTD-P layout's) stages, else the model."""
    pipe = pipeline_of(inner)
    return list(pipe.stages.values()) if pipe is not None else [inner]


# --- model ---------------------------------------------------------------------------------
def get_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict for DCP, keys as in the one-process model, values as the
    module docstring's table says (views: ``dcp.load`` into it writes into the model).
    ``model.state_dict()`` gives the same for a ``fully_shard`` model; for DDP this drops
    the ``module.`` prefix, as PyTorch's ``get_model_state_dict`` does. No communication."""
    if _layout(model, None, "get_model_state_dict") == "fsdp":
        return dcp_fsdp.model_state(unwrap(model))
    return dcp_tensor.model_state(_roots(unwrap(model)))


def set_model_state_dict(
    model: nn.Module, model_state_dict: dict[str, Any], *, strict: bool = True
) -> None:
    """Load ``model_state_dict`` into ``model``: what :func:`get_model_state_dict` gave
    (after ``dcp.load`` filled it), or whole tensors (the one-process state dict), under
    the model's own keys. A missing or unexpected key (with ``strict``) or another shape
    raises before anything is copied. No communication."""
    if _layout(model, None, "set_model_state_dict") == "fsdp":
        dcp_fsdp.load_model_state(unwrap(model), model_state_dict, strict=strict)
        return
    dcp_tensor.load_model_state(_roots(unwrap(model)), model_state_dict, strict=strict)


# --- optimizer -----------------------------------------------------------------------------
def _ensure_state(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that has not stepped its state tensors, as PyTorch's
    ``get_optimizer_state_dict`` does: one ``step`` with zero gradients and every group's
    ``lr`` at 0 (the parameters do not move), then ``zero_grad``. A ZeroOptimizer's local
    optimizer (over its flat shards) is stepped, and a strategy's step hooks (a PTD-P
    layout's gradient averaging and finite check) are left out, so no communication runs."""
    local = optimizer.optim if isinstance(optimizer, ZeroOptimizer) else optimizer
    if local.state or any(p.grad is not None for g in local.param_groups for p in g[PARAMS]):
        return
    pre, post = local._optimizer_step_pre_hooks, local._optimizer_step_post_hooks
    kept_pre, kept_post = dict(pre), dict(post)
    pre.clear()
    post.clear()
    lrs = []
    for group in local.param_groups:
        for p in group[PARAMS]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        lrs.append(group.get("lr"))
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        local.step()
    finally:
        pre.update(kept_pre)
        post.update(kept_post)
    for group, lr in zip(local.param_groups, lrs, strict=True):
        if lr is not None:
            group["lr"] = lr
    local.zero_grad(set_to_none=True)


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != PARAMS}


def get_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, options: Any = None
) -> dict[str, Any]:
    """``optimizer``'s state in the FQN-keyed format of PyTorch's
    ``get_optimizer_state_dict``, its element-wise tensors (``exp_avg``...) as the module
    docstring's table says (views of the optimizer's state), scalars (``step``) as they
    are. ``options``: a ``torch.distributed.checkpoint.state_dict.StateDictOptions``; only
    ``flatten_optimizer_state_dict`` (torchtitan's format) is honoured, other fields must
    keep their defaults.

    Where ranks hold different parameters (a pipeline's or PTD-P's stages, expert
    parallelism's experts), the nested format's ``param_groups`` (one DCP key, one copy
    kept) list every rank's parameters: one ``all_gather_object`` of the names over the
    default process group (every rank calls this together, as PyTorch's does). Nothing
    else communicates (see :func:`_ensure_state`)."""
    who = "get_optimizer_state_dict"
    flatten = _options(options, who)
    kind = _layout(model, optimizer, who)
    _ensure_state(optimizer)
    inner = unwrap(model)
    if kind == "fsdp":
        state, fqns = dcp_fsdp.optimizer_state(inner, optimizer)
    elif kind == "zero":
        assert isinstance(optimizer, ZeroOptimizer)
        state = dcp_zero.optimizer_state(_roots(inner), optimizer)
        fqns = dcp_zero.group_fqns(_roots(inner), optimizer, who)
    else:
        state, fqns = dcp_tensor.optimizer_state(_roots(inner), optimizer)
    if not flatten and _ranks_differ(inner):
        fqns = _every_rank(fqns)
    groups = [
        {**_hyper(group), PARAMS: names}
        for group, names in zip(optimizer.param_groups, fqns, strict=True)
    ]
    out = {STATE: state, GROUPS: groups}
    return _flatten(out) if flatten else out


def set_optimizer_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    *,
    options: Any = None,
) -> None:
    """Load an FQN-keyed optimizer state (what :func:`get_optimizer_state_dict` gave,
    filled by ``dcp.load``, or PyTorch's format with whole tensors) into ``optimizer``.
    Param groups must hold the same parameters (``ValueError`` otherwise, naming them).
    No communication."""
    who = "set_optimizer_state_dict"
    flatten = _options(options, who)
    kind = _layout(model, optimizer, who)
    inner = unwrap(model)
    if kind == "fsdp":
        fqns = dcp_fsdp.group_fqns(inner, optimizer)
    elif kind == "zero":
        assert isinstance(optimizer, ZeroOptimizer)
        fqns = dcp_zero.group_fqns(_roots(inner), optimizer, who)
    else:
        slots = dcp_tensor.param_slots(_roots(inner), optimizer, who)
        fqns = [[key for key, _, _, _ in group] for group in slots]
    given = _unflatten(optim_state_dict, fqns) if flatten else optim_state_dict
    hypers = _match_groups(given[GROUPS], fqns, optimizer)
    saved = given[STATE]
    if kind == "fsdp":
        dcp_fsdp.load_optimizer_state(inner, optimizer, saved, hypers)
    elif kind == "zero":
        assert isinstance(optimizer, ZeroOptimizer)
        dcp_zero.load_optimizer_state(_roots(inner), optimizer, saved, hypers)
    else:
        dcp_tensor.load_optimizer_state(_roots(inner), optimizer, saved, hypers)


def _ranks_differ(inner: Any) -> bool:
    """Whether this layout's ranks may hold different parameters: pipeline stages (PTD-P
    too) or expert parallelism's experts."""
    return pipeline_of(inner) is not None or hasattr(inner, "plait_expert_parallel")


def _every_rank(fqns: list[list[str]]) -> list[list[str]]:
    """Each param group's FQNs over every rank (first seen first, each once). Collective:
    one ``all_gather_object`` over the default process group; none without one."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fqns
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, fqns)
    out: list[list[str]] = [[] for _ in fqns]
    for theirs in every:
        if len(theirs) != len(fqns):
            raise ValueError(
                f"plait.checkpoint.dcp.get_optimizer_state_dict: this rank's optimizer has "
                f"{len(fqns)} param groups, another rank's {len(theirs)}; build every rank's "
                f"optimizer with the same groups"
            )
        for names, more in zip(out, theirs, strict=True):
            seen = set(names)
            names += [f for f in more if f not in seen]
    return out


def _match_groups(
    saved: list[dict[str, Any]], fqns: list[list[str]], optimizer: torch.optim.Optimizer
) -> list[dict[str, Any]]:
    """The saved hyper-parameters of each of this optimizer's groups (by their FQNs; a
    group with no parameter on this rank, a pipeline stage's, keeps its own)."""
    by_fqn = {}
    for j, group in enumerate(saved):
        for f in group[PARAMS]:
            by_fqn[f] = j
    out = []
    for g, names in enumerate(fqns):
        if not names:
            out.append(_hyper(optimizer.param_groups[g]))
            continue
        found = {by_fqn.get(f) for f in names}
        if None in found or len(found) != 1:
            missing = [f for f in names if f not in by_fqn][:6]
            raise ValueError(
                f"set_optimizer_state_dict: param group {g} ({names[:4]}...) does not match "
                f"one saved group (saved groups hold {[len(s[PARAMS]) for s in saved]} "
                f"parameters; not saved: {missing}); build the optimizer with the same groups"
            )
        out.append(_hyper(saved[found.pop()]))  # type: ignore[index]
    return out


def get_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, options: Any = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(get_model_state_dict(model), get_optimizer_state_dict(model, optimizer))``."""
    return get_model_state_dict(model), get_optimizer_state_dict(model, optimizer, options=options)


# --- PyTorch's options and torchtitan's flat format --------------------------------------
def _options(options: Any, who: str) -> bool:
    """``flatten_optimizer_state_dict`` of a ``StateDictOptions`` (refusing other fields
    set away from their defaults)."""
    if options is None:
        return False
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,  # deferred: only when options are given
    )

    default = StateDictOptions()
    changed = [
        f
        for f in ("full_state_dict", "cpu_offload", "ignore_frozen_params", "broadcast_from_rank0")
        if getattr(options, f) != getattr(default, f)
    ]
    if changed:
        raise NotImplementedError(
            f"plait.checkpoint.dcp.{who}: StateDictOptions {changed} are not supported; for a "
            f"whole state dict use plait.checkpoint.full_state_dict(model)"
        )
    return bool(options.flatten_optimizer_state_dict)


def _flatten(osd: dict[str, Any]) -> dict[str, Any]:
    """torchtitan's layout (``flatten_optimizer_state_dict=True``): ``state.<fqn>.<key>``
    and, per parameter, ``param_groups.<fqn>.<hyper>``."""
    out: dict[str, Any] = {}
    for fqn, entry in osd[STATE].items():
        for k, v in entry.items():
            out[f"{STATE}.{fqn}.{k}"] = v
    for group in osd[GROUPS]:
        for fqn in group[PARAMS]:
            for k, v in _hyper(group).items():
                out[f"{GROUPS}.{fqn}.{k}"] = v
    return out


def _unflatten(flat: dict[str, Any], fqns: list[list[str]]) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    groups = []
    for names in fqns:
        for fqn in names:
            head = f"{STATE}.{fqn}."
            entry = {k[len(head) :]: v for k, v in flat.items() if k.startswith(head)}
            if entry:
                state[fqn] = entry
        first = f"{GROUPS}.{names[0]}." if names else None
        hyper = {k[len(first) :]: v for k, v in flat.items() if first and k.startswith(first)}
        groups.append({**hyper, PARAMS: list(names)})
    return {STATE: state, GROUPS: groups}
