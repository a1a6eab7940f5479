"""The block exchange in buckets, each started during the last backward as soon as its
gradients are final, as plait's reproducible DDP overlaps its buckets with backward.

The flat vector the exchange adds (:mod:`.blocks`: the trainable parameters in
``module.parameters()`` order, then two extra elements, the block's loss sum and the
leader's mask of replacements) is cut into contiguous **buckets** of about ``bucket_mb``
MiB, walking the parameters in reverse (the order backward produces their gradients):
bucket 0 holds the last parameters and the two extra elements (known before backward
starts), the last bucket the first parameters.

During the backward of the last micro-batch of this member's last block (the only one
whose gradients are not final before it starts), a post-accumulate-grad hook per
parameter pushes the parameter's gradient into its :class:`~plait.strategies.
reproducible.tree.TreeSum` (the block's fixed in-block tree), writes the block's sum into
the bucket, and when every parameter of a bucket is in, and every bucket before it has
started, starts that bucket's :func:`~.blocks.start_block_exchange` on the generation's
group (asynchronous: the group's communication thread runs it while backward goes on).
:meth:`OverlappedExchange.finish` starts the buckets still waiting (a parameter that got
no gradient counts as zeros, as before) and waits for every bucket before the optimizer
steps. Buckets start in index order on every member, so their collectives are numbered
alike everywhere (a parameter unused on one member only delays the buckets after it).

Exactness: every element is still added along the same trees (the in-block
:class:`TreeSum` per parameter, then the tree over block index in the exchange), so the
bucketed, overlapped exchange gives the bits of the one exchange after backward.

Communication contract: per step, one ``all_reduce`` / ``tree_order/blocks`` per bucket
on the generation's group (point-to-point: the bytes of :func:`~.blocks.
block_tree_all_reduce` on the whole vector, in pieces), issued from the last backward in
bucket order, all waited for before the optimizer step; a failed bucket raises its
:class:`~plait.comm.errors.CollectiveError` from :meth:`OverlappedExchange.finish` (the
trainer heals, as for the exchange after backward).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from plait.comm.group import Group, Handle
from plait.heal.blocks import start_block_exchange
from plait.strategies.reproducible.tree import TreeSum

EXTRA = 2  # the loss sum and the mask of replacements, after the parameters
MIB = 1 << 20


@dataclass
class Bucket:
    """Elements ``lo .. hi - 1`` of the flat vector; the parameters (indices) in it."""

    index: int
    lo: int
    hi: int
    params: list[int]
    pending: int = 0


def plan(sizes: list[int], *, extra: int, bucket_elements: int) -> list[Bucket]:
    """Contiguous buckets of the flat vector of parameters of ``sizes`` elements (then
    ``extra``), in reverse parameter order, each at least one parameter and closed once it
    holds ``bucket_elements`` elements; bucket 0 ends with the ``extra`` elements."""
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    buckets: list[Bucket] = []
    hi, members, count = offsets[-1] + extra, [], extra
    for i in reversed(range(len(sizes))):
        members.append(i)
        count += sizes[i]
        if count >= bucket_elements:
            buckets.append(Bucket(len(buckets), offsets[i], hi, members))
            hi, members, count = offsets[i], [], 0
    if members or not buckets:
        buckets.append(Bucket(len(buckets), 0, hi, members))
    return buckets


@dataclass
class _Step:
    """One step's overlapped exchange in flight."""

    total: torch.Tensor  # the summed vector, written bucket by bucket
    last: torch.Tensor  # the last block's partial, filled by the hooks
    earlier: dict[int, torch.Tensor]  # this member's other blocks' partials (complete)
    block: int  # the last block's index
    sums: list[TreeSum]
    owned: dict[int, list[int]]
    world: int
    group: Group
    done: list[bool]
    launched: int = 0
    handles: list[Handle | None] = field(default_factory=list)


class OverlappedExchange:
    """The bucketed block exchange of one member's parameters (module docstring).
    ``params``: the trainable parameters (one dtype), in the flat vector's order;
    ``bucket_mb``: the bucket size in MiB (plait's DDP default: 25)."""

    def __init__(self, params: list[nn.Parameter], *, bucket_mb: float) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"healing: bucket_mb must be positive, got {bucket_mb}")
        self.params = params
        self.dtype = params[0].dtype
        self.device = params[0].device  # the buffers the buckets travel in live here
        self.sizes = [p.numel() for p in params]
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = self.offsets[-1] + EXTRA
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.buckets = plan(
            self.sizes, extra=EXTRA, bucket_elements=max(1, int(bucket_mb * MIB) // itemsize)
        )
        self.where = {i: b.index for b in self.buckets for i in b.params}
        self._step: _Step | None = None
        # (total, last), reused while steps succeed; dropped after a failed one, whose
        # abandoned buckets may still write into them
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._hook_for(i)) for i, p in enumerate(params)
        ]

    def arm(
        self,
        *,
        earlier: dict[int, torch.Tensor],
        block: int,
        sums: list[TreeSum],
        extra: torch.Tensor,
        owned: dict[int, list[int]],
        world: int,
        group: Group,
    ) -> None:
        """Before the backward of the last micro-batch of block ``block`` (this member's
        last): ``earlier``, the member's other blocks' flat partials; ``sums``, the last
        block's per-parameter accumulators holding its other micro-batches; ``extra``, its
        two extra elements."""
        if self._buffers is None:  # kept from step to step: no page faults per step
            self._buffers = (
                torch.empty(self.numel, dtype=self.dtype, device=self.device),
                torch.empty(self.numel, dtype=self.dtype, device=self.device),
            )
        total, last = self._buffers
        last[self.offsets[-1] :].copy_(extra)
        for b in self.buckets:
            b.pending = len(b.params)
        self._step = _Step(
            total=total,
            last=last,
            earlier=earlier,
            block=block,
            sums=sums,
            owned=owned,
            world=world,
            group=group,
            done=[False] * len(self.params),
        )
        self._launch_ready()  # a bucket of no parameters (the extra alone) starts now

    def _hook_for(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if self._step is not None:
                self._ready(i, p.grad)

        return hook

    def _ready(self, i: int, grad: torch.Tensor | None) -> None:
        step = self._step
        assert step is not None
        if step.done[i]:
            raise RuntimeError(
                f"healing: parameter {i} received its gradient twice in the last backward "
                f"of a step; run one backward per micro-batch"
            )
        step.done[i] = True
        acc = step.sums[i]
        acc.push(grad if grad is not None else torch.zeros_like(self.params[i]))
        step.last[self.offsets[i] : self.offsets[i + 1]].copy_(acc.result().reshape(-1))
        self.buckets[self.where[i]].pending -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        """Start, in index order, every bucket whose parameters are all in."""
        step = self._step
        assert step is not None
        while step.launched < len(self.buckets) and self.buckets[step.launched].pending == 0:
            b = self.buckets[step.launched]
            partials = {v: t[b.lo : b.hi] for v, t in step.earlier.items()}
            partials[step.block] = step.last[b.lo : b.hi]
            step.handles.append(
                start_block_exchange(
                    partials,
                    step.total[b.lo : b.hi],
                    owned=step.owned,
                    world=step.world,
                    group=step.group,
                    async_op=True,
                    label=f"bucket {b.index} of {len(self.buckets)}",
                )
            )
            step.launched += 1

    def finish(self) -> torch.Tensor:
        """After the last backward: the parameters without a gradient count as zeros, the
        remaining buckets start, and every bucket is waited for; returns the summed flat
        vector. Raises a bucket's :class:`~plait.comm.errors.CollectiveError`."""
        step = self._step
        assert step is not None
        try:
            for i, seen in enumerate(step.done):
                if not seen:
                    self._ready(i, None)
            for h in step.handles:
                if h is not None:
                    h.wait()
        except BaseException:
            self._buffers = None
            raise
        finally:
            self._step = None
        return step.total

    def disarm(self) -> None:
        """Forget a step that did not finish (its backward raised); a bucket in flight
        ends with the group (the trainer abandons it)."""
        self._step, self._buffers = None, None

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
