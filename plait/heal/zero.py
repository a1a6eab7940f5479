"""ZeRO-1/2 under healing: each member steps its shard of the optimizer state and a mirror
of its ring neighbour's, so a dead member's shard is still in live memory.

Layout of a generation with ``n`` members (group-rank order = slot order): the flat vector
of the trainable parameters is cut into ``n`` chunks (sizes as :mod:`.blocks` cuts the
exchange); member ``i`` owns chunk ``i`` and mirrors chunk ``(i + 1) % n``: it holds one
optimizer (the user's class and hyperparameters) per chunk over a flat copy of that chunk,
2/n of the state instead of ZeRO's 1/n (no extra bytes on the wire). The user's optimizer
is the template: its state stays empty, its hyperparameters (a scheduler's lr) are read
at every step. The block exchange
already gives every member the full summed gradient, so it steps both chunks from it
(element-wise optimizers: the update of an element does not depend on the cut, so the
parameters equal one process bitwise), then :func:`ShardedState.gather` sends every
member its own chunk's new values (point to point on the generation's group, counted as
``all_gather`` / ``heal/zero``: ``(n-1)/n`` of the parameters in and out per member).

A step is only known to be complete everywhere when the next exchange succeeds, so before
stepping each member keeps a copy of its two chunks (values and state) as they were
(:meth:`ShardedState.step`): 2/n of the parameters and of the state, copied once per step.
When healing, :meth:`ShardedState.agree` finds the step every survivor can return to (the
least completed step; members differ by at most one) and those ahead restore the copy;
:meth:`ShardedState.reshard` then rebuilds the new generation's layout: for every chunk of
the old layout one live holder (its owner, else the member that mirrored it) sends its
values and state to every member, each member keeps its new two chunks and writes the
full parameters into the model. Nothing is read from a checkpoint. The full state exists
on every member for the moment of the re-shard (transient, 1x the state). When a chunk's
owner and its mirror are both dead (two ring neighbours at once) the state is lost and
the heal raises, naming the chunk: such a job restarts from its last checkpoint.

ZeRO-2 here is ZeRO-1: the exchange is an all-reduce (every member receives the whole
summed gradient, the tree's order needs the blocks of every member), so the gradient
memory saving of ZeRO-2 is not kept; ``zero=2`` is accepted for the strategy's name and
behaves as ``zero=1``. ZeRO-3/FSDP (:mod:`.fsdp`) is this layout with the parameters
sharded too.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from plait.comm import ops
from plait.comm.group import Channel, Group
from plait.heal import state
from plait.heal.membership import KEY
from plait.strategies.zero.groups import check_elementwise


def _copy_into(buffer: Any, value: Any) -> Any:
    """``value`` copied into ``buffer`` when it is a tensor of its shape and dtype (kept
    from the step before), else a fresh copy; plain values as they are."""
    if not torch.is_tensor(value):
        return value
    if torch.is_tensor(buffer) and buffer.shape == value.shape and buffer.dtype == value.dtype:
        return buffer.copy_(value)
    return value.detach().clone()


class StateLost(RuntimeError):
    """A chunk of the sharded state has no live holder (or the members disagree on the
    layout): healing cannot go on; the job fails and restarts from its checkpoint."""


def bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """The ``n`` chunks' ``(start, stop)`` in the flat vector (as :mod:`.blocks` cuts)."""
    base, extra = divmod(numel, n)
    out, start = [], 0
    for i in range(n):
        stop = start + base + (i < extra)
        out.append((start, stop))
        start = stop
    return out


def held_chunks(rank: int, n: int) -> list[int]:
    """The chunks member ``rank`` of ``n`` holds: its own, then its neighbour's mirror."""
    return [rank] if n == 1 else [rank, (rank + 1) % n]


class ShardedState:
    """This member's chunks of the optimizer state (module docstring)."""

    what = "the optimizer state"  # what a chunk holds, for the messages

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
        if len(optimizer.param_groups) != 1:
            raise ValueError(
                f"healing zero: the optimizer has {len(optimizer.param_groups)} parameter "
                f"groups; sharded healing steps one flat vector with one set of "
                f"hyperparameters (use one group, or zero=0)"
            )
        if {id(p) for p in optimizer.param_groups[0]["params"]} != {id(p) for p in params}:
            raise ValueError(
                "healing zero: the optimizer must hold exactly the model's trainable parameters"
            )
        check_elementwise(type(optimizer))
        self.cls, self.template = type(optimizer), optimizer
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.dtype = params[0].dtype
        self.device = params[0].device  # every tensor the chunks' collectives carry
        self.layout: tuple[int, ...] = ()  # the slots of the generation the chunks follow
        self.layout_gen = -1
        self.held: dict[int, torch.optim.Optimizer] = {}
        self.backup: dict[str, Any] | None = None
        self.pending = False  # stepped, the gather not finished
        self._flat_buffer: torch.Tensor | None = None  # the gather's, kept between steps

    # --- chunks ------------------------------------------------------------------------
    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def _write(self, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def _make(self, values: torch.Tensor, st: dict[str, Any]) -> torch.optim.Optimizer:
        chunk = nn.Parameter(values.clone())
        opt = self.cls([chunk], **self.template.defaults)
        opt.param_groups[0].update(self._hyper())
        if st:
            opt.state[chunk] = {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
        return opt

    def _hyper(self) -> dict[str, Any]:
        """The user's optimizer's hyperparameters now (a scheduler changes its lr)."""
        return {k: v for k, v in self.template.param_groups[0].items() if k != "params"}

    @staticmethod
    def _param(opt: torch.optim.Optimizer) -> torch.Tensor:
        return opt.param_groups[0]["params"][0]

    def start(self, members: tuple[int, ...], rank: int, number: int) -> None:
        """A fresh layout from the model's parameters (generation 0: no state yet)."""
        flat = self._flat()
        spans = bounds(self.numel, len(members))
        self.held = {
            c: self._make(flat[slice(*spans[c])], {}) for c in held_chunks(rank, len(members))
        }
        self.layout, self.layout_gen, self.backup, self.pending = members, number, None, False

    # --- the step ----------------------------------------------------------------------
    def step(self, total: torch.Tensor, loss: torch.Tensor) -> None:
        """Step the held chunks on their slices of the summed gradient ``total`` (after a
        copy of them as they were, and of ``loss``, the last step's loss). The copy goes
        into buffers kept from the step before (a fresh allocation of that size costs
        page faults every step: 3 ms of 231 in the benchmark's step)."""
        spans = bounds(self.numel, len(self.layout))
        kept = self.backup["chunks"] if self.backup is not None else {}
        self.backup = {"loss": loss.clone(), "chunks": {}}
        for c, opt in self.held.items():
            p = self._param(opt)
            st = opt.state.get(p, {})
            old_values, old_state = kept.get(c, (None, {}))
            self.backup["chunks"][c] = (
                _copy_into(old_values, p.detach()),
                {k: _copy_into(old_state.get(k), v) for k, v in st.items()},
            )
        self.pending = True
        hyper = self._hyper()
        for c, opt in self.held.items():
            opt.param_groups[0].update(hyper)
            p = self._param(opt)
            p.grad = total[slice(*spans[c])]
            opt.step()
            p.grad = None

    def restore(self) -> torch.Tensor:
        """Return the held chunks to the copy made before the last step; the loss then."""
        assert self.backup is not None
        for c, (values, st) in self.backup["chunks"].items():
            opt = self.held[c]
            p = self._param(opt)
            with torch.no_grad():
                p.copy_(values)
            opt.state.pop(p, None)
            if st:
                opt.state[p] = {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
        self.pending = False
        self._flat_buffer = None  # a failed gather's receives must not reach the next
        return self.backup["loss"]

    def gather(self, group: Group | None) -> None:
        """Every member's own chunk to every member; the full parameters into the model.
        Collective on ``group`` (point to point; ``(n-2)/n`` of the parameters each way: the
        neighbour that mirrors a chunk computed it already)."""
        n = len(self.layout)
        spans = bounds(self.numel, n)
        if self._flat_buffer is None:  # kept from step to step (see step)
            self._flat_buffer = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        flat = self._flat_buffer
        for c, opt in self.held.items():
            flat[slice(*spans[c])].copy_(self._param(opt).detach())
        if n > 1:
            assert group is not None
            me = group.ranks.index(group.global_rank)
            mine = flat[slice(*spans[me])]  # only other chunks are received into flat
            skip = set(self.held)

            def body(ch: Channel) -> None:
                pending = []
                for p in range(n):
                    if p == ch.rank:
                        continue
                    if p != (me - 1) % n:  # the predecessor mirrors this chunk
                        pending.append(ch.isend(mine, p))
                    if p not in skip:
                        pending.append(ch.irecv(flat[slice(*spans[p])], p))
                ch.wait(*pending)

            nbytes = self.numel * flat.element_size()
            group.run(
                "all_gather",
                "heal/zero",
                body,
                async_op=False,
                payload_bytes=nbytes,
                signature=f"zero gather {str(self.dtype)[6:]} bytes={nbytes}",
                desc="healing zero: parameter chunks",
            )
        self._write(flat)
        self.pending = False

    def memory_breakdown(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this member holds, by kind, for :func:`plait.plan.memory.measure`:
        ``params``: the model's trainable parameters (full under zero=1/2, freed between
        steps under zero=3: 0 bytes) and the two chunks; ``grads``: the model's gradients
        alive now; ``optimizer_state``: the chunks' state and the copy of chunks and state
        made before the last step. Local."""
        opts = list(self.held.values())
        kept = list(self.backup["chunks"].values()) if self.backup is not None else []
        state = [v for o in opts for s in o.state.values() for v in s.values()]
        state += [t for values, st in kept for t in [values, *st.values()]]
        return {
            "params": [*self.params, *(self._param(o) for o in opts)],
            "grads": [p.grad for p in self.params if p.grad is not None],
            "optimizer_state": [t for t in state if torch.is_tensor(t)],
        }

    # --- healing -----------------------------------------------------------------------
    def agree(self, group: Group, world: int, done: int) -> tuple[int, tuple[int, ...], int]:
        """Among the new generation's members (collective on ``group``, one small
        all-reduce): the step every holder can return to (the least completed), the
        holders (slots that hold chunks of the old layout) and the old layout's
        generation number."""
        holds = bool(self.held)
        vec = torch.full((world + 3,), -1e300, dtype=torch.float64, device=self.device)
        if holds:
            vec[group.global_rank] = 1.0
            vec[world] = self.layout_gen
            vec[world + 1] = -self.layout_gen
            vec[world + 2] = -done
        ops.all_reduce(vec, "max", group=group)
        got = vec.tolist()  # one host read, at a heal
        if got[world] < 0:
            raise StateLost("healing zero: no member holds any state to re-shard")
        if got[world] != -got[world + 1]:
            raise StateLost(
                f"healing zero: the members hold chunks of different layouts (generations "
                f"{int(-got[world + 1])} and {int(got[world])}): a member died while the "
                f"state was being re-sharded; the job must restart from its checkpoint"
            )
        holders = tuple(s for s in range(world) if got[s] > 0)
        return int(-got[world + 2]), holders, int(got[world])

    def reshard(
        self, group: Group, store: Any, *, holders: tuple[int, ...], old_gen: int, number: int
    ) -> None:
        """Rebuild the layout of the new generation (``group``'s members) from the old
        one's chunks (module docstring). Collective on ``group``: one point-to-point
        transfer per old chunk, from its holder to every other member."""
        layout_key = f"{KEY}/zero/layout{old_gen}"
        if self.held:
            old = self.layout
            if group.global_rank == holders[0]:
                store.set(layout_key, json.dumps(list(old)))
        else:
            old = tuple(json.loads(store.get(layout_key).decode()))
        n_old = len(old)
        spans = bounds(self.numel, n_old)
        flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        full: dict[str, Any] = {}
        for c in range(n_old):
            owner, mirror = old[c], old[(c - 1) % n_old]
            holder = owner if owner in holders else mirror if mirror in holders else None
            if holder is None:
                raise StateLost(
                    f"healing zero: chunk {c} of {self.what} was held by slots "
                    f"{owner} (owner) and {mirror} (mirror), both dead: the state is lost; "
                    f"the job must restart from its checkpoint (plait run --max-restarts)"
                )
            key = f"{KEY}/gen{number}/zero/chunk{c}"
            if group.global_rank == holder:
                opt = self.held[c]
                p = self._param(opt)
                st = opt.state.get(p, {})
                items = [p.detach()] + [v for _, v in sorted(st.items()) if torch.is_tensor(v)]
                layout = [  # where each tensor lives (Adam's step: the CPU), as the holder
                    [k, "tensor", list(v.shape), str(v.dtype)[6:], v.device.type == "cpu"]
                    if torch.is_tensor(v)
                    else [k, "value", v]
                    for k, v in sorted(st.items())
                ]
                store.set(key, json.dumps(layout))
            else:
                layout = json.loads(store.get(key).decode())
                size = spans[c][1] - spans[c][0]
                items = [torch.empty(size, dtype=self.dtype, device=self.device)] + [
                    torch.empty(
                        e[2], dtype=getattr(torch, e[3]), device="cpu" if e[4] else self.device
                    )
                    for e in layout
                    if e[1] == "tensor"
                ]
            receivers = tuple(s for s in group.ranks if s != holder)
            if receivers:
                state.transfer(group, items, source=holder, receivers=receivers)
            flat[slice(*spans[c])].copy_(items[0])
            tensors = iter(items[1:])
            for e in layout:
                value = next(tensors) if e[1] == "tensor" else e[2]
                size = spans[c][1] - spans[c][0]
                if torch.is_tensor(value) and list(value.shape) == [size]:
                    full.setdefault(e[0], []).append(value.clone())
                else:
                    full.setdefault(e[0], value.clone() if torch.is_tensor(value) else value)
        whole = {k: torch.cat(v) if isinstance(v, list) else v for k, v in full.items()}
        members = group.ranks
        rank = members.index(group.global_rank)
        new_spans = bounds(self.numel, len(members))
        held = {}
        for c in held_chunks(rank, len(members)):
            sl = slice(*new_spans[c])
            st = {
                k: v[sl] if torch.is_tensor(v) and v.dim() == 1 and v.numel() == self.numel else v
                for k, v in whole.items()
            }
            held[c] = self._make(flat[sl], st)
        self._write(flat)
        self.held, self.layout, self.layout_gen = held, members, number
        self.backup, self.pending = None, False
