"""Healing FSDP gathered one unit at a time (``HealingTrainer(zero=3, wrap=...)``): each
unit's parameters exist in full only around its forward and its backward, so a step's
peak holds the largest unit (and the root unit), not the model. A model with no
top-level module holding parameters is all root unit under the default: the whole model.

Units are chosen as plait's FSDP chooses them (``wrap``, :func:`select`): ``"children"``
(the top-level modules that hold trainable parameters), a set or tuple of module classes
(the outermost modules of those classes), or a list of modules; units do not nest. The
trainable parameters in no unit form the **root unit**, gathered at the step's start and
kept until the exchange, as FSDP keeps its root. Frozen parameters and buffers stay
replicated (:mod:`.fsdp`).

Why a fixed order: the gathers of a step must pair up across the members, and after a
death the members run different numbers of micro-batches (a survivor computes the dead
slot's block too). Every member knows ``owned`` (the blocks per member), hence ``K``, the
most blocks any member computes this step. The step runs ``K`` **rounds** of ``per``
micro-batches; in round ``k`` a member with a ``k``-th block computes it, and a member
with fewer blocks is *idle*: it takes part in the same gathers in the same order with no
compute (:meth:`UnitGathers.idle`). One micro-batch gathers the units in the order
:func:`gather_order` lists (plain data: forward ``0 .. U-1``, backward ``U-2 .. 0``; the
last unit stays gathered from its forward to its backward, the unit backward needs
first, as plait's FSDP keeps it). Hooks on the unit modules check that the model calls
the units in that order and raise, naming the unit, if it does not (a model whose forward
calls its units in another order lists them in that order with ``wrap=[...]``, or
gathers the whole model with ``wrap=None``).

Communication contract (one collective per gather on the generation's group, counted as
``all_gather`` / ``heal/zero_unit``): the layout of :mod:`.zero` (member ``i`` holds chunk
``i`` and mirrors chunk ``i + 1``); each member sends the piece of the unit inside its own
chunk to every member that holds neither it nor its mirror and is not idle this round,
and receives the pieces of the chunks it does not hold (none when idle), straight into
the parameters' storage, one message per parameter a piece touches. An active member
receives ``(n-2)/n`` of the unit per gather; ``2U-1`` gathers per micro-batch and ``K *
per`` micro-batches per step, against one gather of the model per step for the
whole-model path (:meth:`~.fsdp.ShardedParams.unshard`): per-unit trades bytes on the
wire for memory. The values are copies of the chunks, so the step's bits are the
whole-model path's and one process's (tests/test_heal_units.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from plait.comm.group import Channel, Group
from plait.heal.fsdp import ShardedParams
from plait.heal.zero import bounds

CHILDREN = "children"  # wrap's default: every top-level module holding trainable parameters
Wrap = str | set[type[nn.Module]] | frozenset[type[nn.Module]] | tuple[type[nn.Module], ...]
Segment = tuple[nn.Parameter, int, int, int, int]  # param, its lo, hi; the chunk's lo, hi


def gather_order(units: int) -> list[int]:
    """The units one micro-batch gathers, in order: its forward ``0 .. U-1``, its
    backward ``U-2 .. 0`` (the last unit is kept from its forward to its backward)."""
    return list(range(units)) + list(range(units - 2, -1, -1))


def select(module: nn.Module, wrap: Wrap | Sequence[nn.Module]) -> list[nn.Module]:
    """The modules ``wrap`` makes units of, in the order the forward must call them."""
    if isinstance(wrap, str):
        if wrap != CHILDREN:
            raise ValueError(f"healing zero=3: wrap={wrap!r}; the only name is {CHILDREN!r}")
        return [c for c in module.children() if any(p.requires_grad for p in c.parameters())]
    if isinstance(wrap, (set, frozenset, tuple)) and all(isinstance(c, type) for c in wrap):
        classes, chosen, inside = tuple(wrap), [], set[int]()
        for m in module.modules():  # pre-order: the outermost first
            if id(m) in inside:
                continue
            if m is not module and isinstance(m, classes):
                chosen.append(m)
                inside.update(id(d) for d in m.modules())
        return chosen
    if isinstance(wrap, list) and all(isinstance(m, nn.Module) for m in wrap):
        subs = {id(m) for m in module.modules() if m is not module}
        for m in wrap:
            if id(m) not in subs:
                raise ValueError(
                    f"healing zero=3: {type(m).__name__} in wrap is not a submodule of the "
                    f"model (the root is the root unit already)"
                )
            for other in wrap:
                if other is not m and any(d is other for d in m.modules()):
                    raise ValueError(
                        f"healing zero=3: units do not nest: {type(other).__name__} in wrap "
                        f"is inside {type(m).__name__}; list one of them"
                    )
        return list(wrap)
    raise TypeError(
        f"healing zero=3: wrap must be {CHILDREN!r}, a set or tuple of module classes, a "
        f"list of modules, or None (the whole model gathered at the step's start); got "
        f"{wrap!r} (a parameter count, plait FSDP's int, would nest units)"
    )


@dataclass
class Unit:
    """One unit: its module (None for the root unit) and its trainable parameters with
    their ``(start, stop)`` in the flat vector of the chunks."""

    name: str
    module: nn.Module | None
    params: list[tuple[nn.Parameter, int, int]]
    segments: dict[int, list[list[Segment]]] = field(default_factory=dict)  # by members

    @property
    def numel(self) -> int:
        return sum(stop - start for _, start, stop in self.params)

    def cut(self, numel: int, n: int) -> list[list[Segment]]:
        """Per chunk of ``n``: the pieces of this unit's parameters inside it."""
        if n not in self.segments:
            spans = bounds(numel, n)
            self.segments[n] = [
                [
                    (p, lo - start, hi - start, lo - c0, hi - c0)
                    for p, start, stop in self.params
                    for lo, hi in [(max(start, c0), min(stop, c1))]
                    if lo < hi
                ]
                for c0, c1 in spans
            ]
        return self.segments[n]


class UnitGathers:
    """Gathers ``sharded``'s parameters unit by unit during a step (module docstring).
    ``slot``: this member's, for the messages. Hooks on the unit modules act only between
    :meth:`begin` and :meth:`finish`."""

    def __init__(
        self,
        sharded: ShardedParams,
        module: nn.Module,
        *,
        wrap: Wrap | Sequence[nn.Module],
        slot: int,
    ) -> None:
        self.sharded, self.slot = sharded, slot
        offsets, start = {}, 0
        for p in sharded.params:
            offsets[id(p)] = (start, start + p.numel())
            start += p.numel()
        names = {id(m): name for name, m in module.named_modules()}
        claimed: dict[int, str] = {}
        self.units: list[Unit] = []
        for m in select(module, wrap):
            params = []
            for pname, p in m.named_parameters():
                if id(p) not in offsets:
                    continue  # frozen: replicated, never gathered
                if id(p) in claimed:
                    raise ValueError(
                        f"healing zero=3: parameter {names[id(m)]}.{pname} is in units "
                        f"{claimed[id(p)]} and {names[id(m)]} (tied weights); units must not "
                        f"share parameters: leave one of them out of wrap"
                    )
                claimed[id(p)] = names[id(m)]
                params.append((p, *offsets[id(p)]))
            if params:
                self.units.append(Unit(names[id(m)], m, params))
        if not self.units and wrap != CHILDREN:
            raise ValueError(
                f"healing zero=3: wrap={wrap!r} selects no module holding trainable "
                f"parameters; name the modules to gather one at a time, or pass wrap=None"
            )
        rest = [(p, *offsets[id(p)]) for p in sharded.params if id(p) not in claimed]
        self.root = Unit("(root)", None, rest)
        self.order = gather_order(len(self.units))
        self.active = False
        self.group: Group | None = None
        self.blocks: list[int] = []  # blocks this step per channel rank
        self.per_round = 1  # gathers per round
        self.count = 0  # unit gathers this step
        self.cursor = len(self.order)  # position in this micro-batch's order
        self.left: list[int] = [len(u.params) for u in self.units]
        for i, u in enumerate(self.units):
            assert u.module is not None
            u.module.register_forward_pre_hook(partial(self._pre_forward, i))
            u.module.register_forward_hook(partial(self._post_forward, i))
            for p, _, _ in u.params:
                p.register_post_accumulate_grad_hook(partial(self._accumulated, i))

    # --- the step ----------------------------------------------------------------------
    def begin(self, group: Group, *, owned: dict[int, list[int]], per: int) -> None:
        """The step's start: the root unit gathered (one collective on ``group``, every
        member at once), the rounds set from ``owned`` (blocks per slot) and ``per``
        (micro-batches per block)."""
        self.group = group
        self.blocks = [len(owned[s]) for s in group.ranks]
        self.per_round = per * len(self.order)
        self.count, self.cursor = 0, len(self.order)
        self.left = [len(u.params) for u in self.units]
        self._release(self.sharded.params)  # gathered whole by unshard() between steps
        self.sharded.gathered = False
        self._gather(self.root, idle=frozenset())
        self.active = True

    def idle(self, rounds: int) -> None:
        """Take part in ``rounds`` rounds of gathers with no compute (this member has
        fewer blocks than the most any member has). Collective on the step's group."""
        for _ in range(rounds * self.per_round):
            self._next_gather(self.units[self.order[self.count % len(self.order)]])

    def finish(self) -> None:
        """After the last round: every gather done, the hooks off (local). The exchange
        frees the parameters (:meth:`~.fsdp.ShardedParams.exchange`)."""
        self.active = False
        want = max(self.blocks, default=0) * self.per_round
        if self.count != want:
            raise RuntimeError(
                f"healing zero=3: slot {self.slot} gathered {self.count} units this step, "
                f"its peers {want}: a micro-batch did not run every unit's forward and "
                f"backward once in order {[self.units[i].name for i in self.order]} (a unit "
                f"skipped by the model's control flow, or without a gradient?); gather the "
                f"whole model with wrap=None"
            )

    # --- hooks -------------------------------------------------------------------------
    def _expect(self, i: int, where: str) -> None:
        if self.cursor >= len(self.order) and where == "forward":
            self.cursor = 0  # a new micro-batch: what its last backward left is freed
            for u in self.units:
                self._release([p for p, _, _ in u.params])
        want = self.order[self.cursor] if self.cursor < len(self.order) else None
        if want != i:
            expected = "no unit" if want is None else f"unit {self.units[want].name}"
            raise RuntimeError(
                f"healing zero=3: slot {self.slot}: the {where} reached unit "
                f"{self.units[i].name} where {expected} was due (order per micro-batch: "
                f"{[self.units[j].name for j in self.order]}); the members' gathers must "
                f"pair up: list the units in the order the forward calls them (wrap=[...]) "
                f"or gather the whole model (wrap=None)"
            )

    def _pre_forward(self, i: int, module: nn.Module, args: Any) -> None:
        if not self.active:
            return
        self._expect(i, "forward")
        self.left[i] = len(self.units[i].params)
        self._next_gather(self.units[i])

    def _post_forward(self, i: int, module: nn.Module, args: Any, output: Any) -> None:
        if not self.active:
            return
        tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
        if tensors:
            register_multi_grad_hook(tensors, partial(self._pre_backward, i), mode="any")
        if i != len(self.units) - 1:
            self._release([p for p, _, _ in self.units[i].params])

    def _pre_backward(self, i: int, grad: Any) -> None:
        if not self.active:
            return
        if i == len(self.units) - 1 and self.cursor == len(self.units):
            return  # kept gathered since its forward
        self._expect(i, "backward")
        self._next_gather(self.units[i])

    def _accumulated(self, i: int, param: nn.Parameter) -> None:
        if not self.active:
            return
        self.left[i] -= 1
        if self.left[i] == 0:  # the unit's backward is done
            self._release([p for p, _, _ in self.units[i].params])

    # --- gathers -------------------------------------------------------------------------
    def _next_gather(self, unit: Unit) -> None:
        rnd = self.count // self.per_round
        idle = frozenset(r for r, b in enumerate(self.blocks) if b <= rnd)
        self.count += 1
        self.cursor += 1
        self._gather(unit, idle=idle)

    def _release(self, params: list[nn.Parameter]) -> None:
        for p in params:
            p.untyped_storage().resize_(0)

    def _gather(self, unit: Unit, *, idle: frozenset[int]) -> None:
        """``unit``'s full parameters into the model from the chunks; a member in ``idle``
        (channel ranks) only sends. Collective on the step's group (module docstring)."""
        sh, group = self.sharded, self.group
        assert group is not None
        n = len(sh.layout)
        me = group.rank
        cut = unit.cut(sh.numel, n)
        mine_idle = me in idle
        if not mine_idle:
            for p, _, _ in unit.params:
                storage = p.untyped_storage()
                if storage.nbytes() == 0:
                    storage.resize_(p.numel() * p.element_size())
            for c, opt in sh.held.items():
                chunk = sh._param(opt).detach()
                for p, lo, hi, c0, c1 in cut[c]:
                    p.data.view(-1)[lo:hi].copy_(chunk[c0:c1])  # .data: no version bump
        if n > 1 and unit.params:
            own = sh._param(sh.held[me]).detach()

            def body(ch: Channel) -> None:
                pending = []
                for q in range(n):
                    if q == me:
                        continue
                    if q != (me - 1) % n and q not in idle:  # the predecessor mirrors it
                        pending += [ch.isend(own[c0:c1], q) for _, _, _, c0, c1 in cut[me]]
                    if not mine_idle and q not in sh.held:
                        pending += [
                            ch.irecv(p.data.view(-1)[lo:hi], q) for p, lo, hi, _, _ in cut[q]
                        ]
                ch.wait(*pending)

            nbytes = unit.numel * sh.params[0].element_size()
            group.run(
                "all_gather",
                "heal/zero_unit",
                body,
                async_op=False,
                payload_bytes=nbytes,
                signature=f"zero unit {unit.name} bytes={nbytes}",
                desc=f"healing zero=3: unit {unit.name}{' (idle)' if mine_idle else ''}",
            )
        sh.note_peak()
