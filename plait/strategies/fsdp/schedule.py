"""What the units of one sharded tree share: execution orders, prefetch choices and the
reduce-scatters pending until the end of backward (waited for in ``finish_backward``)."""

from __future__ import annotations

import torch

from plait.comm.group import Handle
from plait.strategies.fsdp import streams
from plait.strategies.fsdp.unit import ShardedUnit


class _RootState:
    """What the units of one sharded tree share: execution orders and pending reductions."""

    def __init__(self, units: list[ShardedUnit], roots: list[ShardedUnit], prefetch: bool) -> None:
        self.units = units
        self.roots = roots  # the root module's units (one per parameter group)
        self.first_root, self.last_root = roots[0], roots[-1]  # its first and last hooks
        # prepare's optimizer order: per parameter group, (unit, index) of each parameter
        self.plain_groups: list[list[tuple[ShardedUnit, int]]] | None = None
        self.prefetch = prefetch
        self.tracer = roots[0].config.tracer
        self._tokens: dict[str, int] = {}
        self.forward_order: list[ShardedUnit] = []
        self.backward_order: list[ShardedUnit] = []
        self.forward_recorded = False
        self.backward_recorded = False
        self.position = {"forward": 0, "backward": 0}
        self.in_backward = False
        self.kept: set[ShardedUnit] = set()  # gathered from forward to backward (keeps())
        # (unit, handle (ordered after its side stream on CUDA), reduced shard, gradient)
        self.reductions: list[
            tuple[ShardedUnit, Handle | streams.Ordered | None, torch.Tensor, torch.Tensor]
        ] = []

    def step(
        self, order: list[ShardedUnit], unit: ShardedUnit, recorded: bool, phase: str
    ) -> ShardedUnit | None:
        """Record ``unit`` (first pass) or advance along ``order``; the unit to prefetch."""
        if not recorded:
            order.append(unit)
            return None
        i = self.position[phase]
        self.position[phase] = i + 1
        if not self.prefetch:
            return None
        for following in order[i + 1 :]:  # skip units gathered already (kept, or empty)
            if following.numel and (following._gathering is not None or not following.gathered):
                return following
        return None

    def keeps(self, unit: ShardedUnit) -> bool:
        """Whether ``unit`` stays gathered after its forward although units reshard: the
        root, and the units backward needs first (known from the second forward on)."""
        return unit in self.roots or unit in self.kept

    def _choose_kept(self) -> None:
        """The last unit with parameters to start forward (its backward runs first) and,
        with prefetch, the one before it (the first unit backward would prefetch): freeing
        them after forward would only mean gathering them again at once."""
        last_first = dict.fromkeys(reversed(self.forward_order))
        tail = [u for u in last_first if u.numel and u not in self.roots]
        self.kept = set(tail[: 2 if self.prefetch else 1])

    def begin_forward(self) -> None:
        """Units still gathered from a forward without backward are gathered afresh (the
        shards may have changed since); their pending backward regathers if it comes."""
        self.position["forward"] = 0
        if not self.in_backward:
            for unit in self.units:
                if unit.gathered:
                    unit.reshard()
        self._open("forward")

    def end_forward(self) -> None:
        """After the root's forward: drop prefetches that no unit used; orders are known."""
        for unit in self.units:
            if unit._gathering is not None:
                unit.reshard()
        if not self.forward_recorded and self.forward_order:
            self.forward_recorded = True
            self._choose_kept()
        self._close("forward")

    def begin_backward(self) -> None:
        if self.in_backward:
            return
        self.in_backward = True
        self.position["backward"] = 0
        self._open("backward")
        torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def _open(self, name: str) -> None:
        if self.tracer is not None and name not in self._tokens:
            self._tokens[name] = self.tracer.begin(name, stream="compute")

    def _close(self, name: str) -> None:
        token = self._tokens.pop(name, None)
        if token is not None and self.tracer is not None:
            self.tracer.end(token)

    def finish_backward(self) -> None:
        """End of backward: wait for every reduce-scatter, write shard grads, free all.

        The trace's backward span ends here, when autograd is done; the wait that follows
        is recorded as ``wait for gradients`` (communication backward did not hide)."""
        self._close("backward")
        self._open("wait for gradients")
        try:
            for unit, handle, out, _ in self.reductions:
                if handle is not None:
                    handle.wait()
                unit.accumulate_grad(out)
        finally:
            self.reductions.clear()
            for unit in self.units:
                unit.reshard()
            self.in_backward = False
            self.backward_recorded = self.backward_recorded or bool(self.backward_order)
            self._close("wait for gradients")
