"""A loss term that reads the whole batch at once, under a pipeline: an MoE load-balancing loss.

Some models add to their loss a term that is not a sum over micro-batches and layers: Hugging
Face's Mixtral and Qwen-MoE load-balancing loss multiplies two means taken over every
layer's router outputs of the whole batch (the share of tokens each expert got, the mean
probability it was given). No pipeline stage holds those means before its first backward,
so the term cannot be computed as the micro-batches go. It is linear in what carries a
gradient, though (the probabilities), once the non-differentiable part (the counts) is
known. So each step runs in two passes:

1. a **statistics pass**: the batch's micro-batches go forward through every stage without
   autograd, hooks on the plan's modules add up each call's statistics (a float64 vector),
   and the sums are all-reduced over the pipeline group (and over the other groups the
   caller names: data-parallel replicas, tensor-parallel ranks holding slices of the
   sequence) to the batch's *totals*;
2. the ordinary schedule: on each call the hook adds to the module's output, without
   changing its value, the call's **share** of the term given the totals, with a gradient
   of ``factor`` (the factor the pipeline's loss carries: 1, or the replicas and a loss
   scale), so the backward passes carry the term's exact gradient. The shares of all calls
   sum to the term. Each call's statistics are summed again and compared with the first
   pass: a difference (a non-deterministic router) raises, naming the rank.

The term's value (from the totals) is added to the loss ``step`` returns.

Cost: one extra forward of the batch per step without autograd (about a third of a
step's compute), and per step one all-reduce of ``size`` float64 per group. The statistics
pass's messages: one activation per micro-batch and stage boundary, point to point (tags
of kind 2, the shape messages' kind, micro-batch ``j`` on ``j + 1``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait.comm import ops
from plait.comm.group import Group
from plait.strategies.pipeline.messages import Message, tag


@dataclass(frozen=True)
class BatchLoss:
    """A loss term over the whole batch (module docstring).

    ``modules``: the modules whose outputs it reads (an MoE model's routers), as the plan's
    model holds them. ``size``: the length of the statistics vector. ``statistics(output)``:
    one call's statistics (float64 ``[size]``, no gradient). ``share(output, totals)``: one
    call's differentiable share of the term given the batch's totals. ``value(totals)``:
    the term over the batch. ``carrier``: the index of the output element that carries the
    share's gradient (one the forward goes on with, so its backward runs), or None for an
    output that is a tensor. ``name``: for messages.
    """

    modules: tuple[nn.Module, ...]
    size: int
    statistics: Callable[[Any], torch.Tensor]
    share: Callable[[Any, torch.Tensor], torch.Tensor]
    value: Callable[[torch.Tensor], torch.Tensor]
    carrier: int | None = None
    name: str = "batch loss"


class _Attach(torch.autograd.Function):
    """``x`` unchanged; backward also gives ``share`` the gradient ``factor``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, share: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        ctx.share_shape = share.shape
        ctx.share_dtype = share.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        g = torch.full(ctx.share_shape, ctx.factor, dtype=ctx.share_dtype, device=grad.device)
        return grad, g, None


@dataclass
class BatchLossHooks:
    """The hooks of one rank (module docstring): installed on the plan's modules held by
    this rank's stages."""

    spec: BatchLoss
    rank: int
    mode: str = "off"  # "collect" (statistics pass), "attach" (the schedule), "off"
    factor: float = 1.0
    local: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    again: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    totals: torch.Tensor | None = None

    def install(self, held: Sequence[nn.Module]) -> None:
        ids = {id(m) for stage in held for m in stage.modules()}
        for module in self.spec.modules:
            if id(module) in ids:
                module.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.mode == "collect":
            with torch.no_grad():
                self.local += self.spec.statistics(output).to(self.local)
            return None
        if self.mode != "attach" or not torch.is_grad_enabled():
            return None  # the shape probe, a recomputation's no-grad forward, evaluation
        assert self.totals is not None
        with torch.no_grad():
            self.again += self.spec.statistics(output).to(self.again)
        share = self.spec.share(output, self.totals)
        i = self.spec.carrier
        if i is None:
            return _Attach.apply(output, share, self.factor)
        carried = _Attach.apply(output[i], share, self.factor)
        return (*output[:i], carried, *output[i + 1 :])

    def reset(self, device: torch.device) -> None:
        self.local = torch.zeros(self.spec.size, dtype=torch.float64, device=device)
        self.again = torch.zeros_like(self.local)

    def verify(self, group: Group) -> None:
        """The schedule's statistics equal the statistics pass's on every rank of ``group``
        (one all-reduce of ``group.size`` int64); otherwise every rank raises, naming the
        ranks that differ."""
        flags = torch.zeros(group.size, dtype=torch.int64, device=self.local.device)
        flags[group.rank] = int(not torch.equal(self.local, self.again))
        if group.size > 1:
            ops.all_reduce(flags, "sum", group=group)
        if not bool(flags.any()):
            return
        bad = [group.ranks[r] for r, f in enumerate(flags.tolist()) if f]
        raise RuntimeError(
            f"pipeline: {self.spec.name}: on rank(s) {bad} the statistics of the training "
            f"forward differ from the statistics pass's on the same parameters and batch: "
            f"the modules it reads are not deterministic (router noise, dropout before the "
            f"router), so the term's gradient would be wrong. Make them deterministic in "
            f"training"
        )


def statistics_pass(
    runtime: Any,
    inputs: list[torch.Tensor],
    hooks: BatchLossHooks,
    extras: list[dict[str, torch.Tensor]] | None = None,
) -> None:
    """Every micro-batch forward through this rank's stages without autograd, stage by
    stage (each rank waits only for the activations of stages before its own, so the
    order cannot deadlock), each with its per-micro-batch inputs ``extras`` (:mod:`.plan`);
    ``hooks`` add up the statistics (not those of the runtime's shape probe, run first).
    Point to point over the pp group."""
    extras = extras or [{} for _ in inputs]
    _, in_shapes = runtime._agree_shapes(inputs[0], extras[0])
    hooks.mode = "collect"
    try:
        _forward_all(runtime, inputs, in_shapes, extras)
    finally:
        hooks.mode = "off"


def _forward_all(
    runtime: Any,
    inputs: list[torch.Tensor],
    in_shapes: Any,
    extras: list[dict[str, torch.Tensor]],
) -> None:
    device = inputs[0].device
    local: dict[tuple[int, int], torch.Tensor] = {}
    sends: list[Message] = []
    last = runtime.schedule.stages - 1
    with torch.no_grad():
        for s in range(runtime.schedule.stages):
            if runtime._peer(s) != runtime.rank:
                continue
            for mb, first in enumerate(inputs):
                if s == 0:
                    x = first
                elif (s, mb) in local:
                    x = local.pop((s, mb))
                else:
                    shape, dtype = in_shapes[s]
                    x = runtime.link.wait(
                        runtime.link.irecv(
                            shape,
                            dtype,
                            runtime._peer(s - 1),
                            tag(2, s, mb + 1),
                            "pp_statistics",
                            f"receive the statistics pass's activation of micro-batch {mb} "
                            f"for stage {s} from rank {runtime._peer(s - 1)}",
                            device=device,
                        )
                    )
                y = runtime.stages[s](x, **extras[mb])
                if s == last:
                    continue
                if runtime._peer(s + 1) == runtime.rank:
                    local[(s + 1, mb)] = y
                else:
                    sends.append(
                        runtime.link.isend(
                            y,
                            runtime._peer(s + 1),
                            tag(2, s + 1, mb + 1),
                            "pp_statistics",
                            f"send the statistics pass's activation of micro-batch {mb}",
                        )
                    )
    for msg in sends:
        runtime.link.wait(msg)


def totals(hooks: BatchLossHooks, groups: Sequence[Group]) -> torch.Tensor:
    """This rank's statistics summed over ``groups`` (one all-reduce each)."""
    out = hooks.local.clone()
    for group in groups:
        if group.size > 1:
            ops.all_reduce(out, "sum", group=group)
    return out


__all__ = ["BatchLoss", "BatchLossHooks", "statistics_pass", "totals"]
