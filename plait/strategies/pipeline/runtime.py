"""Run any valid schedule on a pipeline group: this rank's actions, in order.

Communication contract (all point-to-point on the ``pp`` group, tagged per tensor, counted
in ``plait.comm.group_stats`` as ``pp_activation`` / ``pp_gradient`` / ``pp_tied_grad``):

=========================  ==================================  ===========================
when                        what                                bytes per micro-batch
=========================  ==================================  ===========================
first step of a shape       stage s -> s+1: output shape, dtype  80 (int64 x 10), once
SEND_F / RECV_F             activation, stage s -> s+1           b*s*h*dtype (GPT: one block
                                                                 boundary)
SEND_B / RECV_B             its gradient, stage s+1 -> s         same
end of step, tied weights   gradient exchange first <-> last     the tied tensor, each way
                            stage ranks: this step's parts,
                            summed on both, added to what
                            earlier steps left (accumulation)
end of step                 broadcast of the mean loss           one scalar
=========================  ==================================  ===========================

Per-stage context (a plan's rotary embeddings and causal mask) is recomputed by each stage
from its input activation's shape (:mod:`.plan`), never sent; so are a micro-batch's
per-micro-batch inputs (a padded batch's attention mask): every rank holds the whole batch
and hands micro-batch ``j``'s rows to each forward of ``j`` (no message).

Sends are started when the schedule says and never waited on until the end of the step
(so they overlap the following compute); receives are posted where the schedule says (one
compute action ahead, in the order the peer sends: gloo delivers a pair's messages in
order, see :func:`~.schedules.add_comms`) and waited on by the action that reads them.
Every wait is bounded by the group's timeout and raises naming the peer rank and the
tensor. A stage that raises tells the others through the store (they fail at once with
its message) before its error propagates.

Backward: ``B`` is one ``torch.autograd.backward``. Split (zero-bubble) schedules run the
forward of each micro-batch that the schedule backwards as ``I`` + ``W`` with the stage's
splittable layers holding their parameters out of the graph (:mod:`.deferred`): ``I`` is
one ``torch.autograd.backward`` that reaches the stage input and keeps each split layer's
input and output gradient; ``W`` computes the weight gradients from those (one matmul per
linear, a reduction per norm, an index-add per embedding), accumulated into ``.grad``.
Layers that cannot split get their weight gradient in ``I``, as in ``B``
(``Runtime.split_reports`` names them). With ``recompute`` the forward keeps only the stage
input and runs again (with autograd) right before the backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from plait.comm import watchdog
from plait.comm.group import Group
from plait.strategies.data_parallel.grad_sync import bucket_is_finite
from plait.strategies.pipeline.actions import Action, Kind, Schedule
from plait.strategies.pipeline.deferred import Deferred, SplitBackward, SplitReport
from plait.strategies.pipeline.finite import forward_flag
from plait.strategies.pipeline.messages import (
    META,
    Link,
    Message,
    PipelineError,
    decode_meta,
    encode_meta,
    tag,
)
from plait.strategies.pipeline.split import Stage
from plait.strategies.reproducible import pipeline as reproducible
from plait.strategies.reproducible.tree import Microbatches
from plait.trace import Tracer


@dataclass
class _Ctx:
    """What a stage keeps for one micro-batch between its forward and its backward."""

    x: torch.Tensor | None
    target: torch.Tensor | None = None
    # the micro-batch's per-micro-batch inputs (plan.py), for a recomputation's forward
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    y: torch.Tensor | None = None
    # the weight-gradient inputs I keeps for W, when this micro-batch's backward is split
    deferred: Deferred | None = None


_Shapes = dict[int, tuple[torch.Size, torch.dtype]]
Extras = list[dict[str, torch.Tensor]]  # per micro-batch: its per-micro-batch inputs


class Runtime:
    """Executes ``schedule`` for this rank of ``group`` on ``stages`` (stage index ->
    :class:`Stage`). :meth:`step` runs one global batch, already cut into micro-batches."""

    def __init__(
        self,
        schedule: Schedule,
        stages: dict[int, Stage],
        *,
        group: Group,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        mean_loss: bool = True,
        recompute: bool = False,
        tracer: Tracer | None = None,
        tied: list[tuple[torch.nn.Parameter, int]] | None = None,
        watch_forward: bool = False,
    ) -> None:
        self.schedule = schedule
        self.stages = stages
        self.group = group
        self.rank = group.rank
        self.loss_fn = loss_fn
        self.mean_loss = mean_loss  # loss_fn is a micro-batch mean: divide it by m
        # with watch_forward: the first (stage, micro-batch) of this step whose forward
        # output is not finite although its input was (one sum per forward)
        self.watch_forward = watch_forward
        self.nonfinite_forward: tuple[int, int] | None = None
        # on a device backend (set by the pipeline): no host read per forward; one flag
        # per watched forward kept on the device instead, (stage, micro-batch, flag)
        self.flags_on_device = False
        self.forward_flags: list[tuple[int, int, torch.Tensor]] = []
        # a meta model's other stages (set by the pipeline), run on meta only to learn a
        # later stage's input shape, which a message on the fake backend does not carry
        self.shape_stages: dict[int, Stage] = {}
        self.recompute = recompute
        self.tracer = tracer
        self.link = Link(group, tracer)
        self.microbatches: Microbatches | None = None  # reproducible=True: the fixed tree
        self.tied = tied or []  # (parameter, peer rank) pairs whose gradients are summed
        self.last = schedule.stages - 1
        self.shapes: dict[tuple[Any, ...], tuple[_Shapes, _Shapes]] = {}
        self.peak_in_flight: dict[int, int] = {}
        # (stage, micro-batch) pairs backwarded as I + W, and each such stage's splitter
        self.split = {(a.stage, a.mb) for acts in schedule.ranks for a in acts if a.kind is Kind.I}
        self.splitters = {
            s: SplitBackward(stage)
            for s, stage in stages.items()
            if any(k == s for k, _ in self.split)
        }

    @property
    def split_reports(self) -> dict[int, SplitReport]:
        """Per stage backwarded as I + W: which modules split, which fall back and why."""
        return {s: sb.report for s, sb in self.splitters.items()}

    def _peer(self, stage: int) -> int:
        return self.schedule.placement[stage]

    # --- shapes, agreed once per input shape -------------------------------------------------
    def _agree_shapes(
        self, first: torch.Tensor, extras: dict[str, torch.Tensor] | None = None
    ) -> tuple[_Shapes, _Shapes]:
        """Output shape and dtype of every stage, for one micro-batch (``first``, with its
        per-micro-batch inputs ``extras``). Stage by stage: a rank runs its stage on zeros
        of the incoming shape (no autograd) and sends the output's shape to the next stage's
        rank."""
        key = (tuple(first.shape), first.dtype)
        if key in self.shapes:
            return self.shapes[key]
        out: _Shapes = {}  # this rank's stages: output shape and dtype
        inp: _Shapes = {}  # this rank's stages: input shape and dtype when it arrives by p2p
        incoming: tuple[torch.Size, torch.dtype] | None = None
        for s in range(self.schedule.stages):
            if self._peer(s) != self.rank:
                incoming = None
                continue
            if s == 0:
                x = first
            else:
                if incoming is None:  # from another rank
                    meta = self.link.wait(
                        self.link.irecv(
                            torch.Size([META]),
                            torch.int64,
                            self._peer(s - 1),
                            tag(2, s, 0),
                            "pp_shape",
                            f"receive the activation shape for stage {s} from rank "
                            f"{self._peer(s - 1)}",
                            device=first.device,
                        )
                    )
                    if meta.is_meta and self._derivable(s):  # a meta model
                        incoming = inp[s] = self._derive_shape(first, s, extras)
                    elif meta.is_meta:
                        raise RuntimeError(
                            f"pipeline: schedule {self.schedule.name!r} places stage {s} on "
                            f"pp rank {self.rank}, whose input shape arrives in a message "
                            f"from pp rank {self._peer(s - 1)}; on the meta device a "
                            f"message carries no values, so the shape cannot be read. Run "
                            f"this schedule on real tensors, or use one with one stage per "
                            f"rank (gpipe, 1f1b, zb-h1) on meta"
                        )
                    else:
                        incoming = inp[s] = decode_meta(meta)
                x = torch.zeros(incoming[0], dtype=incoming[1], device=first.device)
            with torch.no_grad():
                y = self.stages[s](x, **(extras or {}))
            out[s] = (y.shape, y.dtype)
            incoming = out[s]
            if s < self.last and self._peer(s + 1) != self.rank:
                self.link.wait(
                    self.link.isend(
                        encode_meta(y).to(first.device),  # NCCL carries CUDA tensors only
                        self._peer(s + 1),
                        tag(2, s + 1, 0),
                        "pp_shape",
                        f"send the activation shape of stage {s}",
                    )
                )
        self.shapes[key] = (out, inp)
        return out, inp

    def _derivable(self, s: int) -> bool:
        return all(t in self.stages or t in self.shape_stages for t in range(s))

    def _derive_shape(
        self, first: torch.Tensor, s: int, extras: dict[str, torch.Tensor] | None
    ) -> tuple[torch.Size, torch.dtype]:
        """Stage ``s``'s input shape and dtype from running stages ``0 .. s-1`` here on the
        meta device (a meta model: no values, nothing computed), for a message that
        carries none (the fake backend)."""
        x = first
        with torch.no_grad():
            for t in range(s):
                x = (self.stages.get(t) or self.shape_stages[t])(x, **(extras or {}))
        return x.shape, x.dtype

    # --- one step -------------------------------------------------------------------------
    def step(
        self,
        inputs: list[torch.Tensor],
        targets: list[torch.Tensor | None],
        extras: Extras | None = None,
    ) -> torch.Tensor:
        """Run this rank's actions for the micro-batches ``inputs`` / ``targets`` (and
        ``extras``: each micro-batch's per-micro-batch inputs, handed to every forward of it,
        see :mod:`.plan`); returns the sum of the micro-batch losses, each divided by ``m``
        when ``mean_loss`` (on the last stage's rank; zero elsewhere). Blocks on the
        neighbouring ranks (each wait bounded)."""
        sched = self.schedule
        m = sched.m
        extras = extras or [{} for _ in inputs]
        out_shapes, in_shapes = self._agree_shapes(inputs[0], extras[0])
        ctx: dict[tuple[int, int], _Ctx] = {}
        local_act: dict[tuple[int, int], torch.Tensor] = {}
        local_grad: dict[tuple[int, int], torch.Tensor] = {}
        recv_act: dict[tuple[int, int], Message] = {}
        recv_grad: dict[tuple[int, int], Message] = {}
        grad_in: dict[tuple[int, int], torch.Tensor] = {}
        sends: list[Message] = []
        held: dict[int, int] = {}
        device = inputs[0].device  # the stages', where received tensors must land
        loss = torch.zeros((), dtype=torch.float64, device=device)
        self.nonfinite_forward = None
        self.forward_flags = []
        # tied gradients from earlier steps (accumulation): put aside, so that only this
        # step's contributions are exchanged, then added back
        earlier = [param.grad for param, _ in self.tied]
        for param, _ in self.tied:
            param.grad = None
        current: Action | None = None
        try:
            for a in sched.ranks[self.rank]:
                current = a
                s, mb = a.stage, a.mb
                if a.kind is Kind.RECV_F:
                    shape, dtype = in_shapes[s]
                    recv_act[(s, mb)] = self.link.irecv(
                        shape,
                        dtype,
                        self._peer(s - 1),
                        tag(0, s, mb),
                        "pp_activation",
                        f"receive the activation of micro-batch {mb} for stage {s} from rank "
                        f"{self._peer(s - 1)} (stage {s - 1})",
                        device=device,
                    )
                elif a.kind is Kind.RECV_B:
                    shape, dtype = out_shapes[s]
                    recv_grad[(s, mb)] = self.link.irecv(
                        shape,
                        dtype,
                        self._peer(s + 1),
                        tag(1, s, mb),
                        "pp_gradient",
                        f"receive the gradient of micro-batch {mb} for stage {s} from rank "
                        f"{self._peer(s + 1)} (stage {s + 1})",
                        device=device,
                    )
                elif a.kind is Kind.SEND_F:
                    y = ctx[(s, mb)].y
                    assert y is not None
                    sends.append(
                        self.link.isend(
                            y,
                            self._peer(s + 1),
                            tag(0, s + 1, mb),
                            "pp_activation",
                            f"send the activation of micro-batch {mb} to rank {self._peer(s + 1)}",
                        )
                    )
                elif a.kind is Kind.SEND_B:
                    sends.append(
                        self.link.isend(
                            grad_in.pop((s, mb)),
                            self._peer(s - 1),
                            tag(1, s - 1, mb),
                            "pp_gradient",
                            f"send the gradient of micro-batch {mb} to rank {self._peer(s - 1)}",
                        )
                    )
                elif a.kind is Kind.F:
                    if s == 0:
                        x = inputs[mb]
                    elif (s, mb) in local_act:
                        x = local_act.pop((s, mb))
                    else:
                        x = self.link.wait(recv_act.pop((s, mb)))
                    with self._span(a):
                        target = targets[mb] if s == self.last else None
                        c = self._forward(s, mb, x, target, m, extras[mb])
                    ctx[(s, mb)] = c
                    if self.watch_forward and self.nonfinite_forward is None:
                        self._watch(s, mb, x, c.y)
                    if s == self.last:
                        assert c.y is not None
                        loss += c.y.detach().to(torch.float64)
                    elif self._peer(s + 1) == self.rank:
                        assert c.y is not None
                        local_act[(s + 1, mb)] = c.y.detach()
                    held[s] = held.get(s, 0) + 1
                    self.peak_in_flight[s] = max(self.peak_in_flight.get(s, 0), held[s])
                else:  # B, I, W
                    g = None
                    if a.kind is not Kind.W and s < self.last:
                        if (s, mb) in local_grad:
                            g = local_grad.pop((s, mb))
                        else:
                            g = self.link.wait(recv_grad.pop((s, mb)))
                    with self._span(a):
                        with reproducible.one_microbatch(self.microbatches, self.stages[s], mb):
                            dx = self._backward(a.kind, s, ctx[(s, mb)], g)
                    if a.kind is not Kind.W and s > 0:
                        assert dx is not None, f"stage {s} produced no input gradient"
                        if self._peer(s - 1) == self.rank:
                            local_grad[(s - 1, mb)] = dx
                        else:
                            grad_in[(s, mb)] = dx
                    if a.kind in (Kind.B, Kind.W):
                        del ctx[(s, mb)]
                        held[s] -= 1
            current = None
            for msg in sends:
                self.link.wait(msg)
            reproducible.finish(self.microbatches, self.stages)
            self._sum_tied(earlier)
        except PipelineError as exc:
            watchdog.fail(self.group, exc)
            raise
        except Exception as exc:
            where = f"in {current}" if current is not None else "after its last action"
            stage = f" (stage {current.stage})" if current is not None else ""
            error = PipelineError(
                f"pipeline: rank {self.group.global_rank} (pp rank {self.rank}){stage} failed "
                f"{where}: {type(exc).__name__}: {exc}"
            )
            watchdog.fail(self.group, error)
            raise error from exc
        return loss

    def _watch(self, s: int, mb: int, x: torch.Tensor, y: torch.Tensor | None) -> None:
        if self.flags_on_device:
            flag = None if y is None else forward_flag(x, y)
            if flag is not None:
                self.forward_flags.append((s, mb, flag))
            return
        if y is None or not y.is_floating_point() or bucket_is_finite(y.detach()):
            return
        if not x.is_floating_point() or bucket_is_finite(x.detach()):
            self.nonfinite_forward = (s, mb)

    def _span(self, a: Action) -> contextlib.AbstractContextManager[None]:
        if self.tracer is None:
            return contextlib.nullcontext()
        return self.tracer.span(a.kind.value, stage=a.stage, mb=a.mb)

    # --- compute --------------------------------------------------------------------------
    def _forward(
        self,
        s: int,
        mb: int,
        x: torch.Tensor,
        target: torch.Tensor | None,
        m: int,
        extras: dict[str, torch.Tensor],
    ) -> _Ctx:
        if x.is_floating_point():
            x = x.detach().requires_grad_(True)
        c = _Ctx(x, target, extras=extras)
        if (s, mb) in self.split:
            c.deferred = Deferred()
        if self.recompute:
            with torch.no_grad():
                y = self.stages[s](x, **extras)
            c.y = self._loss(y, target, m) if s == self.last else y
            return c
        self._run(s, c, target, m)
        return c

    def _deferring(self, s: int, c: _Ctx) -> contextlib.AbstractContextManager[None]:
        if c.deferred is None:
            return contextlib.nullcontext()
        return self.splitters[s].deferring(c.deferred)

    def _run(self, s: int, c: _Ctx, target: torch.Tensor | None, m: int) -> None:
        """Forward with autograd; split layers keep W's inputs when the backward is split."""
        assert c.x is not None
        with self._deferring(s, c):
            y = self.stages[s](c.x, **c.extras)
        c.y = self._loss(y, target, m) if s == self.last else y

    def _loss(self, y: torch.Tensor, target: torch.Tensor | None, m: int) -> torch.Tensor:
        if target is None:
            raise ValueError("pipeline: the last stage needs targets")
        loss = self.loss_fn(y, target)
        return loss / m if self.mean_loss else loss

    def _backward(self, kind: Kind, s: int, c: _Ctx, g: torch.Tensor | None) -> torch.Tensor | None:
        if kind is Kind.W:
            assert c.deferred is not None, f"W of stage {s} without its I"
            c.deferred.apply()
            c.deferred = None
            return None
        if self.recompute:
            self._run(s, c, c.target, self.schedule.m)
        assert c.y is not None and c.x is not None
        # I: the same call as B; split layers compute only their input gradient and keep
        # W's inputs (recomputation inside the model, as checkpointing, splits too)
        with self._deferring(s, c):
            torch.autograd.backward(c.y, g)
        c.y = None
        return c.x.grad if c.x.requires_grad else None

    # --- tied weights ---------------------------------------------------------------------
    def _sum_tied(self, earlier: list[torch.Tensor | None]) -> None:
        """Each tied parameter's gradient: what earlier steps left (``earlier``, added in
        place so a ``.grad`` view keeps its storage) plus this step's contributions of
        both ranks, added in the same order on both (lower pp rank's first)."""
        for i, ((param, peer), before) in enumerate(zip(self.tied, earlier, strict=True)):
            mine = param.grad if param.grad is not None else torch.zeros_like(param)
            step = self.link.exchange_sum(mine, peer, tag(3, i, 0))
            if before is None:
                param.grad = step
            else:
                with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
                    before.add_(step)
                param.grad = before
