""":class:`ZeroOptimizer`: the optimizer state, and in stage 2 the gradients, sharded.

See :mod:`plait.strategies.zero` for the layout and the communication contract.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from plait import comm
from plait.comm.group import Group
from plait.mesh import Mesh, data_parallel_group
from plait.strategies.consistency import verify_same_parameters
from plait.strategies.data_parallel.ddp import MIB, broadcast_tensors
from plait.strategies.reproducible.tree import Microbatches
from plait.strategies.zero import state as zstate
from plait.strategies.zero.gradients import ShardGradients, join, trace_span
from plait.strategies.zero.groups import ParamGroups, check_elementwise, parse_param_groups
from plait.strategies.zero.guard import GuardedGrad
from plait.strategies.zero.partition import (
    Piece,
    make_buckets,
    offsets_of,
    partition,
    shard_bounds,
)
from plait.trace import Tracer


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
    record every reduce-scatter and all-gather as a ``comm`` span (launch to completion)
    and each backward as a ``backward`` span (from its first parameter gradient).
    ``module``: the model, to name parameters in errors and in the wrap-time check.
    ``reproducible=True``: gradients are summed (not averaged) along the fixed micro-batch
    tree and reduce-scattered once per step, after the last micro-batch, with
    :func:`~plait.strategies.reproducible.collectives.tree_reduce_scatter` (bitwise the
    same for every algorithm, transport and world size); a
    :class:`~plait.strategies.reproducible.ReproducibleRunner` must drive the
    micro-batches (a backward outside its ``step`` is refused); ``threads`` (default 1)
    pins the intra-op threads (docs/reproducible.md).

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

    Where it runs: ``mesh=`` (a :class:`~plait.Mesh`'s ``dp`` dimension, or a group;
    ``group=`` is accepted as well; default: the world). Construction is a collective on
    that group: the parameter lists are compared
    (:func:`plait.strategies.consistency.verify_same_parameters`) and the parameters
    broadcast from group rank 0.
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer],
        *,
        stage: int = 1,
        mesh: Mesh | Group | None = None,
        group: Group | None = None,
        algorithm: str = "auto",
        bucket_mb: float = 25.0,
        tracer: Tracer | None = None,
        module: nn.Module | None = None,
        reproducible: bool = False,
        threads: int | None = 1,
        **opt_kwargs: Any,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(
                f"ZeroOptimizer: stage must be 1 or 2, got {stage!r} (stage 3 is FSDP-style "
                f"parameter sharding: plait.fully_shard)"
            )
        if bucket_mb <= 0:
            raise ValueError(f"ZeroOptimizer: bucket_mb must be positive, got {bucket_mb}")
        check_elementwise(optimizer_class)
        layout: ParamGroups = parse_param_groups(params, module)
        self.stage = stage
        group = data_parallel_group(mesh, group, who="ZeroOptimizer")
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
        # buckets follow the model's order (backward's, reversed) even where param groups
        # reorder the flat space, so stage 2 launches them during backward
        self._buckets = make_buckets(
            self._numels, elem, self.bucket_bytes, self.bounds, order=layout.model_order
        )
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
        self._initialized = False
        super().__init__(
            [
                {**_hyper(local), "params": list(params_g)}
                for local, params_g in zip(self.optim.param_groups, layout.all_params, strict=True)
            ],
            dict(self.optim.defaults),
        )
        self._initialized = True

        self._frozen = [p for ps in layout.all_params for p in ps if not p.requires_grad]
        # reproducible=True: tree-ordered sums instead of averages, reduced only at the last
        # micro-batch; the ReproducibleRunner driving the step replaces this
        self.microbatches: Microbatches | None = Microbatches() if reproducible else None
        if reproducible and threads is not None:
            torch.set_num_threads(threads)
        self.gradients = ShardGradients(self)

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
                self.gradients.set(None)

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

    # --- clipping and loss scaling -------------------------------------------------------
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the averaged gradient to global norm ``max_norm``; return its global norm.

        What ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` does for a plain
        (or DDP) model, with the same result: the norm over all parameters of the gradient
        averaged over the group (in the parameters' dtype), and, when it exceeds
        ``max_norm``, every gradient scaled by ``max_norm / (norm + 1e-6)``, so the
        following ``step()`` equals the clipped single-process step. ``norm_type``: any
        p > 0, or ``inf``. ``error_if_nonfinite``: raise ``RuntimeError`` (on every rank)
        if the norm is nan or inf. Call it after backward (and after
        ``GradScaler.unscale_``), before ``step()``.

        Collective: every rank of the group must call it. Stage 1 reduce-scatters the
        gradients here (``step()`` then reuses them: nothing is sent twice); both stages
        then all-reduce one scalar on the group (sum of |g|^p, or max for ``inf``).
        """
        return self.gradients.clip_norm_(max_norm, norm_type, error_if_nonfinite)

    def unscale_grads_(self, inv_scale: float | torch.Tensor) -> torch.Tensor:
        """Multiply the averaged gradient shard by ``inv_scale``; return 1.0 if any
        gradient on any rank is inf or nan, else 0.0 (a float32 scalar, equal on every
        rank). For loss scalers (:class:`plait.amp.DynamicLossScaler` calls it);
        ``torch.amp.GradScaler`` reaches it through the ``.grad`` guards.

        Collective: every rank of the group must call it. Stage 1 reduce-scatters the
        gradients here (``step()`` reuses them); then one all-reduce (max) of one float.
        """
        return self.gradients.unscale_(inv_scale)

    def _amp_unscale_(self, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
        """``torch.amp.GradScaler``'s unscale-and-check, routed here by the guards: the
        agreed found-inf lands in GradScaler's own tensor, so every rank skips together
        and halves its scale alike. Collective, as :meth:`unscale_grads_`."""
        found = self.unscale_grads_(inv_scale)
        found_inf.copy_(torch.maximum(found_inf, found.to(found_inf)))

    def _user_zeroed_(self, guard: GuardedGrad) -> None:
        self.gradients.user_zeroed(guard.param_index)

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
        if not self.gradients.averaged():
            return loss
        self._check_frozen()
        self._refresh_shard()
        self._sync_hyperparameters()
        self.gradients.set(self.gradients.flat)
        self.optim.step()
        self._gather_parameters()
        self.gradients.reduced = False
        self._release_shard()
        return loss

    def _check_frozen(self) -> None:
        for p in self._frozen:
            if p.requires_grad and p.grad is not None:
                raise ValueError(
                    f"ZeroOptimizer: parameter {self._layout.name_of(p)!r} was frozen "
                    f"(requires_grad=False) when the optimizer was built and has a gradient "
                    f"now; ZeRO lays out the trainable parameters once: build the optimizer "
                    f"(plait.prepare) after unfreezing"
                )

    def _gather_parameters(self) -> None:
        """All-gather the updated shards into the parameters, bucket by bucket."""
        rank, launched = self.group.rank, []
        shard = self.shard.detach()
        for bucket in self._buckets:
            blocks = [self._params[0].new_empty(n) for n in bucket.sizes]
            parts = [shard[a - self.lo : b - self.lo] for _, a, b in bucket.pieces[rank]]
            mine = join(parts, shard).to(self.dtype)
            handle = comm.all_gather(
                blocks, mine, group=self.group, algorithm=self.algorithm, async_op=True
            )
            nbytes = bucket.numel * self._params[0].element_size()
            traced = trace_span(self, f"all_gather bucket {bucket.index}", nbytes, handle)
            launched.append((bucket, blocks, handle, traced))
        for bucket, blocks, handle, traced in launched:
            if handle is not None:
                handle.wait()
            traced()
            full = {i: self._params[i].new_empty(self._numels[i]) for i in bucket.params}
            for pieces, block in zip(bucket.pieces, blocks, strict=True):
                offset = 0
                for i, a, b in pieces:
                    start = self._offsets[i]
                    full[i][a - start : b - start].copy_(block[offset : offset + b - a])
                    offset += b - a
            for i, values in full.items():
                self._params[i].copy_(values.view_as(self._params[i]))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the model's gradients and this rank's gradient shard (stage 2: after
        waiting for reduce-scatters still in flight, whose results are discarded).

        ``set_to_none=False`` zeroes the stage-1 local gradients in place; in stage 2 the
        parameters' placeholders are dropped either way (the shard gradient is zeroed).
        Waits for this rank's own collectives in flight only; sends nothing.
        """
        self.gradients.zero(set_to_none)

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
        grads = self.gradients.held()
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


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}
