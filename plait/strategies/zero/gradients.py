"""This rank's averaged gradient shard under ZeRO-1/2, and how it is produced.

:class:`ShardGradients` owns the gradient side of a :class:`ZeroOptimizer`: the backward
hooks, the bucketed reduce-scatters (stage 1 in ``step()``, stage 2 during backward), the
``.grad`` guards of :mod:`plait.strategies.zero.guard`, and what is computed on the
averaged shard before a step: the global gradient norm (clipping) and the found-inf check
of loss scaling. Communication as in :mod:`plait.strategies.zero`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from plait import comm
from plait.comm.group import Handle
from plait.strategies.reproducible.collectives import tree_reduce_scatter
from plait.strategies.zero.guard import (
    GuardedGrad,
    ShardedGradientError,
    local_guard,
    placeholder_guard,
    real,
)
from plait.strategies.zero.partition import PartitionBucket

if TYPE_CHECKING:
    from plait.strategies.zero.optimizer import ZeroOptimizer


@dataclass
class _Reduction:
    """One launched reduce-scatter: ``out`` holds this rank's block, the concatenation of
    its ``pieces`` (flat ``[start, stop)``); ``direct``: ``out`` is already a view of the
    gradient shard."""

    handle: Handle | None
    packed: list[torch.Tensor]  # every rank's block, alive until the collective is done
    out: torch.Tensor
    pieces: list[tuple[int, int]]
    accumulate: bool
    direct: bool
    traced: Callable[[], None]


def join(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """``parts`` as one flat tensor: the part itself when there is one (no copy)."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return like.new_empty(0)
    return torch.cat(parts)


def _nothing() -> None:
    pass


class ShardGradients:
    """The averaged gradient of ``opt``'s range (``flat``, None when cleared), with one view
    per param group on the local optimizer's parameters (``opt.shards[g].grad``)."""

    def __init__(self, opt: ZeroOptimizer) -> None:
        self.opt = opt
        self.flat: torch.Tensor | None = None
        self.pending: list[_Reduction] = []
        self.reduced = False  # stage 1: flat is already this backward's average
        self._in_backward = False
        self._ready: list[bool] = []
        self._waiting: list[int] = []
        self._launched = 0
        self._accumulate = False
        self._backward_token: int | None = None
        self.hooks: list[Any] = [p.register_hook(self._make_pre_hook()) for p in opt._params]
        if opt.stage == 2:
            self.hooks += [
                p.register_post_accumulate_grad_hook(self._make_hook(i))
                for i, p in enumerate(opt._params)
            ]

    def set(self, flat: torch.Tensor | None) -> None:
        """Make ``flat`` the gradient shard, and its per-group views the local gradients."""
        self.flat = flat
        for (a, b), s in zip(self.opt._local, self.opt.shards, strict=True):
            s.grad = None if flat is None else flat[a:b]

    # --- reduce-scatter ------------------------------------------------------------------
    def _trace(self, label: str, nbytes: int, handle: Handle | None) -> Callable[[], None]:
        return trace_span(self.opt, label, nbytes, handle)

    def _launch(self, bucket: PartitionBucket, accumulate: bool) -> None:
        """Cut the bucket's gradients (zeros where none) into every rank's block and start
        the reduce-scatter."""
        opt = self.opt
        flats: dict[int, torch.Tensor] = {}
        for i in bucket.params:
            p = opt._params[i]
            g = p.grad
            flats[i] = real(g).reshape(-1) if g is not None else p.new_zeros(p.numel())
        offsets, like = opt._offsets, flats[bucket.params[0]]
        blocks = [
            join([flats[i][a - offsets[i] : b - offsets[i]] for i, a, b in pieces], like)
            for pieces in bucket.pieces
        ]
        rank = opt.group.rank
        mine = [(a - opt.lo, b - opt.lo) for _, a, b in bucket.pieces[rank]]
        flat = self.flat
        assert flat is not None
        span = bucket.contiguous(rank)
        direct = not accumulate and span is not None and flat.dtype == blocks[rank].dtype
        if direct and span is not None:
            out = flat[span[0] - opt.lo : span[1] - opt.lo]
        else:
            out = blocks[rank].new_empty(bucket.sizes[rank])
        tree = opt.microbatches
        if tree is not None:
            tree.check_driven("ZeroOptimizer")
        if tree is None:
            handle = comm.reduce_scatter(
                out, blocks, "avg", group=opt.group, algorithm=opt.algorithm, async_op=True
            )
        elif not tree.final:
            return  # reproducible: a micro-batch before the last; its runner sums it locally
        else:
            handle = tree_reduce_scatter(
                out, blocks, group=opt.group, algorithm=opt.algorithm, async_op=True
            )
        nbytes = bucket.numel * blocks[rank].element_size()
        traced = self._trace(f"reduce_scatter bucket {bucket.index}", nbytes, handle)
        self.pending.append(_Reduction(handle, blocks, out, mine, accumulate, direct, traced))

    def wait(self) -> None:
        """Wait for every launched reduce-scatter and put its result into ``flat``."""
        pending, self.pending = self.pending, []
        flat = self.flat
        for red in pending:
            if red.handle is not None:
                red.handle.wait()
            red.traced()
            if red.direct:
                continue
            assert flat is not None
            offset = 0
            for a, b in red.pieces:
                source = red.out[offset : offset + b - a]
                offset += b - a
                if red.accumulate:
                    flat[a:b].add_(source)
                else:
                    flat[a:b].copy_(source)

    def averaged(self) -> bool:
        """Make ``flat`` this rank's averaged gradient shard; False if there is none.

        Stage 1: reduce-scatter the full gradients (once per backward: clipping, unscaling
        and ``step`` share it). Stage 2: wait for the backward's reduce-scatters.
        """
        opt = self.opt
        if opt.stage == 2:
            self.wait()
            return self.flat is not None
        if self.reduced:
            return True
        if all(p.grad is None for p in opt._params):
            return False
        if self.flat is None:
            self.set(torch.empty_like(opt.shard))
        for bucket in opt._buckets:
            self._launch(bucket, accumulate=False)
        self.wait()
        self.reduced = True
        return True

    # --- backward hooks --------------------------------------------------------------------
    def _make_pre_hook(self) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if not self._in_backward:
                self._start_backward()

        return hook

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if not self._ready[index]:
                self._ready[index] = True
                self._waiting[self.opt._bucket_of[index].index] -= 1
                self._launch_ready()

        return hook

    def _start_backward(self) -> None:
        """First gradient of a backward, before autograd accumulates it."""
        opt = self.opt
        self._in_backward = True
        self.reduced = False
        if opt.tracer is not None:  # from the first parameter gradient to the end of backward
            self._backward_token = opt.tracer.begin("backward", stream="compute")
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if opt.stage == 1:
            return
        self.wait()  # a previous backward's, if step() has not run since
        guarded = [isinstance(p.grad, GuardedGrad) for p in opt._params]
        if any(guarded) and not all(guarded):
            name = opt._names[guarded.index(False)]
            raise ShardedGradientError(
                f"ZeroOptimizer (stage 2): parameter {name!r} has .grad None while others "
                f"still hold their gradient from the previous backward; clear gradients with "
                f"optimizer.zero_grad() or model.zero_grad() (all parameters), not one by one"
            )
        # accumulate onto the shard gradient unless it was cleared (zero_grad, set_to_none)
        self._accumulate = all(guarded) and self.flat is not None
        for p in opt._params:
            p.grad = None  # the placeholders; autograd writes the real gradients now
        if self.flat is None:
            self.set(torch.empty_like(opt.shard))
        self._ready = [False] * len(opt._params)
        self._waiting = [len(b.params) for b in opt._buckets]
        self._launched = 0

    def _launch_ready(self) -> None:
        """Launch, in bucket order, every bucket whose gradients are all ready, and drop
        the full gradients of its parameters."""
        opt = self.opt
        while self._launched < len(opt._buckets) and self._waiting[self._launched] == 0:
            bucket = opt._buckets[self._launched]
            self._launch(bucket, self._accumulate)
            for i in bucket.params:
                p = opt._params[i]
                p.grad = placeholder_guard(p, opt, i)
            self._launched += 1

    def _finish_backward(self) -> None:
        """End of backward. Stage 2: parameters that got no gradient are reduced as zeros.
        Stage 1: every local gradient is put behind its guard."""
        opt = self.opt
        if opt.tracer is not None and self._backward_token is not None:
            opt.tracer.end(self._backward_token)
            self._backward_token = None
        try:
            if opt.stage == 1:
                for i, p in enumerate(opt._params):
                    if p.grad is not None and not isinstance(p.grad, GuardedGrad):
                        p.grad = local_guard(p.grad, opt, i)
                return
            for i, ready in enumerate(self._ready):
                if not ready:
                    self._ready[i] = True
                    self._waiting[opt._bucket_of[i].index] -= 1
            self._launch_ready()
        finally:
            self._in_backward = False

    def user_zeroed(self, index: int) -> None:
        """Parameter ``index``'s guard was zeroed (``model.zero_grad(set_to_none=False)``,
        ``p.grad.zero_()``): stage 1 re-reduces the (zeroed) local gradients at the next
        use; stage 2 zeroes this rank's part of the parameter's averaged gradient."""
        opt = self.opt
        self.reduced = False
        if opt.stage == 2:
            self.wait()
            if self.flat is not None:
                lo = max(opt._offsets[index], opt.lo) - opt.lo
                hi = min(opt._offsets[index + 1], opt.hi) - opt.lo
                if lo < hi:
                    self.flat[lo:hi].zero_()

    def zero(self, set_to_none: bool) -> None:
        """``ZeroOptimizer.zero_grad``: the parameters' gradients and the shard's."""
        self.wait()
        self.reduced = False
        for p in self.opt._params:
            if p.grad is None:
                continue
            if set_to_none or self.opt.stage == 2:
                p.grad = None
            else:
                real(p.grad).zero_()
        if set_to_none:
            self.set(None)
        elif self.flat is not None:
            self.flat.zero_()

    def held(self) -> list[torch.Tensor]:
        """Gradient memory alive now: stage-1 local gradients (stage-2 placeholders hold
        one element and are left out), the shard, packed buckets in flight."""
        opt = self.opt
        grads: list[torch.Tensor] = []
        for p in opt._params:
            g = p.grad
            if g is not None and (opt.stage == 1 or not isinstance(g, GuardedGrad)):
                grads.append(real(g))
        if self.flat is not None:
            grads.append(self.flat)
        for red in self.pending:
            grads.extend(red.packed)
            if not red.direct:
                grads.append(red.out)
        return grads

    # --- on the averaged shard: clipping and loss scaling ---------------------------------
    @torch.no_grad()
    def clip_norm_(
        self, max_norm: float, norm_type: float, error_if_nonfinite: bool
    ) -> torch.Tensor:
        """See :meth:`ZeroOptimizer.clip_grad_norm_`."""
        opt = self.opt
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ValueError(
                f"ZeroOptimizer.clip_grad_norm_: norm_type must be positive or inf, got {norm_type}"
            )
        infinite = math.isinf(norm_type)
        grad = self.flat if self.averaged() else None
        if grad is None or grad.numel() == 0:
            local = torch.zeros((), dtype=opt.shard.dtype, device=opt.shard.device)
        elif infinite:
            local = grad.abs().max()
        else:
            local = torch.linalg.vector_norm(grad, norm_type).pow(norm_type)
        if opt.group.size > 1:
            op = "max" if infinite else "sum"
            comm.all_reduce(local, op, group=opt.group, algorithm=opt.algorithm)
        total = local if infinite else local.pow(1.0 / norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"ZeroOptimizer.clip_grad_norm_: the total norm of order {norm_type} of the "
                f"gradients is non-finite ({float(total)}), so it cannot be clipped. Pass "
                f"error_if_nonfinite=False to clip anyway (the step is then nan/inf)"
            )
        if grad is not None:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            grad.mul_(coef.to(grad.dtype))
        return total.to(opt.dtype)

    @torch.no_grad()
    def unscale_(self, inv_scale: float | torch.Tensor) -> torch.Tensor:
        """See :meth:`ZeroOptimizer.unscale_grads_`."""
        opt = self.opt
        found = torch.zeros((), dtype=torch.float32, device=opt.shard.device)
        if self.averaged():
            grad = self.flat
            assert grad is not None
            grad.mul_(torch.as_tensor(inv_scale, dtype=grad.dtype, device=grad.device))
            if grad.numel():  # on the device: the scaler reads the agreed flag once
                found = (~torch.isfinite(grad)).any().to(torch.float32).reshape(())
        if opt.group.size > 1:
            comm.all_reduce(found, "max", group=opt.group, algorithm=opt.algorithm)
        return found


def trace_span(
    opt: ZeroOptimizer, label: str, nbytes: int, handle: Handle | None
) -> Callable[[], None]:
    """Record a ``comm`` span on ``opt.tracer`` from now until the collective completes;
    returns a function that ends it at the latest (call it after ``handle.wait()``: the
    completion callback may run a moment after the waiter wakes)."""
    tracer = opt.tracer
    if tracer is None:
        return _nothing
    token = tracer.begin(label, stream="comm", bytes=nbytes)
    lock, open_ = threading.Lock(), [True]

    def end(*_: Any) -> None:
        with lock:
            if open_[0]:
                open_[0] = False
                tracer.end(token)

    if handle is None:
        end()
    else:
        handle.get_future().add_done_callback(end)
    return end
