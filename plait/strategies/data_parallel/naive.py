"""Naive data parallelism: after backward, all-reduce every gradient, one at a time.

No buckets and no overlap: the readable reference that :class:`DistributedDataParallel`
is tested against, and the "DP" of the seeds. Communication contract, on ``group``:

- wrap: the ranks' parameter lists are compared (:func:`verify_same_parameters`), then
  parameters and buffers are broadcast from rank 0;
- end of every synchronized backward: one all-reduce (sum) of one int32 per trainable
  parameter (which ranks used it since the last synchronized backward) and one per rank
  (its first non-finite gradient, with ``check_finite``), then one
  blocking all-reduce (average) per parameter that some rank used, in registration order.
  A parameter that a rank did not use contributes its ``.grad`` (zeros if None); one that
  no rank used keeps its ``.grad`` untouched (PyTorch DDP's rule, so optimizers skip it);
- ``no_sync()`` / ``require_backward_grad_sync = False``: no communication.

Every failure of these all-reduces is raised by ``backward()`` as a
:class:`~plait.comm.CollectiveError` naming the parameter, the collective and the ranks
that never reached it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from plait import comm
from plait.comm import device
from plait.comm.group import Group
from plait.mesh import Mesh, data_parallel_group
from plait.strategies.consistency import verify_same_parameters
from plait.strategies.data_parallel import grad_sync
from plait.strategies.data_parallel.ddp import broadcast_tensors
from plait.strategies.placement import copies_of_placed
from plait.trace import Tracer

WHO = "NaiveDataParallel"


class NaiveDataParallel(nn.Module):
    """Wrap ``module``; average gradients over ``mesh`` (a :class:`~plait.Mesh`'s ``dp``
    dimension or a group; ``group=`` is accepted as well; default: the world) after backward.

    ``algorithm``: the all-reduce algorithm (``plait.comm``'s names). ``check_finite``:
    ``"raise"`` (default), ``"skip"`` or ``None``, as for DistributedDataParallel (here each
    rank checks its gradients before any all-reduce and the verdict rides in the flags
    all-reduce, so a NaN never spreads). ``tracer``: record each all-reduce as a ``comm``
    span (see :mod:`plait.trace`). ``.module`` is the wrapped
    module. Collective: every rank of the group must wrap and run the same number of
    synchronized backward passes.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        mesh: Mesh | Group | None = None,
        group: Group | None = None,
        algorithm: str = "auto",
        check_finite: str | None = "raise",
        tracer: Tracer | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        group = data_parallel_group(mesh, group, who="NaiveDataParallel")
        self.group = group if group is not None else comm.world()
        self.algorithm = algorithm
        self.tracer = tracer
        self.check_finite = grad_sync.check_policy(check_finite)
        self.skipped_steps = 0
        self.last_nonfinite: str | None = None
        self._backward_passes = 0
        self.require_backward_grad_sync = True
        self._queued = False
        self._named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._used = [False] * len(self._named)
        verify_same_parameters(
            [*module.named_parameters(), *module.named_buffers()], self.group, who=WHO
        )
        if self.group.size > 1:
            broadcast_tensors([*module.parameters(), *module.buffers()], self.group, "auto")
        copies_of_placed(module.parameters(), self.group)
        for i, (_, p) in enumerate(self._named):
            p.register_post_accumulate_grad_hook(self._make_hook(i))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication, inside this block."""
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
        """``torch.nn.utils.clip_grad_norm_`` on the module's (averaged) gradients; local."""
        return grad_sync.clip_grad_norm_(
            self.module.parameters(),
            max_norm,
            norm_type,
            error_if_nonfinite=error_if_nonfinite,
            foreach=foreach,
        )

    def _nonfinite(self, culprits: list[tuple[int, int]]) -> None:
        """Some rank's gradient is not finite (every rank knows, before any gradient was
        reduced): raise on every rank, or skip the step on every rank."""
        named = [(r, self._named[i][0]) for r, i in culprits]
        policy = self.check_finite or "raise"
        message = grad_sync.nonfinite_message(WHO, self._backward_passes, named, "", policy)
        self.last_nonfinite = message
        if policy == "raise":
            raise grad_sync.NonFiniteGradientError(message, named)
        self.skipped_steps += 1
        for _, p in self._named:
            p.grad = None
        warnings.warn(message, RuntimeWarning, stacklevel=2)

    def _make_hook(self, index: int) -> Any:
        def hook(_: torch.Tensor) -> None:
            self._used[index] = True
            if self.require_backward_grad_sync and not self._queued:
                self._queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._average)

        return hook

    def _all_reduce(self, t: torch.Tensor, op: str, span: str, what: str) -> None:
        g = self.group
        token = None
        if self.tracer is not None:
            nbytes = t.numel() * t.element_size()
            token = self.tracer.begin(span, stream="comm", bytes=nbytes)
        seq = g.seq + 1
        try:
            comm.all_reduce(t, op, group=g, algorithm=self.algorithm)
        except Exception as exc:
            raise grad_sync.collective_failure(exc, who=WHO, what=what, group=g, seq=seq) from exc
        finally:
            if token is not None:
                assert self.tracer is not None
                self.tracer.end(token)

    def _average(self) -> None:
        self._queued = False
        self._backward_passes += 1
        g, n = self.group, len(self._named)
        # one int32 per parameter (used by this rank), then one per rank (index + 1 of its
        # first parameter with a non-finite gradient, 0 if none): agreed in one all-reduce
        local = [int(u) for u in self._used] + [0] * g.size
        self._used = [False] * n
        where = device.control_device((p for _, p in self._named), g)
        flags = torch.tensor(local, dtype=torch.int32, device=where)
        if self.check_finite is not None:  # found on the device: no host read per gradient
            grads = [p.grad for _, p in self._named]
            flags[n + g.rank] = grad_sync.first_nonfinite_flag(grads, device=where)
        if g.size > 1:
            self._all_reduce(
                flags, "sum", "all_reduce used flags", "the all-reduce of the used-parameter flags"
            )
        # the teaching version reads its flags on the host every step (DDP does not)
        if self.check_finite is not None:
            agreed = device.read_verdict(flags, who=WHO)
        else:  # on meta the used flags are this rank's own (the fake backend moves nothing)
            agreed = device.host_list(flags, local)
        culprits = [(g.ranks[r], int(v) - 1) for r, v in enumerate(agreed[n:]) if v > 0]
        if culprits:
            self._nonfinite(culprits)
            return
        if g.size == 1:
            return
        for (name, p), used in zip(self._named, agreed[:n], strict=True):
            if not used:
                continue  # no rank used it: leave .grad as it is
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            what = f"the gradient all-reduce of parameter {name!r}"
            self._all_reduce(p.grad, "avg", f"all_reduce {name}", what)
