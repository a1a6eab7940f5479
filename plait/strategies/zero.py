"""ZeRO stages 1 and 2: optimizer state, and in stage 2 gradients, sharded over the group.

Every rank keeps a full replica of the parameters and computes gradients on its share of
the global batch, as in DDP. What is not replicated: the trainable parameters are laid end
to end in one flat index space of S elements (registration order), and rank r owns the
contiguous range ``[lo_r, hi_r)``; range sizes differ by at most one element, and a large
tensor is split across ranks rather than assigned whole (:func:`partition` gives the
pieces as plain data). The wrapped optimizer (``optimizer_class``) runs on one flat
``nn.Parameter`` holding a copy of this rank's range only (in float32, or wider when the
parameters are), so its state (Adam's ``exp_avg`` and ``exp_avg_sq``) is about 1/n of
the replicated one.

Communication contract, on ``group`` (n ranks, b bytes per element, S_r = hi_r - lo_r):

- construction: the parameters are broadcast from group rank 0 (one flat broadcast), so
  every replica starts equal;
- stage 1, in ``step()``: the gradients are averaged with ``reduce_scatter`` (op avg),
  bucket by bucket (buckets of about ``bucket_mb`` MiB, whole parameters, in the reverse of
  registration order; each bucket's blocks are its intersections with the ranks' ranges),
  so rank r receives only the averaged gradient of its range. With the ring each rank
  sends (S - S_r)·b ≈ (n-1)/n·S·b in all: exactly the reduce-scatter half of a ring
  all-reduce. The full gradients (``param.grad``) stay allocated, as in DDP;
- stage 2, during ``backward()``: the same reduce-scatters, launched asynchronously from a
  post-accumulate-grad hook per parameter as soon as a bucket's gradients are all ready
  (strictly in bucket order, so every rank issues the same collectives in the same
  order), overlapping the rest of backward. Once a bucket is launched the ``.grad`` of its
  parameters is dropped (set to None), so full gradients are never all alive at once and
  none remains after backward; each rank keeps only its shard of the averaged gradient.
  ``step()`` waits for the outstanding reduce-scatters. A parameter that got no gradient
  is reduced as zeros (at the end of backward);
- both stages, at the end of ``step()``: the local optimizer updates its shard, and the
  updated shards are ``all_gather``-ed (uneven per-rank blocks, bucket by bucket) into the
  model parameters, so every replica ends bitwise identical. With the ring rank r sends
  every block but its right neighbour's, (S - S_{r+1})·b ≈ (n-1)/n·S·b. In all a step
  sends about 2(n-1)/n·S·b per rank, what DDP's ring all-reduce sends (tests/test_zero.py
  checks both counts exactly);
- ``state_dict()``: one ``all_gather`` per per-element state entry (two for Adam,
  (n-1)/n·S·4 bytes each); every rank returns the same consolidated dict.
  ``load_state_dict``, ``sharded_state_dict`` and ``load_sharded_state_dict`` do not
  communicate.

With ``algorithm="auto"`` small buckets may go through the ``naive`` algorithm (via group
rank 0), which sends more from rank 0 and less from the others. At world size 1 nothing
is communicated and the result is bitwise that of the plain optimizer.

Every function that communicates blocks on the other ranks of ``group`` for at most the
group's timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from plait import comm
from plait.comm.chunks import even_counts
from plait.comm.group import Group, Handle
from plait.strategies.buckets import FIRST_BUCKET_BYTES
from plait.strategies.ddp import MIB, broadcast_tensors

ZERO_OPTIONS = ("algorithm", "bucket_mb")


# --- the partition: plain data ---------------------------------------------------------
class Piece(NamedTuple):
    """Elements ``[start, stop)`` of parameter number ``param`` (flattened)."""

    param: int
    start: int
    stop: int


def shard_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """``[lo_r, hi_r)`` of every rank in a flat index space of ``numel`` elements; the
    first ``numel % world_size`` ranks hold one element more."""
    bounds, lo = [], 0
    for count in even_counts(numel, world_size):
        bounds.append((lo, lo + count))
        lo += count
    return bounds


def partition(numels: Sequence[int], world_size: int) -> list[list[Piece]]:
    """The pieces of parameters each rank owns, rank by rank.

    The parameters (``numels`` elements each) are concatenated; rank r owns the flat
    range ``shard_bounds(sum(numels), world_size)[r]``, cut at parameter boundaries into
    pieces. E.g. ``partition([6, 3], 2)`` is
    ``[[Piece(0, 0, 5)], [Piece(0, 5, 6), Piece(1, 0, 3)]]``.
    """
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    result = []
    for lo, hi in shard_bounds(offsets[-1], world_size):
        pieces = []
        for i in range(len(numels)):
            a, b = max(lo, offsets[i]), min(hi, offsets[i + 1])
            if a < b:
                pieces.append(Piece(i, a - offsets[i], b - offsets[i]))
        result.append(pieces)
    return result


def describe_partition(parts: Sequence[Sequence[Piece]]) -> str:
    """One line per rank: ``rank 1: 4 elements  p0[5:6] p1[0:3]``."""
    lines = []
    for rank, pieces in enumerate(parts):
        size = sum(p.stop - p.start for p in pieces)
        names = " ".join(f"p{p.param}[{p.start}:{p.stop}]" for p in pieces)
        lines.append(f"rank {rank}: {size} elements  {names}".rstrip())
    return "\n".join(lines)


def reduction_buckets(
    numels: Sequence[int],
    element_size: int,
    bucket_bytes: int,
    first_bucket_bytes: int = FIRST_BUCKET_BYTES,
) -> list[range]:
    """Parameter index ranges of the gradient buckets, in launch order.

    Parameters are taken in the reverse of registration order (the order backward
    produces their gradients); a bucket closes once it holds at least its limit, the
    first one at ``min(first_bucket_bytes, bucket_bytes)`` so communication starts early
    (as in :func:`plait.strategies.buckets.build_buckets`). Each bucket is a contiguous
    range of the flat index space.
    """
    groups: list[list[int]] = []
    size = 0
    for i in reversed(range(len(numels))):
        limit = min(first_bucket_bytes, bucket_bytes) if len(groups) <= 1 else bucket_bytes
        if not groups or size >= limit:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += numels[i] * element_size
    return [range(g[-1], g[0] + 1) for g in groups]


@dataclass
class _Bucket:
    """A bucket of parameters ``params``: flat range ``[lo, hi)``, and every rank's block
    of it (flat ``[start, stop)``, possibly empty)."""

    index: int
    params: range
    lo: int
    hi: int
    blocks: list[tuple[int, int]]


@dataclass
class _Reduction:
    """One launched reduce-scatter: ``out`` lands in ``shard.grad[start:stop]``."""

    handle: Handle | None
    packed: torch.Tensor  # the bucket's gradients, alive until the collective is done
    out: torch.Tensor
    start: int
    stop: int
    accumulate: bool


# --- the optimizer -----------------------------------------------------------------------
class ZeroOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` sharded over ``group`` (default: the world), ZeRO stage 1 or 2.

    ``params``: the parameters (or one param-group dict); only those that require grad
    are used, and they must share one dtype and device. There is a single param group:
    ``param_groups[0]`` holds ``optimizer_class``'s hyper-parameters (``opt_kwargs`` over
    its defaults) and is copied to the local optimizer before every step, so an LR
    scheduler on this object works. ``algorithm``: the reduce-scatter / all-gather
    algorithm (``plait.comm``'s names). ``bucket_mb``: gradient bucket size in MiB.

    The local optimizer is ``self.optim``, on ``self.shard`` (this rank's flat range of
    the parameters; it is re-read from the parameters at each step when their dtype is
    the shard's, so loading a model checkpoint between steps is seen). Unlike a plain
    optimizer, a parameter without a gradient in a step (while others have one) is
    updated with a zero gradient (momentum and weight decay still apply to it).
    See the module docstring for what is communicated when.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer],
        *,
        stage: int = 1,
        group: Group | None = None,
        algorithm: str = "auto",
        bucket_mb: float = 25.0,
        **opt_kwargs: Any,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(
                f"ZeroOptimizer: stage must be 1 or 2, got {stage!r} (stage 3 is FSDP-style "
                f"parameter sharding, not implemented here)"
            )
        if bucket_mb <= 0:
            raise ValueError(f"ZeroOptimizer: bucket_mb must be positive, got {bucket_mb}")
        trainable = _trainable(params)
        self.stage = stage
        self.group = group if group is not None else comm.world()
        self.algorithm = algorithm
        self.bucket_bytes = int(bucket_mb * MIB)
        self._params = trainable
        self._numels = [p.numel() for p in trainable]
        self._offsets = [0]
        for n in self._numels:
            self._offsets.append(self._offsets[-1] + n)
        self.numel = self._offsets[-1]
        self.dtype = trainable[0].dtype
        self.partition = partition(self._numels, self.group.size)
        self.bounds = shard_bounds(self.numel, self.group.size)
        self.lo, self.hi = self.bounds[self.group.rank]
        elem = trainable[0].element_size()
        self._buckets = [
            self._make_bucket(i, r)
            for i, r in enumerate(reduction_buckets(self._numels, elem, self.bucket_bytes))
        ]
        self._bucket_of = {i: b for b in self._buckets for i in b.params}
        if self.group.size > 1:
            broadcast_tensors(list(trainable), self.group, "auto")

        master = torch.promote_types(self.dtype, torch.float32)
        self.shard = nn.Parameter(self._read_shard().to(master))
        self.optim = optimizer_class([self.shard], **opt_kwargs)
        self._initialized = False
        super().__init__(trainable, dict(self.optim.defaults))
        self._initialized = True

        self._pending: list[_Reduction] = []
        self._in_backward = False
        self._ready: list[bool] = []
        self._waiting: list[int] = []
        self._launched = 0
        self._accumulate = False
        self._hooks: list[Any] = []
        if stage == 2:
            self._hooks = [
                p.register_post_accumulate_grad_hook(self._make_hook(i))
                for i, p in enumerate(trainable)
            ]

    # --- layout --------------------------------------------------------------------------
    def _make_bucket(self, index: int, params: range) -> _Bucket:
        lo, hi = self._offsets[params.start], self._offsets[params.stop]
        blocks = []
        for r_lo, r_hi in self.bounds:
            start = min(max(lo, r_lo), hi)
            blocks.append((start, max(min(hi, r_hi), start)))
        return _Bucket(index, params, lo, hi, blocks)

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
            self.shard.untyped_storage().resize_(0)
            if self.stage == 1:
                self.shard.grad = None

    def _sync_hyperparameters(self) -> None:
        local = self.optim.param_groups[0]
        for key, value in self.param_groups[0].items():
            if key != "params":
                local[key] = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_initialized", False):
            raise NotImplementedError(
                "ZeroOptimizer has a single param group; create it on all parameters "
                "(per-group hyper-parameters are not supported)"
            )
        super().add_param_group(param_group)

    # --- gradients -----------------------------------------------------------------------
    def _launch(self, bucket: _Bucket, accumulate: bool) -> None:
        """Pack the bucket's gradients (zeros where none) and start its reduce-scatter."""
        grads = []
        for i in bucket.params:
            p = self._params[i]
            grads.append(p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()))
        packed = torch.cat(grads)
        blocks = [packed[a - bucket.lo : b - bucket.lo] for a, b in bucket.blocks]
        a, b = bucket.blocks[self.group.rank]
        start, stop = a - self.lo, b - self.lo
        grad = self.shard.grad
        assert grad is not None
        if accumulate or grad.dtype != packed.dtype:
            out = packed.new_empty(stop - start)
        else:
            out = grad[start:stop]
        handle = comm.reduce_scatter(
            out, blocks, "avg", group=self.group, algorithm=self.algorithm, async_op=True
        )
        self._pending.append(_Reduction(handle, packed, out, start, stop, accumulate))

    def _wait_reductions(self) -> None:
        """Wait for every launched reduce-scatter and put its result into ``shard.grad``."""
        pending, self._pending = self._pending, []
        grad = self.shard.grad
        for red in pending:
            if red.handle is not None:
                red.handle.wait()
            assert grad is not None
            target = grad[red.start : red.stop]
            if red.accumulate:
                target.add_(red.out)
            elif red.out.data_ptr() != target.data_ptr() or red.out.dtype != target.dtype:
                target.copy_(red.out)

    def _reduce_in_step(self) -> bool:
        """Stage 1: reduce-scatter the full gradients; False if there are none."""
        if all(p.grad is None for p in self._params):
            return False
        if self.shard.grad is None:
            self.shard.grad = torch.empty_like(self.shard)
        for bucket in self._buckets:
            self._launch(bucket, accumulate=False)
        self._wait_reductions()
        return True

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if not self._in_backward:
                self._start_backward()
            if not self._ready[index]:
                self._ready[index] = True
                self._waiting[self._bucket_of[index].index] -= 1
                self._launch_ready()

        return hook

    def _start_backward(self) -> None:
        self._in_backward = True
        self._ready = [False] * len(self._params)
        self._waiting = [len(b.params) for b in self._buckets]
        self._launched = 0
        # a first backward since zero_grad writes the shard gradient; later ones add to it
        self._accumulate = self.shard.grad is not None
        if self.shard.grad is None:
            self.shard.grad = torch.empty_like(self.shard)
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _launch_ready(self) -> None:
        """Launch, in bucket order, every bucket whose gradients are all ready, and drop
        the full gradients of its parameters."""
        while self._launched < len(self._buckets) and self._waiting[self._launched] == 0:
            bucket = self._buckets[self._launched]
            self._launch(bucket, self._accumulate)
            for i in bucket.params:
                self._params[i].grad = None
            self._launched += 1

    def _finish_backward(self) -> None:
        """End of backward: parameters that got no gradient are reduced as zeros."""
        try:
            for i, ready in enumerate(self._ready):
                if not ready:
                    self._ready[i] = True
                    self._waiting[self._bucket_of[i].index] -= 1
            self._launch_ready()
        finally:
            self._in_backward = False

    # --- step --------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Average the gradients (stage 1) or wait for their averaging (stage 2), update
        this rank's shard, all-gather the shards into the parameters.

        Blocks on the group's other ranks (at most the group's timeout).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.stage == 1:
            if not self._reduce_in_step():
                return loss
        else:
            self._wait_reductions()
            if self.shard.grad is None:
                return loss
        self._refresh_shard()
        self._sync_hyperparameters()
        self.optim.step()
        self._gather_parameters()
        self._release_shard()
        return loss

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
            launched.append((bucket, flat, handle))
        for bucket, flat, handle in launched:
            if handle is not None:
                handle.wait()
            for i in bucket.params:
                p = self._params[i]
                start = self._offsets[i] - bucket.lo
                p.copy_(flat[start : start + p.numel()].view_as(p))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the model's gradients and this rank's gradient shard (stage 2: after
        waiting for reduce-scatters still in flight, whose results are discarded)."""
        self._wait_reductions()
        super().zero_grad(set_to_none)
        if set_to_none:
            self.shard.grad = None
        elif self.shard.grad is not None:
            self.shard.grad.zero_()

    # --- state -------------------------------------------------------------------------
    def _local_state(self) -> dict[str, Any]:
        return dict(self.optim.state.get(self.shard, {}))

    def _elementwise(self, key: str, value: Any) -> bool:
        return key != "step" and isinstance(value, torch.Tensor) and value.shape == self.shard.shape

    def _hyperparameters(self) -> dict[str, Any]:
        return {k: v for k, v in self.param_groups[0].items() if k != "params"}

    def state_dict(self) -> dict[str, Any]:
        """The consolidated state, in the format of ``optimizer_class(params).state_dict()``.

        Every rank returns the same dict. Blocks on the group (one all-gather per
        per-element state entry).
        """
        local = self._local_state()
        per_param: list[dict[str, Any]] = [{} for _ in self._params]
        for key, value in local.items():
            if self._elementwise(key, value):
                full = self._gather_flat(value)
                for i, p in enumerate(self._params):
                    piece = full[self._offsets[i] : self._offsets[i + 1]]
                    per_param[i][key] = piece.view_as(p).clone()
            else:
                for entry in per_param:
                    entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
        group = self._hyperparameters()
        group["params"] = list(range(len(self._params)))
        state = dict(enumerate(per_param)) if local else {}
        return {"state": state, "param_groups": [group]}

    def _gather_flat(self, value: torch.Tensor) -> torch.Tensor:
        full = value.new_empty(self.numel)
        blocks = [full[lo:hi] for lo, hi in self.bounds]
        comm.all_gather(blocks, value.detach(), group=self.group, algorithm=self.algorithm)
        return full

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated state (from :meth:`state_dict` at any world size, or from a
        plain ``optimizer_class``); this rank keeps its range. No communication."""
        groups = state_dict["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self._params):
            sizes = [len(g["params"]) for g in groups]
            raise ValueError(
                f"ZeroOptimizer.load_state_dict: expected one param group of "
                f"{len(self._params)} parameters, got groups of {sizes} parameters"
            )
        saved = state_dict["state"]
        entries = [saved.get(pid, saved.get(str(pid))) for pid in groups[0]["params"]]
        local: dict[str, Any] = {}
        if any(e is not None for e in entries):
            missing = [i for i, e in enumerate(entries) if e is None]
            if missing:
                raise ValueError(
                    f"ZeroOptimizer.load_state_dict: parameters {missing[:8]} have no state "
                    f"while others do; ZeroOptimizer keeps one state for the whole shard, so "
                    f"every parameter needs one (train them all for a step first)"
                )
            for key in entries[0]:
                local[key] = self._local_value(key, [e[key] for e in entries])
        hyper = {k: v for k, v in groups[0].items() if k != "params"}
        self.param_groups[0].update(hyper)
        self.optim.load_state_dict(
            {"state": {0: local} if local else {}, "param_groups": [{**hyper, "params": [0]}]}
        )
        self._refresh_shard()

    def _local_value(self, key: str, values: list[Any]) -> Any:
        """This rank's slice of a per-parameter state entry, or the shared scalar."""
        if key != "step" and all(
            isinstance(v, torch.Tensor) and v.shape == p.shape
            for v, p in zip(values, self._params, strict=True)
        ):
            pieces = [
                values[p.param].reshape(-1)[p.start : p.stop]
                for p in self.partition[self.group.rank]
            ]
            flat = torch.cat(pieces) if pieces else values[0].new_empty(0).reshape(-1)
            return flat.to(self.shard.dtype).clone()
        first = values[0]
        for i, v in enumerate(values[1:], start=1):
            same = (
                torch.equal(v, first)
                if isinstance(v, torch.Tensor) and isinstance(first, torch.Tensor)
                else v == first
            )
            if not same:
                raise ValueError(
                    f"ZeroOptimizer.load_state_dict: state {key!r} of parameter {i} ({v!r}) "
                    f"differs from parameter 0's ({first!r}); ZeroOptimizer keeps one value "
                    f"of it for the whole shard"
                )
        return first.clone() if isinstance(first, torch.Tensor) else first

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shard state and the partition it belongs to. No communication."""
        self._sync_hyperparameters()
        return {
            "world_size": self.group.size,
            "rank": self.group.rank,
            "numels": list(self._numels),
            "partition": [[tuple(p) for p in pieces] for pieces in self.partition],
            "optimizer": self.optim.state_dict(),
        }

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`sharded_state_dict` returned on this rank, at the same world
        size and parameters. No communication."""
        mine = [[tuple(p) for p in pieces] for pieces in self.partition]
        saved = [[tuple(p) for p in pieces] for pieces in state_dict["partition"]]
        if (
            state_dict["world_size"] != self.group.size
            or state_dict["rank"] != self.group.rank
            or list(state_dict["numels"]) != self._numels
            or saved != mine
        ):
            raise ValueError(
                f"ZeroOptimizer.load_sharded_state_dict: the shard was saved by rank "
                f"{state_dict['rank']} of {state_dict['world_size']} over parameters of "
                f"{len(state_dict['numels'])} sizes; this is rank {self.group.rank} of "
                f"{self.group.size} over {len(self._numels)}. Load on the same layout, or "
                f"use state_dict()/load_state_dict() (consolidated) to change it"
            )
        self.optim.load_state_dict(state_dict["optimizer"])
        hyper = self.optim.param_groups[0]
        self.param_groups[0].update({k: v for k, v in hyper.items() if k != "params"})
        self._refresh_shard()

    def memory_breakdown(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by kind, for memory estimates.

        ``params``: the model parameters (full in stages 1-2). ``grads``: gradients alive
        now: the full ``.grad`` of the parameters (stage 1; none in stage 2 after
        backward), this rank's averaged gradient shard, and packed buckets of
        reduce-scatters still in flight. ``optimizer_state``: the flat shard and the local
        optimizer's state tensors.
        """
        grads = [p.grad for p in self._params if p.grad is not None]
        if self.shard.grad is not None:
            grads.append(self.shard.grad)
        for red in self._pending:
            grads.append(red.packed)
            if red.accumulate or red.out.dtype != self.shard.dtype:
                grads.append(red.out)
        state = [v for v in self._local_state().values() if isinstance(v, torch.Tensor)]
        held = [self.shard] if self.shard.untyped_storage().nbytes() else []
        return {
            "params": list(self._params),
            "grads": grads,
            "optimizer_state": [*held, *state],
        }


def _trainable(params: Iterable[torch.Tensor] | Iterable[dict[str, Any]]) -> list[nn.Parameter]:
    items = list(params)
    if items and isinstance(items[0], dict):
        if len(items) != 1:
            raise ValueError(
                f"ZeroOptimizer: got {len(items)} param groups; it supports a single group "
                f"(one set of hyper-parameters for all parameters)"
            )
        extra = set(items[0]) - {"params"}
        if extra:
            raise ValueError(
                f"ZeroOptimizer: pass hyper-parameters as keyword arguments, not in the "
                f"param group ({sorted(extra)})"
            )
        group_params = items[0]["params"]
        items = [group_params] if isinstance(group_params, torch.Tensor) else list(group_params)
    trainable = [p for p in items if isinstance(p, torch.Tensor) and p.requires_grad]
    if not trainable:
        raise ValueError("ZeroOptimizer: no trainable parameters (requires_grad=True) given")
    dtypes = sorted({str(p.dtype) for p in trainable})
    if len(dtypes) > 1:
        raise TypeError(
            f"ZeroOptimizer: the parameters have dtypes {dtypes}; ZeRO lays them out in one "
            f"flat buffer, so they must share one dtype: cast the model (model.to(dtype)) "
            f"or leave the odd parameters out of the optimizer"
        )
    devices = sorted({str(p.device) for p in trainable})
    if len(devices) > 1:
        raise ValueError(
            f"ZeroOptimizer: the parameters are on devices {devices}; put them on one device"
        )
    return trainable  # type: ignore[return-value]


def prepare_zero(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    stage: int,
    group: Group | None = None,
    **options: Any,
) -> tuple[nn.Module, ZeroOptimizer]:
    """``model`` itself and a :class:`ZeroOptimizer` of ``optimizer``'s class and
    hyper-parameters (its single param group's) on ``model.parameters()``.

    ``options``: ``algorithm``, ``bucket_mb``. Use the returned optimizer from here on; if
    ``optimizer`` has state already, it is carried over. Blocks on the group (the
    parameters are broadcast from rank 0).
    """
    unknown = set(options) - set(ZERO_OPTIONS)
    if unknown:
        raise TypeError(
            f"strategy 'zero{stage}' does not take {sorted(unknown)}; its options are "
            f"{sorted(('group', *ZERO_OPTIONS))}"
        )
    if len(optimizer.param_groups) != 1:
        raise ValueError(
            f"prepare_zero: the optimizer has {len(optimizer.param_groups)} param groups; "
            f"ZeroOptimizer supports one"
        )
    hyper = {k: v for k, v in optimizer.param_groups[0].items() if k in optimizer.defaults}
    zero = ZeroOptimizer(
        model.parameters(), type(optimizer), stage=stage, group=group, **options, **hyper
    )
    if optimizer.state:
        zero.load_state_dict(optimizer.state_dict())
    return model, zero
