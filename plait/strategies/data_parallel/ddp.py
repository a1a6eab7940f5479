"""Distributed data parallelism with bucketed all-reduce that overlaps the backward pass.

Every rank holds a full replica and computes gradients on its share of the global batch;
averaging the gradients over the group gives the gradient of the global batch (the mean
over 64 samples is the average of two means over 32).

Communication contract, on ``group``:

- wrap: parameters and buffers are broadcast from group rank 0 (one broadcast per dtype),
  so every replica starts equal;
- forward: with ``broadcast_buffers``, buffers are broadcast from rank 0 again;
- backward: gradients are copied into buckets of about ``bucket_mb`` MiB, in the reverse
  of registration order (re-ordered after the first step to the order they became ready,
  as rank 0 saw it). A hook per parameter (post-accumulate-grad) marks it ready; a bucket
  whose gradients are all ready is all-reduced (average) at once, asynchronously, with
  ``algorithm``, while autograd computes the earlier layers' gradients. Buckets are
  launched strictly in index order, so every rank issues the same collectives in the
  same order. Everything is waited for before ``backward()`` returns;
- ``no_sync()`` (or ``require_backward_grad_sync = False``, as PyTorch's DDP): no
  communication; gradients accumulate locally until the next synchronized backward, which
  then averages the accumulated sum;
- with ``reproducible=True``: no communication in backward before the step's last
  micro-batch; then each bucket is summed (not averaged) with
  :func:`~plait.strategies.reproducible.collectives.tree_all_reduce` (an all-to-all, a
  tree sum in rank order, an all-gather: a ring all-reduce's bytes), bitwise the same for
  every ``algorithm``, transport and world size. The micro-batches must be driven by a
  :class:`~plait.strategies.reproducible.ReproducibleRunner` (``forward`` outside its
  ``step`` is refused); ``threads`` (default 1) pins the intra-op threads
  (docs/reproducible.md);
- with ``find_unused_parameters=True``: one more all-reduce (sum) of one int32 per
  parameter at the end of backward, which parameters any rank used.

A parameter that received no gradient in a backward pass is an error unless
``find_unused_parameters=True``. With it, as in PyTorch's DDP, its slot contributes what
its ``.grad`` holds (zeros if None); a parameter that no rank used since the last
synchronized backward keeps its ``.grad`` untouched (None after ``zero_grad()``, so
optimizers skip it: no momentum, no weight decay), and one that some ranks used gets the
average over all ranks.

Failures. Every error of a bucket's all-reduce (a peer that crashed, raised, was killed or
stopped early with uneven data, a timeout) is raised by ``backward()`` as a
:class:`~plait.comm.CollectiveError` that names the bucket, the collective and the ranks
that never reached it (:func:`~plait.strategies.data_parallel.grad_sync.collective_failure`),
whatever
the path: the backend's all-reduce, plait's algorithms, the built-in communication hooks,
or a user hook whose future carries the error (a ``.then`` callback must read its parent's
value, ``fut.value()``). A hook whose callback ignores it is still caught when its
collectives ran on plait's communication thread (plait's algorithms: DDP checks the group's
last one), not when it used the backend's own all-reduce (``"native"``).

Non-finite gradients (``check_finite``). Before its all-reduce each bucket is checked on
its rank (on gloo one sum read on the host, ~1 ms per 25 MiB of float32 on one core; on a
device backend per-parameter flags computed and kept on the device, so the bucket's launch
never waits for a host read: ``flags_on_device``); a rank that finds inf or NaN
sets the bucket's element 0 to NaN, which survives the average, and after the all-reduce
every rank reads element 0 of each averaged bucket (bitwise the same everywhere), so all
ranks take the same decision without an extra collective or a second pass. Only then do
the ranks run one small all-reduce to name which rank(s) and parameter(s) produced it
(an average that overflows to inf although every rank's gradients were finite is not
caught here: the next step's gradients are); then ``"raise"`` (default) raises
:class:`~plait.strategies.data_parallel.grad_sync.NonFiniteGradientError` on every rank,
``"skip"`` sets
every gradient to None on every rank (``optimizer.step()`` leaves the parameters
bit-identical; ``skipped_steps`` counts them) and warns, ``None`` lets the NaN through
(what a loss scaler such as ``torch.amp.GradScaler`` wants: it then skips on every rank).
The decision reads one flag per step on the host, after every bucket was waited for (as
``torch.amp.GradScaler`` reads its found-inf once per step).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from plait import comm
from plait.comm import device, tuner
from plait.comm.group import Group
from plait.mesh import Mesh, data_parallel_group
from plait.strategies.consistency import verify_same_parameters
from plait.strategies.data_parallel import ddp_args, grad_sync
from plait.strategies.data_parallel.buckets import Bucket, build_buckets
from plait.strategies.data_parallel.hooks import CommHook, GradBucket
from plait.strategies.placement import copies_of_placed
from plait.strategies.reproducible.collectives import tree_all_reduce
from plait.strategies.reproducible.tree import Microbatches
from plait.trace import Tracer

MIB = 1 << 20


def _on_the_wire(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t`` in a dtype every backend carries: complex numbers as their real and
    imaginary parts (a RoPE table of complex64), booleans as bytes; others as they are."""
    if t.is_complex():
        return torch.view_as_real(t)
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t


def broadcast_tensors(tensors: list[torch.Tensor], group: Group, algorithm: str) -> None:
    """Broadcast ``tensors`` from group rank 0, one flat message per dtype (complex and
    boolean tensors travel as views of real numbers and bytes, then land in place)."""
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        wire = _on_the_wire(t.detach())
        by_dtype.setdefault((wire.dtype, wire.device), []).append(wire)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        comm.broadcast(flat, 0, group=group, algorithm=algorithm)
        with torch.no_grad():
            for t, piece in zip(same, flat.split([t.numel() for t in same]), strict=True):
                t.copy_(piece.view_as(t))


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` for data-parallel training over ``group`` (default: the world).

    ``bucket_mb``: bucket size in MiB (the first bucket is capped at 1 MiB so that
    communication starts early). ``algorithm``: the bucket all-reduce algorithm
    (``plait.comm``'s names). ``"auto"`` means the backend's own here: it is asynchronous by
    itself, while plait's Python algorithms run on plait's communication thread and compete
    with the backward pass's hooks for the GIL; in ``benchmarks/ddp.py`` that made them
    5-10% slower per step at world 4. ``broadcast_buffers``: re-broadcast
    buffers from rank 0 at every forward. ``find_unused_parameters``: tolerate parameters
    without a gradient (see the module docstring). ``gradient_as_bucket_view``: make
    ``param.grad`` a view into the bucket, saving one copy per step. ``check_finite``:
    ``"raise"`` (default), ``"skip"`` or ``None``, what to do when a gradient holds inf or
    NaN (module docstring). ``tracer``: record forward, backward and each bucket's
    all-reduce (see :mod:`plait.trace`).

    Where it runs: ``mesh=`` (a :class:`~plait.Mesh`: its ``dp`` dimension, or its only
    one; or a group), the name every plait strategy uses; ``group=`` is accepted as well.
    PyTorch names: ``process_group=`` is an alias of ``group=``; ``device_ids`` and
    ``output_device`` are accepted for a module on one CUDA device (``[device]``, that
    device) and must be None for a CPU module; ``require_backward_grad_sync`` is honoured
    like :meth:`no_sync`; ``.module`` is the wrapped module.

    Collective: every rank of the group must wrap (the parameter lists are compared, then
    broadcast from rank 0) and run the same number of synchronized backward passes.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        mesh: Mesh | Group | None = None,
        group: Group | None = None,
        process_group: Group | None = None,
        device_ids: list[int | str | torch.device] | None = None,
        output_device: int | str | torch.device | None = None,
        bucket_mb: float = 25.0,
        algorithm: str = "auto",
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        check_finite: str | None = "raise",
        tracer: Tracer | None = None,
        reproducible: bool = False,
        threads: int | None = 1,
    ) -> None:
        super().__init__()
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        self.module = module
        group = data_parallel_group(mesh, group, who="DistributedDataParallel")
        self.group = ddp_args.pick_group(group, process_group)
        ddp_args.check_devices(module, device_ids, output_device)
        self.device_ids = device_ids
        self.output_device = output_device
        # "auto": plait's shared-memory all-reduce when every rank of the group is on this
        # host (0.83x PyTorch DDP's step where gloo's own gave 1.22x, benchmarks/results/
        # comm_shm_strategies.md), else the backend's own, started without a thread hop
        if algorithm == "auto":
            algorithm = "shm" if comm.ops.shared(self.group) else "native"
        self.algorithm = algorithm
        self.bucket_bytes = int(bucket_mb * MIB)
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.check_finite = grad_sync.check_policy(check_finite)
        self.tracer = tracer
        self.require_backward_grad_sync = True
        self.skipped_steps = 0
        self.last_nonfinite: str | None = None
        self._backward_passes = 0
        self._comm_hook: tuple[Any, CommHook] | None = None
        # reproducible=True: buckets are summed along the fixed micro-batch tree instead of
        # averaged, once per step; the ReproducibleRunner driving the step replaces this
        self.microbatches: Microbatches | None = Microbatches() if reproducible else None
        if reproducible and threads is not None:
            torch.set_num_threads(threads)
        self._named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not self._named:
            raise ValueError("DistributedDataParallel: the module has no trainable parameters")
        verify_same_parameters(
            [*module.named_parameters(), *module.named_buffers()],
            self.group,
            who="DistributedDataParallel",
        )
        if self.group.size > 1:
            params = [p for _, p in module.named_parameters()]
            broadcast_tensors([*params, *module.buffers()], self.group, "auto")
        copies_of_placed(module.parameters(), self.group)
        self._where: dict[nn.Parameter, tuple[int, int]] = {}
        self._index_of = {p: i for i, (_, p) in enumerate(self._named)}
        self._set_buckets(build_buckets(list(reversed(self._named)), self.bucket_bytes))
        self._ready_order: list[int] = []
        self._rebuilt = False
        self._in_backward = False
        self._futures: list[torch.futures.Future[torch.Tensor] | None] = []
        self._seqs: list[int | None] = []
        self._used = [False] * len(self._named)  # since the last synchronized backward
        self._local_nonfinite: int | None = None
        # check_finite's per-bucket flags: kept on the device (per parameter of the
        # bucket, read only on a step found non-finite) or read on the host at once
        self.flags_on_device = tuner.is_device_backend(self.group.backend)
        self._device_flags: dict[int, torch.Tensor] = {}
        self._launched = 0
        self._backward_token: int | None = None
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, (_, p) in enumerate(self._named)
        ]

    # --- configuration -------------------------------------------------------------------
    def _set_buckets(self, buckets: list[Bucket]) -> None:
        self.buckets = buckets
        self._where = {p: (b.index, i) for b in buckets for i, p in enumerate(b.params)}

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Replace the bucket all-reduce with ``hook(state, bucket) -> Future[Tensor]``
        (see :mod:`plait.strategies.data_parallel.hooks`). Call before the first backward. The
        future must fail when the communication fails: in ``.then`` callbacks, read the
        parent's value (``fut.value()``) before using the buffer."""
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook may be called only once")
        self._comm_hook = (state, hook)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication, inside this block
        (the same as setting ``require_backward_grad_sync = False`` for its duration)."""
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        *,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` on the module's parameters; returns the total
        norm. Local: after backward the gradients are averaged and equal on every rank."""
        return grad_sync.clip_grad_norm_(
            self.module.parameters(),
            max_norm,
            norm_type,
            error_if_nonfinite=error_if_nonfinite,
            foreach=foreach,
        )

    # --- forward -------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        tracer = self.tracer
        span = tracer.span("forward") if tracer is not None else contextlib.nullcontext()
        if self.microbatches is not None:
            self.microbatches.check_driven("DistributedDataParallel")
        with span:
            if self.broadcast_buffers and self.group.size > 1:
                self._broadcast_buffers()
            out = self.module(*args, **kwargs)
        if tracer is not None and torch.is_grad_enabled():
            self._mark_backward_start(out)
        return out

    # outside a compiled graph, as PyTorch DDP's own buffer broadcast (its pre-forward)
    @torch.compiler.disable(reason="plait DDP broadcasts rank 0's buffers outside the graph")
    def _broadcast_buffers(self) -> None:
        buffers = list(self.module.buffers())
        if not buffers:
            return
        seq = self.group.seq + 1
        try:
            broadcast_tensors(buffers, self.group, "auto")
        except Exception as exc:
            raise grad_sync.collective_failure(
                exc,
                who="DistributedDataParallel",
                what="the broadcast of rank 0's buffers in forward",
                group=self.group,
                seq=seq,
                collective="broadcast",
            ) from exc

    def _mark_backward_start(self, out: Any) -> None:
        """Open the trace's backward span when the first output gradient is computed."""
        if isinstance(out, dict):
            out = list(out.values())
        tensors = out if isinstance(out, (list, tuple)) else [out]
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._backward_started)

    def _backward_started(self, grad: torch.Tensor) -> None:
        if (
            self.tracer is not None
            and self._backward_token is None
            and self.require_backward_grad_sync
        ):
            self._backward_token = self.tracer.begin("backward", stream="compute")

    # --- backward ------------------------------------------------------------------------
    def _make_hook(self, param_index: int) -> Any:
        def hook(p: torch.Tensor) -> None:
            self._used[param_index] = True
            if not self.require_backward_grad_sync:
                return
            if not self._in_backward:
                self._start_backward()
            self._mark_ready(param_index, p)

        return hook

    def _start_backward(self) -> None:
        self._in_backward = True
        self._launched = 0
        self._futures = [None] * len(self.buckets)
        self._seqs = [None] * len(self.buckets)
        self._local_nonfinite = None
        self._device_flags = {}
        self._backward_passes += 1
        for b in self.buckets:
            b.reset()
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _mark_ready(self, param_index: int, p: torch.Tensor) -> None:
        b_index, i = self._where[p]  # type: ignore[index]
        bucket = self.buckets[b_index]
        if bucket.ready[i]:
            raise RuntimeError(
                f"DistributedDataParallel: parameter {bucket.names[i]!r} received its "
                f"gradient twice in one backward pass; run backward once per step, or "
                f"use no_sync() for the extra passes"
            )
        slot = bucket.slot(i)
        grad = p.grad
        assert grad is not None
        if grad.data_ptr() != slot.data_ptr():
            slot.copy_(grad)
            if self.gradient_as_bucket_view:
                p.grad = slot
        bucket.ready[i] = True
        bucket.pending -= 1
        if not self._rebuilt:
            self._ready_order.append(self._index_of[p])  # type: ignore[index]
        self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch, in index order, every bucket whose gradients are all ready."""
        while self._launched < len(self.buckets) and self.buckets[self._launched].pending == 0:
            self._launch(self.buckets[self._launched])
            self._launched += 1

    def _check_local(self, bucket: Bucket) -> None:
        """Before the all-reduce: if this rank's gradients in ``bucket`` are not finite,
        remember the first such parameter and make the bucket's element 0 a NaN, the flag
        that every rank reads in the averaged bucket (NaN survives any average)."""
        if self.flags_on_device:
            self._check_local_on_device(bucket)
            return
        if grad_sync.bucket_is_finite(bucket.buffer):
            return
        bad = grad_sync.first_nonfinite(
            (self._index_of[p], bucket.slot(i)) for i, p in enumerate(bucket.params)
        )
        if bad is not None and (self._local_nonfinite is None or bad < self._local_nonfinite):
            self._local_nonfinite = bad
        if bad is not None:
            bucket.buffer[0] = float("nan")

    def _check_local_on_device(self, bucket: Bucket) -> None:
        """:meth:`_check_local` without a host read: which parameters of the bucket are
        not finite stays on the device (read only if the step turns out non-finite), and
        element 0 becomes NaN through ``torch.where``."""
        buf = bucket.buffer
        if not buf.dtype.is_floating_point or buf.numel() == 0:
            return
        lengths = [p.numel() for p in bucket.params]
        lengths.append(buf.numel() - sum(lengths))  # padding, if any
        bad = grad_sync.nonfinite_slots(
            buf, torch.tensor(lengths, dtype=torch.int64, device=buf.device)
        )
        self._device_flags[bucket.index] = bad[:-1]
        first = buf[:1]
        first.copy_(torch.where(bad.any(), torch.full_like(first, float("nan")), first))

    def _local_nonfinite_from_device(self) -> int | None:
        """The first parameter (index) whose own gradient was not finite on this rank, from
        the flags :meth:`_check_local_on_device` kept (a host read, on a bad step only)."""
        bad = [
            self._index_of[b.params[i]]
            for b in self.buckets
            if b.index in self._device_flags
            for i, flag in enumerate(self._device_flags[b.index].tolist())
            if flag
        ]
        return min(bad) if bad else None

    def _launch(self, bucket: Bucket) -> None:
        if self.check_finite is not None:
            self._check_local(bucket)
        grad_bucket = GradBucket(
            bucket.index,
            bucket.buffer,
            bucket.params,
            bucket.index == len(self.buckets) - 1,
            self.group,
            self.algorithm,
        )
        token = None
        if self.tracer is not None:
            token = self.tracer.begin(
                f"all_reduce bucket {bucket.index}", stream="comm", bytes=bucket.nbytes
            )
        if self.group.size == 1:
            future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            future.set_result(bucket.buffer)
        elif self.microbatches is not None:  # reproducible mode: the tree-ordered sum
            try:
                handle = tree_all_reduce(
                    bucket.buffer, group=self.group, algorithm=self.algorithm, async_op=True
                )
            except Exception as exc:
                raise self._failure(exc, bucket, self.group.seq) from exc
            assert handle is not None
            future = handle.get_future()  # type: ignore[assignment]
        elif self._comm_hook is not None:
            state, hook = self._comm_hook
            try:
                future = hook(state, grad_bucket)
            except Exception as exc:
                raise self._failure(exc, bucket, self.group.seq) from exc
        else:
            try:
                handle = comm.all_reduce(
                    bucket.buffer,
                    "avg",
                    group=self.group,
                    algorithm=self.algorithm,
                    async_op=True,
                )
            except Exception as exc:
                raise self._failure(exc, bucket, self.group.seq) from exc
            assert handle is not None
            future = handle.get_future()  # type: ignore[assignment]
        self._seqs[bucket.index] = self.group.seq  # the last collective this bucket issued
        if token is not None:
            tracer = self.tracer
            assert tracer is not None
            future.add_done_callback(lambda _: tracer.end(token))
        self._futures[bucket.index] = future

    def _failure(self, exc: BaseException, bucket: Bucket, seq: int | None) -> Exception:
        names = ", ".join(repr(n) for n in bucket.names[:4])
        more = f" and {len(bucket.names) - 4} more" if len(bucket.names) > 4 else ""
        return grad_sync.collective_failure(
            exc,
            who="DistributedDataParallel",
            what=f"the gradient all-reduce of bucket {bucket.index} (parameters {names}{more})",
            group=self.group,
            seq=seq,
        )

    def _finish_backward(self) -> None:
        """End of backward: reduce what is left, wait for everything, write gradients.

        The trace's backward span ends here, when autograd has computed every gradient;
        the wait that follows is recorded as ``wait for gradients``: communication that
        the backward pass did not hide.
        """
        wait_token = None
        if self.tracer is not None:
            if self._backward_token is not None:
                self.tracer.end(self._backward_token)
            wait_token = self.tracer.begin("wait for gradients", stream="compute")
        self._backward_token = None
        try:
            used = self._reduce_unused()
            for b, future in zip(self.buckets, self._futures, strict=True):
                assert future is not None
                try:
                    result = grad_sync.value_of(future)
                except Exception as exc:
                    raise self._failure(exc, b, self._seqs[b.index]) from exc
                if isinstance(result, (list, tuple)) and result:
                    result = result[0]
                if isinstance(result, torch.Tensor) and result.data_ptr() != b.buffer.data_ptr():
                    b.buffer.copy_(result.view_as(b.buffer))
            if self._comm_hook is not None and self.group.size > 1:
                self._check_hook_collectives()
            self._used = [False] * len(self._named)
            if self.check_finite is not None and not self._averages_finite():
                return
            for b in self.buckets:
                for i, p in enumerate(b.params):
                    if used is not None and not used[self._index_of[p]]:
                        continue  # no rank used it: leave .grad as it is (PyTorch's rule)
                    slot = b.slot(i)
                    if p.grad is None or self.gradient_as_bucket_view:
                        p.grad = slot if self.gradient_as_bucket_view else slot.clone()
                    elif p.grad.data_ptr() != slot.data_ptr():
                        p.grad.copy_(slot)
            if not self._rebuilt:
                self._rebuild_buckets()
        finally:
            self._in_backward = False
            if wait_token is not None:
                assert self.tracer is not None
                self.tracer.end(wait_token)

    def _check_hook_collectives(self) -> None:
        """A hook whose ``.then`` ignores its parent's value hides a failed collective; the
        last one it left on plait's communication thread still holds the error (after a
        peer fails, every later collective fails too). The backend's own collectives
        started without that thread cannot be checked this way."""
        try:
            self.group.synchronize()
        except Exception as exc:
            raise self._failure(exc, self.buckets[-1], self._seqs[-1]) from exc

    def _control_device(self) -> torch.device:
        """Where flags for the group's collectives are made (NCCL: the GPU; gloo: the
        parameters' device, staged by plait)."""
        return device.control_device((p for _, p in self._named), self.group)

    def _reduce_unused(self) -> list[bool] | None:
        """Fill the slots of parameters without a gradient in this pass, launch the rest of
        the buckets; with ``find_unused_parameters``, agree on which parameters any rank
        used since the last synchronized backward (one all-reduce of int32 flags)."""
        missing = [(b, i) for b in self.buckets for i in range(len(b.params)) if not b.ready[i]]
        if missing and not self.find_unused_parameters:
            names = ", ".join(repr(b.names[i]) for b, i in missing[:8])
            raise RuntimeError(
                f"DistributedDataParallel: parameters {names} received no gradient "
                f"in this backward pass (unused in forward?). Pass "
                f"find_unused_parameters=True to DistributedDataParallel (or "
                f"plait.prepare) to reduce them as zeros, or remove them from the "
                f"module"
            )
        for b, i in missing:
            p, slot = b.params[i], b.slot(i)
            if p.grad is None:  # what it accumulated under no_sync, if anything
                slot.zero_()
            elif p.grad.data_ptr() != slot.data_ptr():
                slot.copy_(p.grad)
            b.ready[i] = True
            b.pending -= 1
        if missing:
            self._launch_ready()
        if not self.find_unused_parameters:
            return None
        local = [int(u) for u in self._used]
        flags = torch.tensor(local, dtype=torch.int32, device=self._control_device())
        if self.group.size > 1:
            seq = self.group.seq + 1
            try:
                comm.all_reduce(flags, "sum", group=self.group)
            except Exception as exc:
                raise grad_sync.collective_failure(
                    exc,
                    who="DistributedDataParallel",
                    what="the all-reduce of the used-parameter flags (find_unused_parameters)",
                    group=self.group,
                    seq=seq,
                ) from exc
        return [bool(v) for v in device.host_list(flags, local)]  # a host read (as torch's DDP)

    def _averages_finite(self) -> bool:
        """After the all-reduce: True unless some rank flagged a bucket (its element 0 is
        not finite; the averaged buckets are bitwise the same on every rank, so every rank
        decides alike). Otherwise every rank names the culprits, then raises or skips."""
        firsts = torch.cat([b.buffer[:1].float() for b in self.buckets])  # dtypes may differ
        flagged = (~torch.isfinite(firsts)).any()
        if not device.read_verdict(flagged, who="DistributedDataParallel")[0]:  # one host read
            return True
        after = next(b.names[0] for b in self.buckets if not torch.isfinite(b.buffer[:1]).all())
        if self.flags_on_device:
            self._local_nonfinite = self._local_nonfinite_from_device()
        culprits = grad_sync.name_culprits(self._local_nonfinite, self.group)
        named = [(r, self._named[i][0]) for r, i in culprits]
        policy = self.check_finite or "raise"
        message = grad_sync.nonfinite_message(
            "DistributedDataParallel",
            self._backward_passes,
            named,
            after,
            policy,
        )
        self.last_nonfinite = message
        if policy == "raise":
            raise grad_sync.NonFiniteGradientError(message, named)
        self.skipped_steps += 1
        for _, p in self._named:
            p.grad = None
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        if not self._rebuilt:
            self._rebuild_buckets()
        return False

    def _rebuild_buckets(self) -> None:
        """After the first step: buckets in the order rank 0 saw gradients become ready."""
        self._rebuilt = True
        padding = [-1] * (len(self._named) - len(self._ready_order))
        local = self._ready_order + padding
        order = torch.tensor(local, dtype=torch.int64, device=self._control_device())
        if self.group.size > 1:
            comm.broadcast(order, 0, group=self.group, algorithm="auto")
        # once, after the first backward; rank 0's own order where no data moves (fake)
        seen = [int(i) for i in device.host_list(order, local if self.group.rank == 0 else None)]
        seen = [i for i in seen if i >= 0]
        unseen = set(range(len(self._named))) - set(seen)
        rest = [i for i in reversed(range(len(self._named))) if i in unseen]
        ordered = [self._named[i] for i in seen + rest]
        if [id(p) for _, p in ordered] == [id(p) for b in self.buckets for p in b.params]:
            return
        old = {p: b.slot(i).clone() for b in self.buckets for i, p in enumerate(b.params)}
        self._set_buckets(build_buckets(ordered, self.bucket_bytes))
        if self.gradient_as_bucket_view:
            for b in self.buckets:
                for i, p in enumerate(b.params):
                    b.slot(i).copy_(old[p])
                    if p.grad is not None:
                        p.grad = b.slot(i)
