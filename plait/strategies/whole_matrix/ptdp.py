"""``plait.prepare(model, [muon, adamw], strategy="ptdp", mesh=..., zero=...)``: several
optimizers, whole-matrix ones among them, under PTD-P with tensor parallelism and/or
ZeRO over dp.

PTD-P is built on a *carrier*: a plain ``torch.optim.SGD`` holding every group of every
given optimizer (``lr=0``; the user never steps it, it is ``ptdp.optimizer``), always with
``zero=0``. So PTD-P does what it does for one optimizer: cuts the model over tp and pp,
runs the pipeline, and averages this rank's gradients over dp with one all-reduce
(:func:`~plait.strategies.compose.gradients.sync_gradients`); ``clip_grad_norm_`` and the
non-finite check see the averaged gradients. Each given optimizer is then re-created over
this rank's pieces of its own parameters (the carrier's local groups, by dense name) and:

- with ``tp`` > 1, a whole-matrix one is stepped by ownership over the tensor-parallel
  group on the full matrices (:func:`~plait.strategies.whole_matrix.tensor.tensor_slots`:
  one ``reduce`` of ``2N`` elements to the owner, one ``broadcast`` of ``N`` back);
- with ``zero`` = 1 or 2 and ``dp`` > 1, every optimizer's state is split over dp at
  parameter granularity: each dp rank owns whole parameters (balanced by size) and steps
  them; the gradients are already averaged, so nothing moves before the step and the
  owner broadcasts each parameter over dp after it (``N`` elements;
  :class:`~plait.strategies.whole_matrix.owners.AveragedSlot`). With both, the tp level
  runs inside the dp level: the tp owners of a matrix (one per dp replica, the same
  matrices on each) gather it over tp, its dp owner steps it and broadcasts it over dp,
  then the tp owners send the slices back.

Per optimizer step, on top of PTD-P's forward, backward and dp all-reduce (``2(dp-1)/dp``
of the gradients): with ``tp`` > 1, ``2N·b`` reduced and ``N·b`` broadcast over tp per
whole-matrix parameter; with ZeRO, ``N·b`` broadcast over dp per parameter. ZeRO here
keeps the parameters and gradients whole on every dp replica (ZeRO-1's memory: the state
over dp); ``zero=2`` is taken as ``zero=1`` (the gradient of every parameter is needed
for the all-reduce). Refused, by name: a loss ``scaler``, ``reproducible=True``,
``check_finite="skip"`` (a skipped step must leave every owner's state alone), and PTD-P's
``state_dict`` / ``save`` / ``load`` (they know one optimizer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from plait.strategies.whole_matrix.owners import AveragedSlot, Slot, own
from plait.strategies.whole_matrix.tensor import tensor_slots

Optimizer = torch.optim.Optimizer


def _refuse(why: str) -> None:
    raise ValueError(f"plait.prepare(strategy='ptdp') with several optimizers: {why}")


def prepare_ptdp_optimizers(
    run: Callable[..., tuple[Any, Optimizer | None]],
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    whole: Sequence[bool],
    options: dict[str, Any],
    *,
    constructor: Callable[[Optimizer], dict[str, Any]],
) -> tuple[Any, list[Optimizer]]:
    """PTD-P on a carrier, then one optimizer per given optimizer, in order (module
    docstring). Collective over the mesh."""
    if options.get("scaler") is not None:
        _refuse("a loss scaler is not supported yet (it skips steps on inf over one optimizer)")
    if options.get("reproducible"):
        _refuse("reproducible=True is not supported (one optimizer step per tree)")
    if options.get("check_finite", "raise") == "skip":
        _refuse("check_finite='skip' is not supported; use 'raise' or None")
    zero = options.get("zero", 0)
    if zero not in (0, 1, 2):
        _refuse(f"zero={zero}; use 0, 1 or 2")
    names = {id(p): n for n, p in model.named_parameters()}
    dense = [
        [[names[id(p)] for p in g["params"] if id(p) in names] for g in o.param_groups]
        for o in optimizers
    ]
    carrier = torch.optim.SGD(
        [{"params": g["params"], "lr": 0.0} for o in optimizers for g in o.param_groups],
        lr=0.0,
    )
    ptdp, _ = run(model, carrier, **{**options, "zero": 0})
    position = {ptdp.aliases.get(c.name, c.name): c.param for c in ptdp.counted}
    tp, dp = ptdp.tp_group, ptdp.dp_group
    stages = list(ptdp.pipe.stages.values())
    dense_names = {id(c.param): c.name for c in ptdp.counted}
    nested = bool(zero) and dp.size > 1

    def sync() -> None:
        ptdp.sync_gradients()
        if ptdp.check_finite is not None:
            ptdp._check_finite()

    out: list[Optimizer] = []
    for o, w, groups in zip(optimizers, whole, dense, strict=True):
        local = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [position[n] for n in group_names if n in position],
            }
            for g, group_names in zip(o.param_groups, groups, strict=True)
        ]
        new = type(o)(local, **constructor(o))
        inner: Optimizer | None = None
        if w and tp.size > 1:
            slots, _ = tensor_slots(model, new, roots=stages, names=dense_names)
            hooks = [] if nested else [sync]  # nested: the dp level calls it
            inner = own(new, slots, tp, constructor=constructor(o), before=hooks)
            new = inner
        if nested:
            by_name = {**dense_names, **_names(new)}
            averaged: list[list[Slot]] = [
                [AveragedSlot(by_name.get(id(p), "?"), p) for p in g["params"]]
                for g in new.param_groups
            ]
            before = [sync] + ([_collect(inner)] if inner is not None else [])
            after = [_distribute(inner)] if inner is not None else []
            new = own(new, averaged, dp, constructor=constructor(o), before=before, after=after)
        elif inner is None:
            new.register_step_pre_hook(lambda *_: sync())
        _forget_with(new, ptdp.optimizer)
        out.append(new)
    for method in ("state_dict", "load_state_dict", "save", "load"):
        setattr(ptdp, method, _refused_state(method, optimizers))
    return ptdp, out


def _refused_state(method: str, optimizers: Sequence[Optimizer]) -> Callable[..., Any]:
    """PTD-P's own state functions read its one optimizer, here the carrier: refused."""
    kinds = ", ".join(type(o).__name__ for o in optimizers)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"ptdp.{method}: this PTD-P steps several optimizers ({kinds}), and its "
            f"checkpoint functions know one; save ptdp.full_state_dict() for the model and "
            f"each optimizer's state yourself, or use one optimizer"
        )

    return refuse


def _names(optimizer: Optimizer) -> dict[int, str]:
    """The name of each parameter of an ownership-stepped optimizer (its masters)."""
    return {
        id(m): s.name for s, _, m in getattr(optimizer, "plait_state_slots", []) if m is not None
    }


def _collect(inner: Optimizer) -> Callable[[], None]:
    def run() -> None:
        for slot, owner, master in inner.plait_slots:  # type: ignore[attr-defined]
            slot.collect(owner, inner.plait_group, master)  # type: ignore[attr-defined]

    return run


def _distribute(inner: Optimizer) -> Callable[[], None]:
    def run() -> None:
        for slot, owner, master in inner.plait_slots:  # type: ignore[attr-defined]
            slot.distribute(owner, inner.plait_group, master)  # type: ignore[attr-defined]

    return run


def _forget_with(optimizer: Optimizer, carrier: Optimizer) -> None:
    """``optimizer.zero_grad`` also zeroes through the carrier (every local gradient, and
    PTD-P forgets its pending steps)."""
    own_zero = optimizer.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        carrier.zero_grad(set_to_none)
        own_zero(set_to_none)

    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
