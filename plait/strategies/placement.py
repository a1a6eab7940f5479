"""Where a parameter lives across ranks, so that global quantities count each element once.

A model-parallel strategy changes what a rank holds: tensor parallelism leaves a slice of a
weight on each rank of ``tp`` and a whole copy of a LayerNorm on each; a pipeline leaves
each stage's parameters on one rank of ``pp``; expert parallelism leaves each expert on one
rank of ``ep``; data parallelism copies everything over ``dp``. Quantities over the whole
model (the gradient norm for clipping, a check that replicas agree) must then add the
pieces and count the copies once. Each strategy records this on the parameters it places:

=============  ======================================================================
``shard``      groups over which ranks hold *different* elements (slices of one tensor,
               or different tensors: stages, experts); their contributions add
``replicate``  groups over which ranks hold *identical* copies; counted once, by the
               rank at index 0 of each such group
=============  ======================================================================

Strategies compose by adding groups: ``place(p, shard=(tp,))`` by tensor parallelism, then
``place(p, shard=(pp,))`` by the pipeline and ``place(p, replicate=(dp,))`` by data
parallelism leave ``Placement(shard=(tp, pp), replicate=(dp,))``. A parameter no strategy
placed is local (a plain single-process model): :func:`grad_norm` refuses a model where
some parameters are placed and others are not, naming the first one left out, because
counting it on every rank (or on one) would be a silent guess.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from plait.comm import ops
from plait.comm.device import control_device
from plait.comm.group import Group

_ATTR = "_plait_placement"


@dataclass(frozen=True)
class Placement:
    """The groups a parameter is split over (``shard``) and copied over (``replicate``)."""

    shard: tuple[Group, ...] = ()
    replicate: tuple[Group, ...] = ()

    @property
    def counted(self) -> bool:
        """This rank's copy is the one counted (index 0 in every replicating group)."""
        return all(g.rank == 0 for g in self.replicate)

    def describe(self) -> str:
        """``shard over tp(2), pp(2); replicate over dp(2)`` for messages."""
        parts = []
        if self.shard:
            parts.append("shard over " + ", ".join(f"{g.name}({g.size})" for g in self.shard))
        if self.replicate:
            parts.append(
                "replicate over " + ", ".join(f"{g.name}({g.size})" for g in self.replicate)
            )
        return "; ".join(parts) or "local"


def _add(have: tuple[Group, ...], new: Sequence[Group | None]) -> tuple[Group, ...]:
    out = list(have)
    for g in new:
        if g is not None and g.size > 1 and all(g is not h for h in out):
            out.append(g)
    return tuple(out)


def place(
    param: torch.Tensor,
    *,
    shard: Sequence[Group | None] = (),
    replicate: Sequence[Group | None] = (),
) -> Placement:
    """Record that ``param`` is split over ``shard`` and copied over ``replicate`` (added to
    what earlier strategies recorded; groups of one rank and ``None`` are ignored)."""
    old: Placement = getattr(param, _ATTR, Placement())
    new = Placement(shard=_add(old.shard, shard), replicate=_add(old.replicate, replicate))
    both = [g for g in new.shard if any(g is h for h in new.replicate)]
    if both:
        raise ValueError(
            f"a parameter of shape {tuple(param.shape)} is placed both split and copied over "
            f"group {both[0].name!r}; a strategy placed it twice"
        )
    setattr(param, _ATTR, new)
    return new


def copies_of_placed(params: Iterable[torch.Tensor], group: Group) -> None:
    """A data-parallel wrapper over a model another strategy already placed (tensor or
    pipeline parallelism inside DDP): its parameters are also copied over ``group``, so a
    global norm counts them once, not once per replica. A model no strategy placed stays
    local (its norm needs no communication: every replica holds the averaged gradient)."""
    params = list(params)
    if is_placed(params):
        for p in params:
            place(p, replicate=(group,))


def placement(param: torch.Tensor) -> Placement | None:
    """What :func:`place` recorded on ``param``, or None for a local parameter."""
    return getattr(param, _ATTR, None)


def is_placed(params: Iterable[torch.Tensor]) -> bool:
    """Any parameter of ``params`` was placed by a strategy."""
    return any(placement(p) is not None for p in params)


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor: a strategy's guarded gradient (FSDP's shard gradient refuses
    norms so that a per-rank norm is never taken by mistake) read for the global one."""
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor)


def grad_norm(
    named: Sequence[tuple[str, torch.Tensor]],
    norm_type: float = 2.0,
    *,
    group: Group,
) -> torch.Tensor:
    """The norm of the whole model's gradient, the same on every rank of ``group``.

    Each rank adds ``|g|^p`` of the gradients it counts (every element once over the
    model: pieces of a split parameter add, a copy counts on the rank at index 0 of each
    replicating group); the sum (``max`` for ``inf``) is all-reduced over ``group``, which
    must hold every rank of the model (the mesh's world). Computed in the gradients'
    precision (float64 when they are float64, else float32). Collective: one all-reduce of
    one element over ``group``.
    """
    if norm_type <= 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be positive, got {norm_type}")
    infinite = math.isinf(norm_type)
    grads = [(n, p) for n, p in named if p.grad is not None]
    # the gradients' precision, never below float32 (bf16 sums of many squares lose digits)
    wide = any(p.grad is not None and p.grad.dtype == torch.float64 for _, p in grads)
    dtype = torch.float64 if wide else torch.float32
    total = torch.zeros((), dtype=dtype, device=control_device(p.grad for _, p in grads))
    for name, p in named:
        where = placement(p)
        if where is None:
            raise ValueError(
                f"clip_grad_norm_: parameter {name!r} was placed by no strategy while others "
                f"were; every parameter of a model-parallel model must come from the strategy "
                f"(build the optimizer and the clipping call on the prepared model's "
                f"parameters)"
            )
        if p.grad is None or not where.counted or p.grad.numel() == 0:
            continue
        g = plain(p.grad).detach().to(dtype)
        if infinite:
            total = torch.maximum(total, g.abs().max())
        else:
            total = total + torch.linalg.vector_norm(g, norm_type).pow(norm_type)
    ops.all_reduce(total, "max" if infinite else "sum", group=group)
    return total if infinite else total.pow(1.0 / norm_type)
