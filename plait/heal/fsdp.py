"""FSDP (ZeRO-3) under healing: the parameters are sharded too, each member keeps its own
chunk and a mirror of its ring neighbour's, so a dead member's chunk is still in live
memory.

The layout is :mod:`.zero`'s (``n`` members, member ``i`` owns chunk ``i`` of the flat
vector of the trainable parameters and mirrors chunk ``(i + 1) % n``; one optimizer of
the user's class per held chunk over a flat copy of it). What changes is where the
parameters live between steps: **nowhere but in the chunks**. After its chunks are made,
:class:`ShardedParams` frees the model's parameters (each one's storage resized to 0, as
plait's FSDP frees a unit's full buffer: the tensor object, its shape and the
optimizer's reference to it stay), so at rest a member holds ``2/n`` of the parameters,
``2/n`` of the optimizer state, and the copy of both made before the last step (as under
``zero=1``: a step is known complete everywhere only when the next exchange succeeds).
A parameter used while freed raises (its data is not allocated), never reads stale
values.

One step. By default (``HealingTrainer(zero=3)``, ``wrap="children"``) the parameters
are gathered **one unit at a time** (:mod:`.units`: each top-level module before its
forward and again before its backward, freed after each; every member runs as many rounds
of micro-batches as the member with the most blocks, idle where it has none, so the
gathers pair up after a death). With ``wrap=None`` the whole model is one unit:

1. :meth:`ShardedParams.unshard` at the step's start: every member sends its own chunk to
   the members that do not hold it (the neighbour that mirrors it has it already), point
   to point on the generation's group, counted as ``all_gather`` / ``heal/zero``:
   ``(n-2)/n`` of the parameters out and in per member. The storage is re-allocated and
   the full flat vector written into the model (the flat vector is freed then; zero=1/2
   keep theirs between steps). Per unit, the same messages restricted to the unit
   (``heal/zero_unit``), ``2U-1`` gathers per micro-batch.
2. The micro-batches of this member's blocks (the trainer), then
   :meth:`ShardedParams.exchange`: it frees the parameters (the backward is done), then
   adds the blocks' gradients in the fixed tree's order and gives each member only the
   two chunks it steps (**a reduce-scatter to own + mirror**): member ``i`` sends member
   ``j`` its blocks' pieces of chunk ``j``; ``j`` adds the ``W`` pieces in block order
   (:func:`~plait.strategies.reproducible.tree.tree_sum`, so the bits are one process's)
   and sends the summed chunk to its predecessor ``j - 1``, which mirrors it. Per member
   with one block each: ``(n-1)/n`` of the vector out, then ``1/n``: one vector in all,
   against ``2(n-1)/n`` for :func:`~.blocks.block_tree_all_reduce` (1.5 vectors at 4
   members). The two extra elements (the blocks' loss sum and the replacement mask) ride
   at the end of the last chunk; its owner sends them to every member that does not
   mirror it (two elements each). Counted as ``reduce_scatter`` /
   ``tree_order/blocks_mirror``. Without the tree (``reproducible=False``) the exchange
   is the all-reduce of the replicated path: every member receives the whole gradient.
3. :meth:`~.zero.ShardedState.step` steps the two chunks from their summed gradients;
   nothing is gathered after it (the next step's start gathers). The step is counted as
   done here, so a member whose next gather fails holds its chunks after the step; the
   members agree on the least completed step when healing and those ahead restore their
   copy (:meth:`~.zero.ShardedState.agree`).

Healing is :mod:`.zero`'s: the dead member's chunk and state come from its mirror, the
survivors re-shard to the new size (:meth:`~.zero.ShardedState.reshard`, which writes the
full parameters into the model for the moment: here they are freed again at once), a
replacement receives its chunks from the live holders, and two ring neighbours dying in
the same step lose a chunk (:class:`~.zero.StateLost`).

Peak memory in a step (:attr:`ShardedParams.peak` counts the parameters' part): per unit,
the largest unit (plus the root unit: the parameters in no unit, kept for the step);
with ``wrap=None`` the full parameters and the gather's flat vector (2x the parameters for
the moment of the gather). Either way the full gradients of the blocks being summed (the
tree's accumulators, as under ``zero=0/1``) and the exchange's vector: the gradients are
not reduce-scattered per unit (the exchange needs every block's whole sum after the last
backward). Per unit sends more: ``K * per * (2U-1)`` unit gathers per step against one
gather of the model (benchmarks/heal_fsdp.py).
Frozen parameters (``requires_grad=False``) and buffers stay replicated, in full, on
every member.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.comm import ops
from plait.comm.group import Channel, Group
from plait.heal.zero import ShardedState, bounds
from plait.strategies.reproducible.tree import tree_sum

EXTRA = 2  # the exchange's extra elements: the blocks' loss sum, the replacement mask


def spans(numel: int, n: int) -> list[tuple[int, int]]:
    """The ``n`` chunks of the exchange vector (``numel`` gradient elements and the
    :data:`EXTRA` ones): :func:`~.zero.bounds` of the gradient, the extras at the end of
    the last chunk."""
    out = bounds(numel, n)
    out[-1] = (out[-1][0], numel + EXTRA)
    return out


class ShardedParams(ShardedState):
    """This member's two chunks of the parameters and of the optimizer state; the model's
    parameters are freed between steps (module docstring). ``names``: the parameters'
    names, for the messages."""

    what = "the parameters and their optimizer state"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: list[nn.Parameter],
        *,
        names: dict[int, str] | None = None,
    ) -> None:
        super().__init__(optimizer, params)
        for p in params:
            whole = p.numel() * p.element_size()
            if p.storage_offset() or not p.is_contiguous() or p.untyped_storage().nbytes() != whole:
                name = (names or {}).get(id(p), f"of shape {list(p.shape)}")
                raise ValueError(
                    f"healing zero=3: parameter {name} is a view into a larger storage (or "
                    f"not contiguous); freeing it between steps would free its neighbours. "
                    f"Give each parameter its own storage, or use zero=1"
                )
        self.gathered = True  # the model holds its parameters until start() frees them
        self.peak = 0  # the most parameter bytes held at once since reset (note_peak)

    # --- the model's parameters: freed, gathered ---------------------------------------
    def free(self) -> None:
        """Free the model's parameters and gradients (storage resized to 0; local, no
        communication). Called after the step's chunks are stepped it also ends their
        pending state: the step counts as done there (module docstring, step 3)."""
        for p in self.params:
            p.grad = None
            p.untyped_storage().resize_(0)
        self.gathered, self.pending = False, False

    def _write(self, flat: torch.Tensor) -> None:
        for p in self.params:
            storage = p.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(p.numel() * p.element_size())
        super()._write(flat)
        self.gathered = True
        self.note_peak(extra=flat.untyped_storage().nbytes())
        self._flat_buffer = None  # not kept between steps (zero=1 keeps it): at rest 2/n

    def note_peak(self, *, extra: int = 0) -> None:
        """Raise :attr:`peak` to the parameter bytes the model's storages hold now, plus
        ``extra`` (a gather's buffer). Local."""
        self.peak = max(self.peak, held_bytes(self.params) + extra)

    def unshard(self, group: Group | None) -> None:
        """The full parameters into the model, from the members' chunks (module
        docstring, step 1); nothing if they are gathered already. Collective on
        ``group``: every member calls it at the same step."""
        if not self.gathered:
            self.gather(group)

    def start(self, members: tuple[int, ...], rank: int, number: int) -> None:
        super().start(members, rank, number)
        self.free()

    def reshard(
        self, group: Group, store: Any, *, holders: tuple[int, ...], old_gen: int, number: int
    ) -> None:
        super().reshard(group, store, holders=holders, old_gen=old_gen, number=number)
        self.free()

    # --- the exchange ------------------------------------------------------------------
    def exchange(
        self,
        partials: dict[int, torch.Tensor],
        *,
        owned: dict[int, list[int]],
        world: int,
        group: Group,
        exact: bool = True,
        summed: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Free the parameters, then sum the blocks' gradients (``partials``: this member's
        blocks, flat vectors of the gradient and the two extras). Returns a vector of that
        length in which this member's two chunks and the extras hold the sum (in the
        tree's order: one process's bits) and every other element is NaN: it is never
        read, and would show if it were. Collective on ``group`` (module docstring, step
        2). ``exact=False`` (the trainer's ``reproducible=False``): the sum in arrival
        order and an all-reduce, whole. ``summed``: called once this member's chunk is
        summed, before it goes to the mirror (the fault tests kill there)."""
        self.free()
        mine = sorted(partials)
        sample = partials[mine[0]]
        if not exact:
            total = partials[mine[0]].clone()
            for v in mine[1:]:
                total += partials[v]
            if group.size > 1:
                ops.all_reduce(total, group=group)
            return total
        if group.size == 1:
            return tree_sum([partials[v] for v in range(world)])
        members = group.ranks
        n = group.size
        cut = spans(self.numel, n)
        result = torch.full_like(sample, float("nan"))

        def body(ch: Channel) -> None:
            me = ch.rank
            got: dict[int, torch.Tensor] = {v: partials[v][slice(*cut[me])] for v in mine}
            bufs, pending = {}, []
            for p in range(n):
                if p == me:
                    continue
                theirs = sorted(owned[members[p]])
                size = len(theirs) * (cut[me][1] - cut[me][0])
                bufs[p] = (theirs, torch.empty(size, dtype=sample.dtype, device=sample.device))
                pending.append(ch.irecv(bufs[p][1], p))
                out = torch.cat([partials[v][slice(*cut[p])] for v in mine])
                pending.append(ch.isend(out, p))
            ch.wait(*pending)
            for theirs, buf in bufs.values():
                pieces = buf.split([buf.numel() // len(theirs)] * len(theirs))
                got.update(zip(theirs, pieces, strict=True))
            mine_summed = tree_sum([got[v] for v in range(world)])
            result[slice(*cut[me])].copy_(mine_summed)
            if summed is not None:
                summed()
            before, after = (me - 1) % n, (me + 1) % n
            pending = [ch.isend(mine_summed, before), ch.irecv(result[slice(*cut[after])], after)]
            last = n - 1  # the extras' chunk: its owner sends them to whoever lacks them
            if me == last:
                pending += [ch.isend(mine_summed[-EXTRA:], p) for p in range(n - 2)]
            elif after != last:
                pending.append(ch.irecv(result[-EXTRA:], last))
            ch.wait(*pending)

        nbytes = sample.numel() * sample.element_size()
        group.run(
            "reduce_scatter",
            "tree_order/blocks_mirror",
            body,
            async_op=False,
            payload_bytes=nbytes,
            signature=f"mirror blocks {str(sample.dtype)[6:]} bytes={nbytes}",
            desc=f"blocks {mine} of {world} to own + mirror chunks",
        )
        return result


def held_bytes(params: list[nn.Parameter]) -> int:
    """Bytes of the parameters' storages allocated now (a freed one counts 0). Local."""
    return sum(p.untyped_storage().nbytes() for p in params)


def sharded_state(
    zero: int, optimizer: torch.optim.Optimizer, module: nn.Module, params: list[nn.Parameter]
) -> ShardedState | None:
    """The trainer's sharded state for ``zero`` (0: none, the optimizer replicated)."""
    if zero == 3:
        names = {id(p): n for n, p in module.named_parameters()}
        return ShardedParams(optimizer, params, names=names)
    return ShardedState(optimizer, params) if zero else None
