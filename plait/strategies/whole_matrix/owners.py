"""Parameter ownership: each rank of a group steps whole parameters, the others none.

The ZeRO idea at parameter granularity. The parameters of a whole-matrix optimizer are
dealt to the ranks of the sharding group by size (:func:`ownership`: largest first, each to
the least loaded rank, ties to the lower rank: deterministic, printable as plain data).
The optimizer this rank gets back is the caller's class over *full-shape* tensors of the
parameters it owns (possibly none: empty groups keep the per-group hyper-parameters), so
its state (Muon's momentum, Adafactor's row and column statistics, a Shampoo
preconditioner) lives on the owner only.

A parameter's :class:`Slot` says where its pieces are on this rank. Around every
``optimizer.step()`` (a step pre-hook and a step post-hook):

1. collect: the parameter and its averaged gradient arrive whole on the owner;
2. the torch optimizer steps the owner's full tensors, exactly as one process would;
3. distribute: the owner broadcasts the updated parameter; every rank keeps its piece.

Communication contract (group ``G`` of ``n`` ranks, a parameter of ``N`` elements of ``b``
bytes, both hooks on every rank of ``G`` in the same order, blocking up to ``G``'s
timeout; ``step()`` is therefore a collective):

- :class:`ReplicatedSlot` (ZeRO-1/2: every rank holds the parameter and its local
  gradient): one ``reduce`` (avg) of the gradient to the owner, ``N·b``, then one
  ``broadcast`` of the parameter from the owner, ``N·b``;
- :class:`FlatSlot` (FSDP: the parameter is a range of a unit's flat buffer, split over
  the ranks; averaged gradient shards after backward): one ``reduce`` (sum) of a
  ``2N``-element buffer holding this rank's piece of the parameter and of its gradient
  (zeros elsewhere: the sum is exact) to the owner, ``2N·b``, then one ``broadcast`` of
  the parameter, ``N·b``; each rank copies its range into its shard.
- :class:`SlicedSlot` (tensor parallelism: the parameter is cut along one dimension over
  the tensor-parallel group, each rank holding its slice's full gradient): the same
  ``2N``-element reduce and ``N``-element broadcast, on the tensor-parallel group.

So a rank sends about ``N·b`` (replicated) or ``2N·b`` (sharded) per parameter per step with
the tree and ring algorithms, against ``2(n-1)/n·N·b`` for the all-reduce of DDP; the
owner holds the state of its parameters only (about ``1/n`` of the total when they
balance) and, transiently during its step, their full parameter and gradient.

Gradients are consumed by the step: after it a non-owner's (and, for a sharded layout,
every rank's) local gradient of these parameters is ``None``; a parameter without a
gradient on a rank counts as a zero gradient there (as under ZeRO).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait import comm
from plait.comm.group import Group


def ownership(numels: Sequence[int], size: int) -> list[int]:
    """The owning rank of each parameter: largest first (ties by position), each to the
    least loaded rank so far (ties to the lower rank). Plain data, no communication."""
    load = [0] * size
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += numels[i]
    return owners


@dataclass(frozen=True)
class OwnershipPlan:
    """Who steps what: ``names[i]`` (``numels[i]`` elements) is stepped by group rank
    ``owners[i]`` of a group of ``size`` ranks."""

    names: tuple[str, ...]
    numels: tuple[int, ...]
    owners: tuple[int, ...]
    size: int

    def loads(self) -> list[int]:
        """Elements owned per rank (the optimizer state scales with it)."""
        out = [0] * self.size
        for n, r in zip(self.numels, self.owners, strict=True):
            out[r] += n
        return out

    def describe(self) -> str:
        lines = [
            f"whole-matrix ownership over {self.size} ranks (elements per rank: {self.loads()})"
        ]
        for name, n, r in zip(self.names, self.numels, self.owners, strict=True):
            lines.append(f"  rank {r}: {name} ({n} elements)")
        return "\n".join(lines)


class Slot:
    """Where one whole-matrix parameter's pieces live on this rank."""

    name: str
    shape: torch.Size
    dtype: torch.dtype

    def master_device(self) -> torch.device:
        raise NotImplementedError

    def collect(self, owner: int, group: Group, master: nn.Parameter | None) -> None:
        """Collective: ``master`` (owner only) gets the parameter and its gradient."""
        raise NotImplementedError

    def distribute(self, owner: int, group: Group, master: nn.Parameter | None) -> None:
        """Collective: the owner's updated ``master`` back into every rank's piece."""
        raise NotImplementedError


class ReplicatedSlot(Slot):
    """A parameter every rank of the group holds whole, with its local gradient: the
    master is the parameter itself (on its owner)."""

    def __init__(self, name: str, param: nn.Parameter) -> None:
        self.name, self.param = name, param
        self.shape, self.dtype = param.shape, param.dtype

    def master_device(self) -> torch.device:
        return self.param.device

    def collect(self, owner: int, group: Group, master: nn.Parameter | None) -> None:
        p = self.param
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        grad = grad.detach().as_subclass(torch.Tensor).contiguous()
        comm.reduce(grad, owner, "avg", group=group)
        p.grad = grad if group.rank == owner else None

    def distribute(self, owner: int, group: Group, master: nn.Parameter | None) -> None:
        with torch.no_grad():
            comm.broadcast(self.param.data, owner, group=group)


class AveragedSlot(ReplicatedSlot):
    """A parameter every rank of the group holds whole with the same gradient, already
    averaged over the group by the strategy (PTD-P's all-reduce over dp): the owner steps
    it, the others drop their gradient; nothing is communicated before the step, the
    parameter is broadcast from its owner after it (``N·b``)."""

    def collect(self, owner: int, group: Group, master: nn.Parameter | None) -> None:
        if group.rank != owner:
            self.param.grad = None


class KeptSlot(Slot):
    """A parameter every rank of the group holds whole with the same, already complete
    gradient (a norm's weight under tensor parallelism): every rank steps it, the same
    step; nothing is communicated."""

    everywhere = True

    def __init__(self, name: str, param: nn.Parameter) -> None:
        self.name, self.param = name, param
        self.shape, self.dtype = param.shape, param.dtype

    def master_device(self) -> torch.device:
        return self.param.device

    def collect(self, owner: int, group: Group, master: nn.Parameter | None) -> None:
        return None

    def distribute(self, owner: int, group: Group, master: nn.Parameter | None) -> None:
        return None


class _PiecewiseSlot(Slot):
    """A parameter split over the group: each rank holds a piece of it and of its
    gradient. Subclasses say how a full tensor maps to this rank's piece."""

    device: torch.device  # where the collectives run

    def read(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This rank's pieces of the parameter and of its gradient (None: no gradient)."""
        raise NotImplementedError

    def place(self, buffer: torch.Tensor, piece: torch.Tensor) -> None:
        """Copy ``piece`` where it belongs in ``buffer`` (a zero tensor of the full shape)."""
        raise NotImplementedError

    def write(self, full: torch.Tensor) -> None:
        """Copy this rank's piece of the full parameter ``full`` into its storage, drop the
        consumed gradient."""
        raise NotImplementedError

    def collect(self, owner: int, group: Group, master: nn.Parameter | None) -> None:
        buffer = torch.zeros((2, *self.shape), dtype=self.dtype, device=self.device)
        param, grad = self.read()
        if param is not None:
            self.place(buffer[0], param.to(self.device))
        if grad is not None:
            self.place(buffer[1], grad.to(self.device))
        comm.reduce(buffer, owner, "sum", group=group)
        if master is not None:
            with torch.no_grad():
                master.copy_(buffer[0])
            master.grad = buffer[1].to(master.device, copy=True)

    def distribute(self, owner: int, group: Group, master: nn.Parameter | None) -> None:
        if master is not None:
            full = master.detach().to(self.device, copy=True)
            master.grad = None  # the full gradient lives only for the step
        else:
            full = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        comm.broadcast(full, owner, group=group)
        self.write(full)


class FlatSlot(_PiecewiseSlot):
    """Parameter ``index`` of an FSDP unit: elements ``[offset, offset + N)`` of the
    unit's padded flat buffer, of which this rank holds ``unit.shard_range()``."""

    def __init__(self, name: str, unit: Any, index: int) -> None:
        self.name, self.unit, self.index = name, unit, index
        self.shape, self.dtype = unit.shapes[index], unit.shard.dtype
        self.offset = sum(unit.numels[:index])
        self.numel = unit.numels[index]
        self.device = unit.config.compute_device

    def master_device(self) -> torch.device:
        return self.unit.shard.device

    def _overlap(self) -> tuple[int, int, int]:
        """(start in the parameter, start in the shard, length) of this rank's piece."""
        start, end = self.unit.shard_range()
        lo, hi = max(start, self.offset), min(end, self.offset + self.numel)
        return lo - self.offset, lo - start, max(0, hi - lo)

    def read(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        at, there, n = self._overlap()
        shard = self.unit.shard
        grad = shard.grad
        param = shard.detach()[there : there + n]
        piece = None if grad is None else grad.detach().as_subclass(torch.Tensor)[there : there + n]
        return param, piece

    def place(self, buffer: torch.Tensor, piece: torch.Tensor) -> None:
        at, _, n = self._overlap()
        buffer.reshape(-1)[at : at + n] = piece

    def write(self, full: torch.Tensor) -> None:
        at, there, n = self._overlap()
        shard = self.unit.shard
        with torch.no_grad():
            shard[there : there + n] = full.reshape(-1)[at : at + n].to(shard.device)
        shard.grad = None


class SlicedSlot(_PiecewiseSlot):
    """A tensor-parallel parameter: this rank's ``param`` is slice ``rank`` of the full one
    cut along ``dim`` into ``sizes`` (one per rank of the tensor-parallel group)."""

    def __init__(
        self, name: str, param: nn.Parameter, *, dim: int, sizes: Sequence[int], rank: int
    ) -> None:
        self.name, self.param, self.dim, self.sizes, self.rank = name, param, dim, sizes, rank
        shape = list(param.shape)
        shape[dim] = sum(sizes)
        self.shape, self.dtype, self.device = torch.Size(shape), param.dtype, param.device
        self.start = sum(sizes[:rank])

    def master_device(self) -> torch.device:
        return self.param.device

    def read(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        p = self.param
        return p.detach(), None if p.grad is None else p.grad.detach()

    def place(self, buffer: torch.Tensor, piece: torch.Tensor) -> None:
        buffer.narrow(self.dim, self.start, self.sizes[self.rank]).copy_(piece)

    def write(self, full: torch.Tensor) -> None:
        with torch.no_grad():
            self.param.copy_(full.narrow(self.dim, self.start, self.sizes[self.rank]))
        self.param.grad = None


def own(
    optimizer: torch.optim.Optimizer,
    slots: Sequence[Sequence[Slot]],
    group: Group,
    *,
    constructor: dict[str, Any],
    before: Sequence[Callable[[], None]] = (),
    after: Sequence[Callable[[], None]] = (),
) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class over the full-shape masters of the
    parameters this rank owns: ``slots[g]`` are the parameters of ``optimizer``'s group
    g (every group kept, with all its entries, even when this rank owns none of it), and
    the step hooks that collect and distribute around each step (module docstring).
    ``constructor``: the keywords the class's constructor takes; ``before`` / ``after``:
    called first in the pre-hook and last in the post-hook (a strategy's gradient
    average, an inner level of ownership). Collective only in ``step()``; the plan is
    ``result.plait_ownership``."""
    flat = [s for group_slots in slots for s in group_slots]
    dealt = [s for s in flat if not isinstance(s, KeptSlot)]
    dealt_owners = iter(ownership([s.shape.numel() for s in dealt], group.size))
    owners = [group.rank if isinstance(s, KeptSlot) else next(dealt_owners) for s in flat]
    masters: list[nn.Parameter | None] = []
    for slot, owner in zip(flat, owners, strict=True):
        if owner != group.rank:
            masters.append(None)
        elif isinstance(slot, (ReplicatedSlot, KeptSlot)):
            masters.append(slot.param)
        else:
            masters.append(
                nn.Parameter(torch.zeros(slot.shape, dtype=slot.dtype, device=slot.master_device()))
            )
    groups, k = [], 0
    for g, group_slots in enumerate(slots):
        mine = [m for m in masters[k : k + len(group_slots)] if m is not None]
        k += len(group_slots)
        hyper = {key: v for key, v in optimizer.param_groups[g].items() if key != "params"}
        groups.append({**hyper, "params": mine})
    rebuilt = type(optimizer)(groups, **constructor)
    pairs = [
        (s, o, m)
        for s, o, m in zip(flat, owners, masters, strict=True)
        if not isinstance(s, KeptSlot)
    ]

    collected = [False]  # collected before the step (a global clip): the pre-hook skips

    def gather() -> None:
        if collected[0]:
            return
        for f in before:
            f()
        for slot, owner, master in pairs:
            slot.collect(owner, group, master)
        collected[0] = True

    def collect(opt: Any, args: Any, kwargs: Any) -> None:
        gather()

    def distribute(opt: Any, args: Any, kwargs: Any) -> None:
        collected[0] = False
        for slot, owner, master in pairs:
            slot.distribute(owner, group, master)
        for f in after:
            f()

    zero_grad = rebuilt.zero_grad

    def forget_and_zero(set_to_none: bool = True) -> None:
        collected[0] = False
        zero_grad(set_to_none)

    rebuilt.zero_grad = forget_and_zero  # type: ignore[method-assign]
    # the collect step on its own, before step() (plait.clip_grad_norm_ over several
    # optimizers: the owners then hold the averaged gradients it measures and scales)
    object.__setattr__(rebuilt, "plait_collect", gather)

    rebuilt.register_step_pre_hook(collect)
    rebuilt.register_step_post_hook(distribute)
    plan = OwnershipPlan(
        tuple(s.name for s, _, _ in pairs),
        tuple(s.shape.numel() for s, _, _ in pairs),
        tuple(o for _, o, _ in pairs),
        group.size,
    )
    object.__setattr__(rebuilt, "plait_ownership", plan)
    object.__setattr__(rebuilt, "plait_slots", pairs)
    object.__setattr__(rebuilt, "plait_group", group)
    # for the whole state dict (state.py): every parameter, a kept one read from rank 0
    everything = [
        (s, 0 if isinstance(s, KeptSlot) else o, m)
        for s, o, m in zip(flat, owners, masters, strict=True)
    ]
    object.__setattr__(rebuilt, "plait_state_slots", everything)
    object.__setattr__(rebuilt, "plait_group_sizes", [len(gs) for gs in slots])
    return rebuilt
