"""``prepare_cp``: context parallelism read top to bottom, the recipe of
``plait.prepare(strategy="cp")``:

1. with a ``tp`` dimension, tensor parallelism over it
   (:func:`~plait.strategies.tensor.prepare_tp`: its collectives on the tp group);
2. the attention kernel swapped (:func:`~plait.strategies.context.style.context_parallel`:
   ring point-to-point or Ulysses all-to-all on the cp group);
3. the gradients averaged over the ``cp x dp`` ranks that hold the same (tp) shards, by one
   of four ``zero=`` settings, all on the flattened ``cp+dp`` group (``n = c * d`` ranks):

   ======  ===============================  ==========================================
   zero    sharded over cp x dp             collectives per step on cp+dp (P elements
                                            of b bytes that this tp rank holds)
   ======  ===============================  ==========================================
   0       nothing                          :class:`~plait.strategies.NaiveDataParallel`:
                                            at the end of backward one all-reduce
                                            (average) per parameter, 2 (n-1)/n P b sent
   1       optimizer state                  :class:`~plait.strategies.zero.ZeroOptimizer`:
                                            in ``step()`` reduce-scatter (average) of the
                                            gradients, then all-gather of the updated
                                            parameters: (n-1)/n P b each
   2       optimizer state, gradients       the same reduce-scatters, launched during
                                            backward bucket by bucket; the all-gather in
                                            ``step()``
   3       parameters, gradients,           :func:`~plait.strategies.fsdp.fully_shard`:
           optimizer state                  per unit an all-gather before its forward,
                                            again before its backward, a reduce-scatter
                                            (average) of its gradient in backward: about
                                            3 (n-1)/n P b
   ======  ===============================  ==========================================

   Every setting averages over ``n = c * d`` ranks: each rank's loss is the mean over its own
   tokens, the sum over the cp ranks of their gradients is the gradient of the sum of their
   local means, so the average over ``c * d`` ranks is the gradient of the global mean loss,
   as one process on the whole sequences of the global batch. Parameters start equal: a
   broadcast from the group's rank 0 at wrap (zero 0, 1, 2), or each unit's flat buffer
   broadcast before it is cut (zero 3).

The attention kernel's own messages stay on the cp group (ring: K and V around the ring,
``(c-1)`` blocks forward and backward; Ulysses: 4 all-to-alls forward, 4 backward; see those
modules): with ``zero=3`` they run inside a unit's forward, between its all-gather and its
free, so the kernel sees whole (gathered) projection weights and the sharding is invisible
to it. plait's GPT keeps its attention swap (a ``TorchFunctionMode`` around each
``Attention.forward`` and a pre-hook on ``pos``) and Hugging Face models theirs (the
``AttentionInterface`` entry their config names): both are installed before
``fully_shard``, which adds hooks and keeps each module's own ``forward``.

``check_finite`` with ``zero`` 1, 2, 3: before every ``optimizer.step()`` each rank looks at
its shard of the averaged gradient and the mesh agrees in one all-reduce (sum) of one int64
per rank (a NaN on any rank reaches the shard of the rank that owns those elements):
``"raise"`` raises :class:`~plait.strategies.data_parallel.grad_sync.NonFiniteGradientError`
on every rank, naming the ranks whose shards hold it; ``None`` checks nothing (a loss
scaler handles overflows itself). ``"skip"`` is refused with ``zero`` (use ``zero=0``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.comm.device import control_device
from plait.comm.group import Group
from plait.strategies.context.layout import WHO
from plait.strategies.context.moe import prepare_moe
from plait.strategies.context.style import context_parallel
from plait.strategies.data_parallel.grad_sync import (
    NonFiniteGradientError,
    agree_nonfinite,
    check_policy,
    first_nonfinite_flag,
)
from plait.strategies.data_parallel.naive import NaiveDataParallel
from plait.strategies.fsdp.prepare import prepare_fsdp
from plait.strategies.moe.plan import MoEPlan
from plait.strategies.tensor.parallelize import prepare_tp
from plait.strategies.zero import ZeroOptimizer, prepare_zero

ZERO_STAGES = (0, 1, 2, 3)


def gradient_group(mesh: Any) -> Group:
    """The ranks whose gradients are averaged: cp, or cp x dp (a tp dimension keeps its own
    reductions; other dimensions are refused)."""
    if isinstance(mesh, Group):
        return mesh
    names = tuple(mesh.names)
    other = set(names) - {"cp", "dp", "tp"}
    if other:
        raise ValueError(
            f"{WHO}: mesh {mesh!r} has dimensions {sorted(other)}; strategy 'cp' composes with "
            f"'dp' and 'tp': use Mesh(tp=..., cp=..., dp=...), or strategy 'ptdp' on "
            f"Mesh(pp=..., dp=..., tp=..., cp=...) for pipeline stages with cp"
        )
    if "dp" not in names or mesh.size("dp") == 1:
        group: Group = mesh.group("cp")
        return group
    sub = mesh.submesh("cp", "dp")
    flat: Group = sub.group(*sub.names)
    return flat


def _mesh_group(mesh: Any, group: Group) -> Group:
    """Every rank of the mesh (the finite-check verdict must reach the tp ranks too)."""
    if isinstance(mesh, Group) or mesh.size() == group.size:
        return group
    sub = mesh.submesh(*mesh.names)
    whole: Group = sub.group(*sub.names)
    return whole


class ShardFiniteCheck:
    """An optimizer step pre-hook: is this rank's shard of the averaged gradient finite?
    The mesh agrees (:func:`agree_nonfinite`: one all-reduce of one int64 per rank, found
    on the device, read on the host once) and every
    rank raises, naming the ranks whose shards hold inf or NaN. Collective at every step."""

    def __init__(self, group: Group, zero: int) -> None:
        self.group, self.zero, self.steps = group, zero, 0

    def shards(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor | None]:
        if isinstance(optimizer, ZeroOptimizer):
            grads = optimizer.gradients  # stage 1 reduce-scatters here; step() reuses it
            return [grads.flat] if grads.averaged() else []
        return [p.grad for group in optimizer.param_groups for p in group["params"]]

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.steps += 1
        shards = self.shards(optimizer)
        local = first_nonfinite_flag(shards, device=control_device(shards, self.group))
        culprits = agree_nonfinite(local, self.group, who=f"{WHO} (zero={self.zero})")
        if not culprits:
            return
        ranks = ", ".join(str(r) for r, _ in culprits)
        raise NonFiniteGradientError(
            f"{WHO} (zero={self.zero}): step {self.steps}: the gradient averaged over cp x dp "
            f"holds inf or NaN in the shard of rank(s) {ranks}; every rank raises. Lower the "
            f"learning rate, clip gradients or look at the data; pass check_finite=None when "
            f"a loss scaler handles overflows itself",
            [(r, "gradient shard") for r, _ in culprits],
        )


def prepare_cp(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    mesh: Any,
    context: str = "ring",
    balanced: bool = True,
    positions: str | bool | None = None,
    plan: Any = None,
    sequence_parallel: bool = False,
    algorithm: str = "auto",
    check_finite: str | None = "raise",
    zero: int = 0,
    wrap: Any = None,
    moe_plan: MoEPlan | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """``plait.prepare(strategy="cp")``: the recipe of the module docstring. With a ``tp``
    dimension, tensor parallelism first (``plan=``, ``sequence_parallel=``: the optimizer
    rebuilt over the shards; attention then runs on this rank's heads); then
    :func:`~plait.strategies.context.style.context_parallel` (``context``, ``balanced``,
    ``positions``); then the gradients averaged over cp x dp by ``zero``:

    - ``0`` (default): :class:`~plait.strategies.NaiveDataParallel`, the caller's optimizer
      (or tp's rebuilt one) returned; ``check_finite`` ``"raise"``, ``"skip"`` or None;
    - ``1``, ``2``: :func:`~plait.strategies.zero.prepare_zero` on the flattened cp+dp group
      (a :class:`~plait.strategies.zero.ZeroOptimizer` returned; the model itself);
    - ``3``: :func:`~plait.strategies.fsdp.prepare_fsdp` on that group with ``wrap=`` (the
      units, default the root only; ``plait.prepare`` passes the model's blocks for plait's
      GPT and Hugging Face models), a new optimizer of the same class over the shards.

    With tp (``Mesh(tp=t, cp=c[, dp=d])``) every ``zero`` works: ZeRO and FSDP shard what
    this tp rank holds over its cp x dp ranks (tested against one process for plait's GPT
    and a Hugging Face Llama). Refused by name before any rank trains: ``zero`` not in
    0-3, ``check_finite="skip"`` with ``zero`` 1-3, ``wrap=`` without ``zero=3``, ``zero``
    1 or 2 without an optimizer, and ``sequence_parallel=True`` with ``zero=3`` (FSDP's flat
    shards replace the norms whose gradients tp's sequence regions sum over tp).

    Collective over the mesh (every rank calls it). Returns the model (wrapped by
    NaiveDataParallel for ``zero=0``, sharded in place for ``zero=3``; call it as the
    model; with tp the loss is :func:`plait.strategies.tensor.loss_fn`'s) and the optimizer.
    MoE models: ``moe_plan=`` (the family's, which ``plait.prepare`` passes) has their router
    logits gathered for the load-balancing loss; plait's own MoE layer is refused
    (:mod:`plait.strategies.context.moe`).
    """
    if zero not in ZERO_STAGES or isinstance(zero, bool):
        raise ValueError(
            f"{WHO}: zero={zero!r}; use 0 (gradients all-reduced over cp x dp), 1 or 2 "
            f"(ZeRO optimizer state, and gradients, sharded over cp x dp) or 3 (FSDP: "
            f"parameters too)"
        )
    if not isinstance(mesh, Group) and "cp" not in getattr(mesh, "names", ()):
        raise ValueError(f"{WHO}: strategy 'cp' needs a mesh with a 'cp' dimension, got {mesh!r}")
    check_policy(check_finite)
    if zero and check_finite == "skip":
        raise ValueError(
            f"{WHO}: check_finite='skip' with zero={zero}: a sharded optimizer cannot drop one "
            f"step on every rank here; use check_finite='raise' (or None), or zero=0"
        )
    if wrap is not None and zero != 3:
        raise ValueError(f"{WHO}: wrap= chooses FSDP units; it needs zero=3, got zero={zero}")
    if zero in (1, 2) and optimizer is None:
        raise ValueError(
            f"{WHO}: zero={zero} shards the optimizer: pass the optimizer built on "
            f"model.parameters() to plait.prepare"
        )
    tp = 1 if isinstance(mesh, Group) or "tp" not in mesh.names else mesh.size("tp")
    group = gradient_group(mesh)
    if tp > 1:
        model, optimizer = prepare_tp(
            model,
            optimizer,
            mesh=mesh,
            plan=plan,
            sequence_parallel=sequence_parallel,
            algorithm=algorithm,
        )
    elif plan is not None or sequence_parallel:
        raise ValueError(f"{WHO}: plan= and sequence_parallel= need a 'tp' dimension in the mesh")
    tensor = getattr(model, "plait_tensor_parallel", None)  # what prepare_tp set up
    if zero == 3 and tensor is not None and tensor.sequence_parallel:
        raise ValueError(
            f"{WHO}: sequence_parallel=True with zero=3: FSDP's flat shards replace the "
            f"parameters whose gradients tp's sequence regions sum over tp (the norms), so "
            f"those sums would be lost; use zero=0, 1 or 2 with sequence parallelism"
        )
    context_parallel(model, mesh=mesh, context=context, balanced=balanced, positions=positions)
    # MoE blocks: their routers' logits gathered for the load-balancing loss (.moe)
    prepare_moe(model, mesh=mesh, gradient_group=group, moe_plan=moe_plan, algorithm=algorithm)
    if zero == 0:
        wrapped = NaiveDataParallel(
            model, group=group, algorithm=algorithm, check_finite=check_finite
        )
        return wrapped, optimizer
    if zero in (1, 2):
        assert optimizer is not None
        model, optimizer = prepare_zero(
            model, optimizer, stage=zero, group=group, algorithm=algorithm
        )
    else:
        model, optimizer = prepare_fsdp(
            model,
            optimizer,
            strategy=f"cp with zero={zero}",
            group=group,
            wrap=wrap,
            algorithm=algorithm,
        )
    if optimizer is not None and check_finite is not None:
        whole = _mesh_group(mesh, group)
        if whole.size > 1:
            check = ShardFiniteCheck(whole, zero)
            optimizer.register_step_pre_hook(check)
            object.__setattr__(optimizer, "plait_finite_check", check)
    return model, optimizer
