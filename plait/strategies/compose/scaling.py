"""Loss scaling through PTD-P with :class:`plait.amp.DynamicLossScaler`, unchanged::

    scaler = plait.amp.DynamicLossScaler(init_scale=2.0**16)
    ptdp = compose(model, opt, mesh=mesh, scaler=scaler)
    opt = ptdp.optimizer
    loss = ptdp.step(x, y)          # backward of scale * loss; returns the unscaled loss
    ptdp.clip_grad_norm_(1.0)       # optional: unscales first (once)
    stepped = scaler.step(opt)      # unscale (unless clipping did), agree, step or skip

``ptdp.step`` multiplies every micro-batch's loss by ``scaler.scale_value``
(:func:`scaled_plan`, which also multiplies a loss that counts its items by the ranks its
gradients are averaged over; the MoE auxiliary losses alike, :mod:`.experts`). The scaler
finds the optimizer's ``unscale_grads_``, which :func:`install` points at
:func:`unscale`: the gradients are multiplied by ``1 / scale`` once per optimizer step (a
second call, e.g. clipping then ``scaler.step``, only returns the flag), and the found-inf
flag (1.0 when any gradient of any rank is inf or nan) is reduced with ``max`` over tp, pp,
ep and dp, so every rank of the mesh skips the same steps. The scaler then all-reduces the
flag once more over its own ``group`` (``None``: the world) and halves its scale on every
rank alike.

A power-of-two scale commutes exactly with floating-point arithmetic (away from overflow
and subnormals): when nothing overflows, the steps are those of the unscaled run.

Communication: one scalar all-reduce (max) per group of the mesh per optimizer step; under
ZeRO the optimizer's own ``unscale_grads_`` (the gradient reduce-scatter, which ``step``
then reuses, and one scalar all-reduce over dp).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from plait.comm import ops
from plait.comm.device import control_device
from plait.comm.group import Group

if TYPE_CHECKING:
    from plait.strategies.compose.ptdp import PTDP


class Unscaler:
    """The state of one optimizer step's unscaling (see the module docstring)."""

    def __init__(
        self,
        params: Callable[[], Sequence[torch.nn.Parameter]],
        *,
        groups: Sequence[Group],
        algorithm: str,
        sync: Callable[[], None],
        sharded: Callable[[float], torch.Tensor] | None,
    ) -> None:
        self.params = params
        self.groups = list(groups)
        self.algorithm = algorithm
        self.sync = sync
        self.sharded = sharded  # ZeroOptimizer.unscale_grads_ (the original), or None
        self.found: torch.Tensor | None = None  # set once this step's gradients are unscaled

    def reset(self) -> None:
        """A new optimizer step: the next :meth:`unscale` unscales again."""
        self.found = None

    @torch.no_grad()
    def unscale(self, inv_scale: float | torch.Tensor) -> torch.Tensor:
        """Multiply the gradients by ``inv_scale`` (once per optimizer step); the agreed
        found-inf flag (float32 scalar, 1.0 or 0.0, equal on every rank of the mesh).
        Collective over every group of the mesh."""
        if self.found is not None:
            return self.found
        self.sync()
        if self.sharded is not None:
            found = self.sharded(float(inv_scale)).to(torch.float32).reshape(())
        else:
            grads = [p.grad for p in self.params() if p.grad is not None]
            found = torch.zeros((), dtype=torch.float32, device=control_device(grads))
            for grad in grads:
                grad.mul_(inv_scale)
                # on the device: no host read per gradient (one per step, by the scaler)
                found = torch.maximum(found, (~torch.isfinite(grad)).any().to(torch.float32))
        for g in self.groups:
            if g.size > 1:
                ops.all_reduce(found, "max", group=g, algorithm=self.algorithm)
        self.found = found
        return found


def install(optimizer: torch.optim.Optimizer, unscaler: Unscaler) -> None:
    """Point ``optimizer.unscale_grads_`` (what :class:`plait.amp.DynamicLossScaler`
    calls) at ``unscaler`` and forget the unscaling after every ``step``."""

    def unscale_grads_(inv_scale: float | torch.Tensor) -> torch.Tensor:
        return unscaler.unscale(inv_scale)

    optimizer.unscale_grads_ = unscale_grads_  # type: ignore[attr-defined]

    def after_step(opt: Any, args: Any, kwargs: Any) -> None:
        unscaler.reset()

    optimizer.register_step_post_hook(after_step)


def scaled_plan(ptdp: PTDP, plan: Any) -> Any:
    """The pipeline plan with its loss multiplied by the loss scale (1 without a
    scaler). A loss that counts its items (``reduction="items"``, Hugging Face's
    ``num_items_in_batch``) divides by the items of the *global* batch, counted in
    :meth:`PTDP.step` (every rank holds it), and is multiplied by the number of replicas, so
    that averaging the replicas' gradients (``sync_gradients``) gives one process's
    mean even when ignored labels fall unevenly over the dp ranks (under cp: the
    plan's ``shifted_loss``, times the dp x cp ranks, :mod:`.context`)."""
    base = plan.loss
    if plan.reduction == "items":
        ptdp._count_items = plan.items
        if ptdp.sizes.cp > 1 and plan.shifts_labels:  # labels shifted by step (.context)
            base = plan.shifted_loss
        # every replica's (and cp rank's) sum over the global count, times the ranks
        # the gradients are averaged over
        ranks = ptdp.sizes.averaged

        def items_loss(y: torch.Tensor, target: torch.Tensor, *, num_items: Any) -> Any:
            loss = base(y, target, num_items=num_items)
            factor = ranks * ptdp._loss_scale
            return loss if factor == 1.0 else loss * factor

        return replace(plan, loss=items_loss, items=lambda _rows: ptdp._num_items)

    def mean_loss(y: torch.Tensor, target: torch.Tensor) -> Any:
        loss = base(y, target)
        return loss if ptdp._loss_scale == 1.0 else loss * ptdp._loss_scale

    return replace(plan, loss=mean_loss)
