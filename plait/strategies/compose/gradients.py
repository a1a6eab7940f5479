"""PTD-P's gradients between the last backward and the optimizer step: averaged over the
replicas (:func:`sync_gradients`), checked for non-finite values on every rank of the mesh
(:func:`check_finite`), clipped by the dense model's global norm (:func:`clip_grad_norm`).
:class:`~plait.strategies.compose.ptdp.PTDP`'s methods of the same names call these.

Communication: ``sync_gradients`` one all-reduce of the flattened gradients over dp (over
dp x cp under context parallelism; with MoE one over dp x ep for the dense gradients and
one over dp for the experts; nothing under ZeRO, whose optimizer reduce-scatters);
``check_finite`` one all-reduce of ``world`` int64 flags per mesh dimension;
``clip_grad_norm`` one scalar all-reduce over tp and pp (and ep, or dp under ZeRO).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from plait.comm import ops
from plait.comm.device import control_device, read_verdict
from plait.strategies.compose.dense import global_grad_norm, norm_terms, shard_terms
from plait.strategies.compose.experts import average
from plait.strategies.compose.reproducible import tree_average
from plait.strategies.data_parallel.grad_sync import NonFiniteGradientError, first_nonfinite_flag

if TYPE_CHECKING:
    from plait.strategies.compose.ptdp import PTDP


@torch.no_grad()
def check_finite(ptdp: PTDP) -> None:
    """Before the optimizer step: a non-finite gradient on any rank of the mesh raises
    (``"raise"``) or drops every rank's gradients so that the step leaves the parameters
    unchanged (``"skip"``), on every rank at once, naming the ranks, their pipeline stage
    and the first parameter. Collective: one all-reduce of ``world`` int64 flags per
    mesh dimension (tp, pp, ep, cp, dp in turn: a sum over the whole mesh). Each rank finds
    its first bad gradient on the device (no host read); the agreed row is read on the host
    once per step."""
    ranks_of_mesh = list(ptdp.mesh.layout.ranks)
    me = ranks_of_mesh.index(ptdp.mesh.global_rank)
    place = control_device((c.param for c in ptdp.counted), ptdp.mesh_groups()[0])
    first = first_nonfinite_flag([c.param.grad for c in ptdp.counted], device=place)
    flags = torch.zeros(len(ranks_of_mesh), dtype=torch.int64, device=place)
    flags[me] = first
    for group in ptdp.mesh_groups():
        ops.all_reduce(flags, "sum", group=group, algorithm=ptdp.algorithm)
    agreed = read_verdict(flags, who="ptdp")  # the one host read per step
    if not any(agreed):
        return
    ranks = [ranks_of_mesh[i] for i, v in enumerate(agreed) if v]
    bad = ptdp.counted[agreed[me] - 1].name if agreed[me] else None
    where = "" if bad is None else f"; on this rank (pipeline rank {ptdp.pp_group.rank}) {bad!r}"
    if ptdp.check_finite == "skip":
        warnings.warn(
            f"ptdp: a gradient holds inf or NaN on ranks {ranks}{where}; the optimizer "
            f"step is skipped on every rank (check_finite='skip')",
            RuntimeWarning,
            stacklevel=3,
        )
        for c in ptdp.counted:
            c.param.grad = None
        return
    raise NonFiniteGradientError(
        f"ptdp: a gradient holds inf or NaN on ranks {ranks}{where}; no rank stepped "
        f"(check_finite='raise'; 'skip' drops the step on every rank, a loss scaler skips "
        f"it and lowers the scale)",
        [(ptdp.mesh.global_rank, bad)] if bad is not None else [],
    )


@torch.no_grad()
def sync_gradients(ptdp: PTDP) -> None:
    """Make the gradients the dense gradient of the mean loss over every batch since
    the last optimizer step: divided by the number of ``step`` calls, averaged over dp
    (zero=0: one all-reduce of the flattened gradients; with MoE blocks one over
    dp x ep for the dense ones and one over dp for the experts, :mod:`.experts`; with cp
    the same over dp x ep x cp and dp x cp, :mod:`.context`; under
    ZeRO the optimizer reduce-scatters them itself). Runs by itself before
    ``optimizer.step()`` and in ``clip_grad_norm_``; a no-op when nothing is pending.
    Collective over dp (and dp x ep)."""
    k, ptdp._pending = ptdp._pending, 0
    if k == 0:
        return
    if ptdp._sharded_unscale is not None:
        if k > 1:
            ptdp._sharded_unscale(1.0 / k)
        return
    n = ptdp.sizes.averaged * k
    if ptdp.moe is not None or ptdp.sizes.ep > 1:
        # experts: over the ranks holding the same ones (dp, and under cp the ranks of the
        # other chunks); the rest over dp x ep (x cp) (.experts, .context)
        dense = [c.param for c in ptdp.counted if not c.expert]
        expert = [c.param for c in ptdp.counted if c.expert]
        average(dense, ptdp.average_group, divide=n, algorithm=ptdp.algorithm)
        average(expert, ptdp.expert_group, divide=n, algorithm=ptdp.algorithm)
        return
    if ptdp.sizes.cp > 1:  # no ZeRO, no reproducible (.context)
        average(
            [c.param for c in ptdp.counted],
            ptdp.average_group,
            divide=n,
            algorithm=ptdp.algorithm,
        )
        return
    grads = [c.param.grad for c in ptdp.counted if c.param.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if ptdp.reproducible:  # k == 1: the replicas' subtrees, added in dp-rank order
        tree_average(flat, group=ptdp.dp_group, algorithm=ptdp.algorithm)
    else:
        if ptdp.sizes.dp > 1:
            ops.all_reduce(flat, "sum", group=ptdp.dp_group, algorithm=ptdp.algorithm)
        flat.div_(ptdp.sizes.dp * k)
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


@torch.no_grad()
def clip_grad_norm(ptdp: PTDP, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip every gradient by the dense model's global norm; return that norm (the
    same on every rank). Each element of the dense gradient is counted once (see
    :mod:`.dense`). Collective over the whole mesh: the gradient sync if pending, then
    one scalar all-reduce over tp and pp (and dp under ZeRO)."""
    norm_type = float(norm_type)
    if ptdp.reproducible:
        raise ValueError(
            "ptdp.clip_grad_norm_ (reproducible=True) is refused: the global norm adds "
            "each stage's squares over the pp group, an order that changes with pp, and "
            "the clipping factor would carry it into every parameter; train without "
            "clipping in this mode"
        )
    if not norm_type > 0:
        raise ValueError(f"ptdp.clip_grad_norm_: norm_type must be positive, got {norm_type}")
    ptdp.sync_gradients()
    if ptdp.scaler is not None:
        ptdp.unscaler.unscale(1.0 / ptdp.scaler.scale_value)
    dtype = torch.promote_types(ptdp.counted[0].param.dtype, torch.float32)
    if ptdp.sizes.zero:
        opt: Any = ptdp.optimizer
        flat = opt.gradients.flat if opt.gradients.averaged() else None
        pieces = opt.partition[ptdp.dp_group.rank]
        # the shard's pieces index the optimizer's parameters (its groups in turn)
        in_opt = [ptdp.counted[i] for i in ptdp.opt_order]
        terms = [] if flat is None else shard_terms(in_opt, pieces, flat, norm_type)
        groups = [ptdp.tp_group, ptdp.pp_group, ptdp.dp_group]
    else:
        flat = None
        terms = norm_terms(ptdp.counted, norm_type)
        groups = [ptdp.tp_group, ptdp.pp_group]
        if ptdp.ep_group is not None:
            groups.append(ptdp.ep_group)
    total = global_grad_norm(terms, norm_type, groups=groups, algorithm=ptdp.algorithm, dtype=dtype)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if ptdp.sizes.zero:
        if flat is not None:
            flat.mul_(coef.to(flat.dtype))
    else:
        for c in ptdp.counted:
            if c.param.grad is not None:
                c.param.grad.mul_(coef.to(c.param.grad.dtype))
    return total
