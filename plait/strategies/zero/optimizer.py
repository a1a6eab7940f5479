""":class:`ZeroOptimizer`: the optimizer state, and in stage 2 the gradients, sharded.

See :mod:`plait.strategies.zero` for the layout and the communication contract.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait import comm
from plait.comm.group import Group, Handle
from plait.strategies.consistency import verify_same_parameters
from plait.strategies.ddp import MIB, broadcast_tensors
from plait.strategies.zero import state as zstate
from plait.strategies.zero.groups import ParamGroups, parse_param_groups
from plait.strategies.zero.guard import (
    ShardedGrad,
    ShardedGradientError,
    local_guard,
    placeholder_guard,
    real,
)
from plait.strategies.zero.partition import (
    Bucket,
    Piece,
    make_buckets,
    offsets_of,
    partition,
    shard_bounds,
)
from plait.trace import Tracer


@dataclass
class _Reduction:
    """One launched reduce-scatter: ``out`` lands in the gradient shard's ``[start, stop)``."""

    handle: Handle | None
    packed: torch.Tensor  # the bucket's gradients, alive until the collective is done
    out: torch.Tensor
    start: int
    stop: int
    accumulate: bool
    traced: Callable[[], None]


class ZeroOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` sharded over ``group`` (default: the world), ZeRO stage 1 or 2.

    ``params``: what a torch optimizer takes: tensors, ``(name, tensor)`` pairs, or
    param-group dicts with per-group hyper-parameters (``weight_decay``, ``lr``, ...; the
    keys of ``opt_kwargs`` are the defaults, as for ``optimizer_class``). Only parameters
    that require grad are sharded; they must share one dtype and device. Frozen ones stay
    in ``param_groups`` (so state-dict ids are the plain optimizer's) and must stay frozen.
    The local optimizer ``self.optim`` is ``optimizer_class`` over one flat parameter per
    group, ``self.shards[g]`` (this rank's part of group g's flat range, possibly empty),
    built as ``optimizer_class(groups, **opt_kwargs)`` with every group's hyper-parameters;
    ``param_groups[g]`` is copied to its group before every step, so LR schedulers on this
    object work, per group. ``algorithm``: the reduce-scatter / all-gather algorithm
    (``plait.comm``'s names). ``bucket_mb``: gradient bucket size in MiB. ``tracer``:
    record every reduce-scatter and all-gather as a ``comm`` span (launch to completion).
    ``module``: the model, to name parameters in errors and in the wrap-time check.

    Gradients: after backward a parameter's ``.grad`` is a guard (see
    :mod:`plait.strategies.zero.guard`): under stage 1 it holds this rank's *local*
    gradient, under stage 2 nothing; any computation with it raises
    :class:`~plait.strategies.zero.guard.ShardedGradientError`. Clip with
    :meth:`clip_grad_norm_`, not ``torch.nn.utils.clip_grad_norm_``.
    ``torch.amp.GradScaler`` and :class:`plait.amp.DynamicLossScaler` work unchanged.
    ``zero_grad`` (both ``set_to_none`` values), ``model.zero_grad()`` and gradient
    accumulation over several backwards work.

    Unlike a plain optimizer, a parameter without a gradient in a step (while others have
    one) is updated with a zero gradient (momentum and weight decay still apply to it).

    Construction is a collective on ``group``: the parameter lists are compared
    (:func:`plait.strategies.consistency.verify_same_parameters`) and the parameters
    broadcast from group rank 0.
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer],
        *,
        stage: int = 1,
        group: Group | None = None,
        algorithm: str = "auto",
        bucket_mb: float = 25.0,
        tracer: Tracer | None = None,
        module: nn.Module | None = None,
        **opt_kwargs: Any,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(
                f"ZeroOptimizer: stage must be 1 or 2, got {stage!r} (stage 3 is FSDP-style "
                f"parameter sharding: plait.fully_shard)"
            )
        if bucket_mb <= 0:
            raise ValueError(f"ZeroOptimizer: bucket_mb must be positive, got {bucket_mb}")
        layout: ParamGroups = parse_param_groups(params, module)
        self.stage = stage
        self.group = group if group is not None else comm.world()
        self.algorithm = algorithm
        self.bucket_bytes = int(bucket_mb * MIB)
        self.tracer = tracer
        self._layout = layout
        self._params: list[nn.Parameter] = layout.trainable
        self._names = layout.trainable_names
        self._numels = [p.numel() for p in self._params]
        self._offsets = offsets_of(self._numels)
        self.numel = self._offsets[-1]
        self.dtype = self._params[0].dtype
        self.partition: list[list[Piece]] = partition(self._numels, self.group.size)
        self.bounds = shard_bounds(self.numel, self.group.size)
        self.lo, self.hi = self.bounds[self.group.rank]
        # group g is flat [group_bounds[g], group_bounds[g + 1]); this rank's part of it is
        # self.shard[local[g][0]:local[g][1]]
        self.group_bounds = [self._offsets[i] for i in layout.group_starts]
        self._local = [
            (min(max(a, self.lo), self.hi) - self.lo, max(min(b, self.hi), self.lo) - self.lo)
            for a, b in zip(self.group_bounds, self.group_bounds[1:], strict=False)
        ]
        elem = self._params[0].element_size()
        self._buckets = make_buckets(self._numels, elem, self.bucket_bytes, self.bounds)
        self._bucket_of = {i: b for b in self._buckets for i in b.params}
        if self.group.size > 1:
            verify_same_parameters(layout.checked_names(), self.group, who="ZeroOptimizer")
            broadcast_tensors(list(self._params), self.group, "auto")

        master = torch.promote_types(self.dtype, torch.float32)
        self.shard: torch.Tensor = self._read_shard().to(master)
        self.shards = [nn.Parameter(self.shard[a:b]) for a, b in self._local]
        local_groups = [
            {**hyper, "params": [s]} for hyper, s in zip(layout.hyper, self.shards, strict=True)
        ]
        self.optim = optimizer_class(local_groups, **opt_kwargs)
        self._grad: torch.Tensor | None = None  # this rank's averaged gradient shard
        self._initialized = False
        super().__init__(
            [
                {**_hyper(local), "params": list(params_g)}
                for local, params_g in zip(self.optim.param_groups, layout.all_params, strict=True)
            ],
            dict(self.optim.defaults),
        )
        self._initialized = True

        self._pending: list[_Reduction] = []
        self._in_backward = False
        self._reduced = False  # stage 1: the gradient shard is already averaged
        self._ready: list[bool] = []
        self._waiting: list[int] = []
        self._launched = 0
        self._accumulate = False
        self._hooks: list[Any] = [
            p.register_hook(self._make_pre_hook(i)) for i, p in enumerate(self._params)
        ]
        if stage == 2:
            self._hooks += [
                p.register_post_accumulate_grad_hook(self._make_hook(i))
                for i, p in enumerate(self._params)
            ]

    # --- layout --------------------------------------------------------------------------
    def _read_shard(self) -> torch.Tensor:
        """This rank's range of the parameters, as a new flat tensor."""
        pieces = [
            self._params[p.param].detach().reshape(-1)[p.start : p.stop]
            for p in self.partition[self.group.rank]
        ]
        if not pieces:
            return self._params[0].new_empty(0)
        return torch.cat(pieces)

    def _refresh_shard(self) -> None:
        if self.shard.dtype == self.dtype:
            storage = self.shard.untyped_storage()
            if storage.nbytes() == 0:  # released after the last step (see _release_shard)
                storage.resize_(self.shard.numel() * self.shard.element_size())
            with torch.no_grad():
                self.shard.copy_(self._read_shard())

    def _release_shard(self) -> None:
        """Between steps, free what duplicates the parameters.

        When the shard has the parameters' dtype it is re-read from them before every
        step, so holding it between steps would only copy 1/n of the model; likewise the
        stage-1 gradient shard, derived in ``step()`` from the full gradients. Freeing both
        keeps the rank at the ZeRO formulas (``plait.plan.memory.estimate``)."""
        if self.shard.dtype == self.dtype:
            self.shard.untyped_storage().resize_(0)  # the group shards are views of it
            if self.stage == 1:
                self._set_grad(None)

    def _set_grad(self, grad: torch.Tensor | None) -> None:
        """The averaged gradient shard, and its per-group views on the local parameters."""
        self._grad = grad
        for (a, b), s in zip(self._local, self.shards, strict=True):
            s.grad = None if grad is None else grad[a:b]

    def _sync_hyperparameters(self) -> None:
        for mine, local in zip(self.param_groups, self.optim.param_groups, strict=True):
            for key, value in mine.items():
                if key != "params":
                    local[key] = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_initialized", False):
            raise NotImplementedError(
                "ZeroOptimizer.add_param_group: the flat layout is fixed at construction; "
                "pass every param group to the constructor (or to the optimizer given to "
                "plait.prepare)"
            )
        super().add_param_group(param_group)

    # --- gradients: reduce-scatter -------------------------------------------------------
    def _trace(self, label: str, nbytes: int, handle: Handle | None) -> Callable[[], None]:
        """Record a ``comm`` span from now until the collective completes; returns a
        function that ends it at the latest (call it after ``handle.wait()``: the
        completion callback may run a moment after the waiter wakes)."""
        tracer = self.tracer
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

    def _param_grad(self, i: int) -> torch.Tensor | None:
        g = self._params[i].grad
        return None if g is None else real(g)

    def _launch(self, bucket: Bucket, accumulate: bool) -> None:
        """Pack the bucket's gradients (zeros where none) and start its reduce-scatter."""
        grads = []
        for i in bucket.params:
            g = self._param_grad(i)
            if g is None:
                g = self._params[i].new_zeros(self._params[i].shape)
            grads.append(g.reshape(-1))
        packed = torch.cat(grads)
        blocks = [packed[a - bucket.lo : b - bucket.lo] for a, b in bucket.blocks]
        a, b = bucket.blocks[self.group.rank]
        start, stop = a - self.lo, b - self.lo
        grad = self._grad
        assert grad is not None
        if accumulate or grad.dtype != packed.dtype:
            out = packed.new_empty(stop - start)
        else:
            out = grad[start:stop]
        handle = comm.reduce_scatter(
            out, blocks, "avg", group=self.group, algorithm=self.algorithm, async_op=True
        )
        traced = self._trace(
            f"reduce_scatter bucket {bucket.index}", packed.numel() * packed.element_size(), handle
        )
        self._pending.append(_Reduction(handle, packed, out, start, stop, accumulate, traced))

    def _wait_reductions(self) -> None:
        """Wait for every launched reduce-scatter and put its result into the shard."""
        pending, self._pending = self._pending, []
        grad = self._grad
        for red in pending:
            if red.handle is not None:
                red.handle.wait()
            red.traced()
            assert grad is not None
            target = grad[red.start : red.stop]
            if red.accumulate:
                target.add_(red.out)
            elif red.out.data_ptr() != target.data_ptr() or red.out.dtype != target.dtype:
                target.copy_(red.out)

    def _averaged(self) -> bool:
        """Make ``self._grad`` this rank's averaged gradient shard; False if there is none.

        Stage 1: reduce-scatter the full gradients (once per backward: ``clip_grad_norm_``,
        unscaling and ``step`` share it). Stage 2: wait for the backward's reduce-scatters.
        """
        if self.stage == 2:
            self._wait_reductions()
            return self._grad is not None
        if self._reduced:
            return True
        if all(p.grad is None for p in self._params):
            return False
        if self._grad is None:
            self._set_grad(torch.empty_like(self.shard))
        for bucket in self._buckets:
            self._launch(bucket, accumulate=False)
        self._wait_reductions()
        self._reduced = True
        return True

    # --- gradients: backward hooks -------------------------------------------------------
    def _make_pre_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if not self._in_backward:
                self._start_backward()

        return hook

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if not self._ready[index]:
                self._ready[index] = True
                self._waiting[self._bucket_of[index].index] -= 1
                self._launch_ready()

        return hook

    def _start_backward(self) -> None:
        """First gradient of a backward, before autograd accumulates it."""
        self._in_backward = True
        self._reduced = False
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if self.stage == 1:
            return
        self._wait_reductions()  # a previous backward's, if step() has not run since
        guarded = [isinstance(p.grad, ShardedGrad) for p in self._params]
        if any(guarded) and not all(guarded):
            name = self._names[guarded.index(False)]
            raise ShardedGradientError(
                f"ZeroOptimizer (stage 2): parameter {name!r} has .grad None while others "
                f"still hold their gradient from the previous backward; clear gradients with "
                f"optimizer.zero_grad() or model.zero_grad() (all parameters), not one by one"
            )
        # accumulate onto the shard gradient unless it was cleared (zero_grad, set_to_none)
        self._accumulate = all(guarded) and self._grad is not None
        for p in self._params:
            p.grad = None  # the placeholders; autograd writes the real gradients now
        if self._grad is None:
            self._set_grad(torch.empty_like(self.shard))
        self._ready = [False] * len(self._params)
        self._waiting = [len(b.params) for b in self._buckets]
        self._launched = 0

    def _launch_ready(self) -> None:
        """Launch, in bucket order, every bucket whose gradients are all ready, and drop
        the full gradients of its parameters."""
        while self._launched < len(self._buckets) and self._waiting[self._launched] == 0:
            bucket = self._buckets[self._launched]
            self._launch(bucket, self._accumulate)
            for i in bucket.params:
                p = self._params[i]
                p.grad = placeholder_guard(p, self, self._names[i])
            self._launched += 1

    def _finish_backward(self) -> None:
        """End of backward. Stage 2: parameters that got no gradient are reduced as zeros.
        Stage 1: every local gradient is put behind its guard."""
        try:
            if self.stage == 1:
                for p, name in zip(self._params, self._names, strict=True):
                    if p.grad is not None and not isinstance(p.grad, ShardedGrad):
                        p.grad = local_guard(p.grad, self, name)
                return
            for i, ready in enumerate(self._ready):
                if not ready:
                    self._ready[i] = True
                    self._waiting[self._bucket_of[i].index] -= 1
            self._launch_ready()
        finally:
            self._in_backward = False

    def _user_zeroed_(self, guard: ShardedGrad) -> None:
        """A guard was zeroed (``model.zero_grad(set_to_none=False)``): clear what it
        stands for."""
        self._reduced = False
        if self.stage == 2:
            self._wait_reductions()
            if self._grad is not None:
                self._grad.zero_()

    # --- clipping and loss scaling -------------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the averaged gradient to global norm ``max_norm``; return its global norm.

        What ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` does for a plain
        (or DDP) model, with the same result: the norm over all parameters of the gradient
        averaged over the group, and, when it exceeds ``max_norm``, every gradient scaled
        by ``max_norm / (norm + 1e-6)``, so the following ``step()`` equals the clipped
        single-process step. ``norm_type``: any p > 0, or ``inf``. ``error_if_nonfinite``:
        raise ``RuntimeError`` (on every rank) if the norm is nan or inf.

        Collective: every rank of the group must call it (after backward, before
        ``step()``). Stage 1 reduce-scatters the gradients here (``step()`` then reuses
        them: nothing is sent twice); both stages then all-reduce one scalar (sum of
        |g|^p, or max for ``inf``) on the group.
        """
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ValueError(
                f"ZeroOptimizer.clip_grad_norm_: norm_type must be positive or inf, got {norm_type}"
            )
        have = self._averaged()
        grad = self._grad if have else None
        if grad is None or grad.numel() == 0:
            local = torch.zeros((), dtype=self.shard.dtype)
        elif math.isinf(norm_type):
            local = grad.abs().max()
        else:
            local = torch.linalg.vector_norm(grad, norm_type).pow(norm_type)
        if self.group.size > 1:
            comm.all_reduce(
                local,
                "max" if math.isinf(norm_type) else "sum",
                group=self.group,
                algorithm=self.algorithm,
            )
        total = local if math.isinf(norm_type) else local.pow(1.0 / norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"ZeroOptimizer.clip_grad_norm_: the total norm of order {norm_type} of the "
                f"gradients is non-finite ({float(total)}), so it cannot be clipped. Pass "
                f"error_if_nonfinite=False to clip anyway (the step is then nan/inf)"
            )
        if grad is not None:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            grad.mul_(coef.to(grad.dtype))
        return total.to(self.dtype)

    @torch.no_grad()
    def unscale_grads_(self, inv_scale: float | torch.Tensor) -> torch.Tensor:
        """Multiply the averaged gradient shard by ``inv_scale``; return 1.0 if any
        gradient on any rank is inf or nan, else 0.0 (a float32 scalar, equal on every
        rank). For loss scalers; ``torch.amp.GradScaler`` reaches it by itself.

        Collective: every rank of the group must call it. Stage 1 reduce-scatters the
        gradients here (``step()`` reuses them); then one all-reduce (max) of one float.
        """
        found = torch.zeros((), dtype=torch.float32)
        if self._averaged():
            grad = self._grad
            assert grad is not None
            grad.mul_(torch.as_tensor(inv_scale, dtype=grad.dtype))
            if grad.numel() and not bool(torch.isfinite(grad).all()):
                found.fill_(1.0)
        if self.group.size > 1:
            comm.all_reduce(found, "max", group=self.group, algorithm=self.algorithm)
        return found

    def _amp_unscale_(self, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
        """``torch.amp.GradScaler``'s unscale-and-check, routed here by the guards: the
        agreed found-inf lands in GradScaler's own tensor, so every rank skips together
        and halves its scale alike."""
        found = self.unscale_grads_(inv_scale)
        found_inf.copy_(torch.maximum(found_inf, found.to(found_inf)))

    # --- step --------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Average the gradients (stage 1, unless ``clip_grad_norm_`` or unscaling did) or
        wait for their averaging (stage 2), update this rank's shard, all-gather the
        shards into the parameters.

        Collective: every rank of the group must call it (reduce-scatters in stage 1,
        all-gathers in both; see the module docstring for the bytes); blocks on the other
        ranks for at most the group's timeout.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._averaged():
            return loss
        self._check_frozen()
        self._refresh_shard()
        self._sync_hyperparameters()
        self._set_grad(self._grad)
        self.optim.step()
        self._gather_parameters()
        self._reduced = False
        self._release_shard()
        return loss

    def _check_frozen(self) -> None:
        for params in self._layout.all_params:
            for p in params:
                if not p.requires_grad or p.grad is None:
                    continue
                if not any(p is q for q in self._params):
                    raise ValueError(
                        f"ZeroOptimizer: parameter {self._layout.name_of(p)!r} was frozen "
                        f"(requires_grad=False) when the optimizer was built and has a "
                        f"gradient now; ZeRO lays out the trainable parameters once: build the "
                        f"optimizer (plait.prepare) after unfreezing"
                    )

    def _gather_parameters(self) -> None:
        """All-gather the updated shards into the parameters, bucket by bucket."""
        launched = []
        for bucket in self._buckets:
            flat = self._params[0].new_empty(bucket.hi - bucket.lo)
            blocks = [flat[a - bucket.lo : b - bucket.lo] for a, b in bucket.blocks]
            a, b = bucket.blocks[self.group.rank]
            mine = self.shard.detach()[a - self.lo : b - self.lo].to(self.dtype)
            handle = comm.all_gather(
                blocks, mine, group=self.group, algorithm=self.algorithm, async_op=True
            )
            traced = self._trace(
                f"all_gather bucket {bucket.index}", flat.numel() * flat.element_size(), handle
            )
            launched.append((bucket, flat, handle, traced))
        for bucket, flat, handle, traced in launched:
            if handle is not None:
                handle.wait()
            traced()
            for i in bucket.params:
                p = self._params[i]
                start = self._offsets[i] - bucket.lo
                p.copy_(flat[start : start + p.numel()].view_as(p))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the model's gradients and this rank's gradient shard (stage 2: after
        waiting for reduce-scatters still in flight, whose results are discarded).

        ``set_to_none=False`` zeroes the stage-1 local gradients in place; in stage 2 the
        parameters' placeholders are dropped either way (the shard gradient is zeroed).
        Waits for this rank's own collectives in flight only; sends nothing.
        """
        self._wait_reductions()
        self._reduced = False
        for p in self._params:
            if p.grad is None:
                continue
            if set_to_none or self.stage == 2:
                p.grad = None
            else:
                real(p.grad).zero_()
        if set_to_none:
            self._set_grad(None)
        elif self._grad is not None:
            self._grad.zero_()

    # --- state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The consolidated state, in the format of ``optimizer_class(params).state_dict()``
        (every param group, ids counted across groups as torch does), loadable by the plain
        optimizer and by :meth:`load_state_dict` at any world size.

        Collective: call it on every rank of the group, e.g. before
        ``if rank == 0: torch.save(...)``; one all-gather per param group and per-element
        state entry (two for Adam, (n-1)/n of the group's elements x 4 bytes each). Every
        rank returns the same dict.
        """
        return zstate.consolidated_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated state (from :meth:`state_dict` at any world size, or from a
        plain ``optimizer_class`` with the same param groups); this rank keeps its range.
        No communication."""
        zstate.load_consolidated_state_dict(self, state_dict)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shard state and the partition it belongs to. No communication."""
        return zstate.sharded_state_dict(self)

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`sharded_state_dict` returned on this rank, at the same world
        size and parameters. No communication."""
        zstate.load_sharded_state_dict(self, state_dict)

    def memory_breakdown(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by kind, for memory estimates.

        ``params``: the model parameters (full in stages 1-2). ``grads``: gradients alive
        now: the full local gradients behind the stage-1 guards (none in stage 2 after
        backward: its guards hold one shared element), this rank's averaged gradient
        shard, and packed buckets of reduce-scatters still in flight.
        ``optimizer_state``: the flat shard and the local optimizer's state tensors.
        """
        grads: list[torch.Tensor] = []
        for p in self._params:
            g = p.grad
            if g is not None and (self.stage == 1 or not isinstance(g, ShardedGrad)):
                grads.append(real(g))
        if self._grad is not None:
            grads.append(self._grad)
        for red in self._pending:
            grads.append(red.packed)
            if red.accumulate or self._grad is None or red.out.dtype != self._grad.dtype:
                grads.append(red.out)
        state = [
            v
            for s in self.shards
            for v in self.optim.state.get(s, {}).values()
            if isinstance(v, torch.Tensor)
        ]
        held = [self.shard] if self.shard.untyped_storage().nbytes() else []
        return {
            "params": list(self._params),
            "grads": grads,
            "optimizer_state": [*held, *state],
        }

    @property
    def group_numels(self) -> Sequence[int]:
        """Elements of every param group's trainable parameters."""
        return [b - a for a, b in zip(self.group_bounds, self.group_bounds[1:], strict=False)]


def _nothing() -> None:
    pass


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}
