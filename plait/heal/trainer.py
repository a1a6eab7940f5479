"""A data-parallel training step that heals: a dead rank's blocks go to the survivors,
a replacement joins at a step boundary, and (reproducible mode) the bits do not move.

``HealingTrainer(model, optimizer, loss_fn=f, microbatch_size=m, world=W, address=
"host:port", slot=r)`` then ``while trainer.steps_done < steps: trainer.step(*batch(
trainer.steps_done))`` with the *global* batch of step ``trainer.steps_done`` (the data
cursor: a replacement receives it with the state). Each step:

1. this member runs the micro-batches of the blocks it owns (:mod:`.blocks`), each loss
   (the mean over ``m`` samples) scaled by ``1/M``, summing each block's gradients along
   the fixed tree (:class:`~plait.strategies.reproducible.tree.TreeSum`);
2. the block exchange (:mod:`.blocks`) on the generation's group adds the ``W`` block
   sums in block order, in buckets of ``bucket_mb`` MiB, each started during the last
   micro-batch's backward as soon as its gradients are final and all waited for before
   the optimizer step (:mod:`.buckets`; two extra elements ride in the first bucket: the
   blocks' loss sums and the leader's mask of replacements asking to join, so neither
   costs a collective);
3. every member steps its full optimizer (replicated state, as DDP); with ``zero=1`` or
   ``2`` it steps its chunk of the state and a mirror of its ring neighbour's, and the
   members exchange the new parameter chunks (:mod:`.zero`); with ``zero=3`` the
   parameters are sharded too: gathered one unit at a time around each unit's forward
   and backward (:mod:`.units`; ``wrap=None``: the whole model at the step's start),
   and the exchange gives each member only the two chunks it steps (:mod:`.fsdp`).

When the exchange raises (a member was killed, raised, or froze past the heartbeat),
the member abandons the generation's group (:func:`.groups.abandon`), agrees on the next
generation (:mod:`.membership`), builds its group, receives the state if it is behind
(:mod:`.state`), and redoes the interrupted step from the parameters before it: the
optimizer had not stepped, because the exchange comes first. A member that finished the
step before the failure reached it sends the finished state to those behind instead.
When the mask names replacements, every member admits them after the step, agrees on
the grown generation, and the leader sends them the state.

``reproducible=True`` (the default) sums along the tree over block index whatever the
membership, so the parameters equal the uninterrupted run and one process bitwise.
``reproducible=False`` sums each member's blocks in arrival order and all-reduces with
plait's default algorithm over the live members: the sum of the same ``M`` micro-batch
gradients in another order, within ``M * eps`` relative of the uninterrupted run per
step (docs/healing.md).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.comm import progress, watchdog
from plait.comm.errors import CollectiveError
from plait.comm.group import Group
from plait.heal import blocks, groups, launch, state
from plait.heal.buckets import OverlappedExchange
from plait.heal.compute import BlockCompute
from plait.heal.fsdp import ShardedParams, sharded_state
from plait.heal.membership import Excluded, Generation, Membership, heal_record, mark_lost
from plait.heal.model_checks import params_device, refuse_sharded
from plait.heal.units import CHILDREN, UnitGathers, Wrap
from plait.heal.zero import StateLost
from plait.strategies.reproducible.tree import LayoutError, is_power_of_two

Fault = Callable[[int, int], None]  # (step, micro-batch index) -> None, may kill the process
HEALING = -1  # the fault hook's index when a member starts healing
ARRIVED = -2  # ... when a replacement was admitted, before it connects
GATHERING = -3  # ... under zero, before gathering the chunks (zero=1/2: after stepping them;
# zero=3: at the step's start)
SUMMED = -4  # ... under zero=3, in the exchange: its chunk summed, not yet sent to its mirror


class HealingTrainer:
    """The training step of a data-parallel job that survives its ranks (module docstring).

    ``world``: the job's full size (slots), a power of two; ``slot``: this process's slot;
    ``join``: this process replaces a dead slot and joins at the next step boundary.
    ``address``: the rendezvous store (``host:port``, ``MASTER_ADDR:MASTER_PORT``), which
    must outlive every rank (``plait run`` and :func:`plait.heal.launch.start_store` host
    it). ``heartbeat_timeout``: seconds of silence after which a rank is dead; ``timeout``:
    the longest a collective or an agreement waits; ``connect_timeout``: the longest a new
    generation's group takes to connect. ``zero``: 0 (the optimizer's state replicated on
    every member, as DDP), 1 or 2 (sharded: each member holds its chunk and its
    neighbour's, :mod:`.zero`; 2 behaves as 1), 3 (FSDP: the parameters sharded too,
    freed between steps, :mod:`.fsdp`; :meth:`unshard` gathers them). ``fault``: called
    before every micro-batch with (step, micro-batch index), when healing starts with
    (step, ``HEALING``) and when a replacement is admitted with (-1, ``ARRIVED``), under
    zero before gathering the chunks with (step, ``GATHERING``: zero=1/2 after stepping
    them, zero=3 at the step's start), under zero=3 in the exchange with (step,
    ``SUMMED``): fault tests and the demo kill or raise there. ``bucket_mb``: the
    exchange's bucket size in MiB (reproducible mode, zero < 3; plait's DDP default),
    each bucket exchanged during the last backward (:mod:`.buckets`). ``wrap``
    (``zero=3``): the units gathered one at a time during the step (:mod:`.units`; plait
    FSDP's vocabulary: ``"children"``, the top-level modules, the default; a set or tuple
    of module classes; a list of modules), or None: the whole model gathered at the
    step's start (:mod:`.fsdp`). ``backend``: ``"gloo"`` (the parameters on the CPU, or
    on CUDA: the messages are staged through the host) or ``"nccl"`` (the parameters on
    this rank's GPU, made the current device); every tensor the trainer hands a
    collective is made on the parameters' device."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
        microbatch_size: int,
        world: int,
        address: str,
        slot: int,
        join: bool = False,
        backend: str = "gloo",
        reproducible: bool = True,
        heartbeat_timeout: float = 2.0,
        timeout: float = 60.0,
        connect_timeout: float = 10.0,
        threads: int | None = 1,
        fault: Fault | None = None,
        zero: int = 0,
        bucket_mb: float = 25.0,
        wrap: Wrap | list[nn.Module] | None = CHILDREN,
    ) -> None:
        if not is_power_of_two(world):
            raise LayoutError(
                f"healing: world={world} slots; the blocks of the fixed tree need a power of "
                f"two (run with -n 2, 4, 8, ...)"
            )
        refuse_sharded(module)
        if zero not in (0, 1, 2, 3):
            raise ValueError(
                f"healing: zero={zero!r}; 0 (replicated optimizer, DDP), 1 or 2 (sharded "
                f"optimizer state with a neighbour's mirror), 3 (FSDP: the parameters "
                f"sharded too; docs/healing.md)"
            )
        if zero != 3 and wrap != CHILDREN and wrap is not None:
            raise ValueError(
                f"healing: wrap={wrap!r} chooses the units zero=3 gathers one at a time; "
                f"zero={zero} keeps the parameters whole: drop wrap, or use zero=3"
            )
        if threads is not None:
            torch.set_num_threads(threads)
        self.module, self.optimizer, self.loss_fn = module, optimizer, loss_fn
        self.microbatch_size, self.world, self.slot = microbatch_size, world, slot
        self.backend, self.reproducible, self.fault = backend, reproducible, fault
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.params = [p for p in module.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(
                f"healing: the trainable parameters have dtypes {sorted(map(str, dtypes))}; "
                f"the exchange carries one flat vector of one dtype"
            )
        self.dtype = dtypes.pop()
        self.device = self._device(backend)  # every tensor a collective carries lives here
        self.zero = zero
        self.compute = BlockCompute(  # the micro-batches and the exchange
            module,
            optimizer,
            loss_fn=loss_fn,
            microbatch_size=microbatch_size,
            params=self.params,
            world=world,
            fault=fault,
            # reproducible mode: the exchange in buckets, started during the last backward
            exchange=(
                OverlappedExchange(self.params, bucket_mb=bucket_mb)
                if reproducible and zero < 3
                else None
            ),
        )
        self.sharded = sharded_state(zero, optimizer, module, self.params)
        self.units = (  # zero=3: gathered unit by unit, else whole at the step's start
            UnitGathers(self.sharded, module, wrap=wrap, slot=slot)
            if isinstance(self.sharded, ShardedParams) and wrap is not None
            else None
        )
        self._prev: tuple[torch.Tensor, torch.Tensor] | None = None  # the last step's batch
        self.returned = 0  # zero: times this member went back one step to heal
        host, port = address.rsplit(":", 1)
        self.store = dist.TCPStore(
            host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout)
        )
        progress.configure(host, int(port))
        watchdog.configure(heartbeat_timeout)
        self.membership = Membership(
            self.store,
            slot=slot,
            world=world,
            heartbeat_timeout=heartbeat_timeout,
            timeout=timeout,
        )
        self.steps_done = 0
        self.last_loss = torch.tensor(float("nan"), device=self.device)
        self.heals: list[dict[str, Any]] = []  # one record per generation change
        self._entered: Generation | None = None  # the last generation entered in full
        self.group: Group | None = None
        self.gen: Generation
        if join:
            self.membership.request_join()
            number = self.membership.wait_admitted()
            gen = self.membership.agree(number, (), -1, wait_all=True, propose=False)
            if fault is not None:
                fault(-1, ARRIVED)
            self._settle(gen)
        else:
            expected = tuple(range(world))
            self._settle(self.membership.agree(0, expected, 0, wait_all=True))

    def _device(self, backend: str) -> torch.device:
        """The parameters' one device (:func:`.model_checks.params_device`)."""
        return params_device(self.params, backend=backend, who=f"slot {self.slot}")

    def _rng_and_cursor(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What a member behind receives besides the model's state, on the device: the
        random state (the CPU's and, on CUDA, the device's: :func:`.state.rng_state`) and
        the data cursor (steps done, last loss)."""
        cursor = torch.tensor(
            [float(self.steps_done), float(self.last_loss)], dtype=torch.float64,
            device=self.device,
        )  # fmt: skip
        return state.rng_state(self.device), cursor

    def _take_rng_and_cursor(self, rng: torch.Tensor, cursor: torch.Tensor) -> None:
        state.set_rng_state(rng, self.device)
        self.steps_done = int(cursor[0].item())  # one host read, at a heal
        self.last_loss = cursor[1].clone()

    @classmethod
    def from_env(
        cls, module: nn.Module, optimizer: torch.optim.Optimizer, **kwargs: Any
    ) -> HealingTrainer:
        """Built from the launcher's environment: ``RANK`` (the slot), ``WORLD_SIZE`` (the
        full size), ``MASTER_ADDR:MASTER_PORT`` (the store), ``PLAIT_HEAL_JOIN=1`` for a
        replacement (``python -m plait.heal.run`` sets them; by hand, see
        docs/healing.md)."""
        env = launch.environment()
        return cls(
            module,
            optimizer,
            world=env["world"],
            address=env["address"],
            slot=env["slot"],
            join=env["join"],
            **kwargs,
        )

    # --- generations -------------------------------------------------------------------
    @property
    def members(self) -> tuple[int, ...]:
        return self.gen.members

    def _settle(self, gen: Generation) -> None:
        """Enter ``gen``, and the next ones while entering fails (a member died during
        the build or the state transfer)."""
        for _ in range(2 * self.world + 2):
            try:
                self._enter(gen)
                return
            except (CollectiveError, RuntimeError, TimeoutError) as exc:
                if isinstance(exc, (Excluded, StateLost)):
                    raise
                groups.abandon(self.group, exc)
                self.group = None
                gen = self.membership.agree(gen.number + 1, gen.members, self.steps_done)
        raise RuntimeError(
            f"healing: slot {self.slot}: {2 * self.world + 2} generations failed one after "
            f"another (last: {gen.number}, members {list(gen.members)}); giving up"
        )

    def _enter(self, gen: Generation) -> None:
        mark_lost(self.store, self._entered, gen)  # slots lost while they trained: when
        self.gen = gen
        self.group = groups.build(
            self.store,
            gen,
            self.slot,
            backend=self.backend,
            timeout=self.timeout,
            connect_timeout=self.connect_timeout,
        )
        if self.sharded is not None and gen.number > 0:
            self._enter_sharded(gen)
            return
        receivers = gen.members[1:] if gen.number == 0 else gen.receivers
        if receivers:
            key = f"plait/heal/gen{gen.number}/manifest"
            if self.slot == gen.source:
                self.store.set(key, state.manifest(self.optimizer))
            elif self.slot in receivers:
                state.adopt_manifest(self.optimizer, self.store.get(key).decode())
            rng, cursor = self._rng_and_cursor()
            items = state.tensors(self.module, self.optimizer, rng, cursor)
            state.transfer(self.group, items, source=gen.source, receivers=receivers)
            if self.slot in receivers:
                self._take_rng_and_cursor(rng, cursor)
        if self.sharded is not None:
            self.sharded.start(gen.members, gen.members.index(self.slot), gen.number)
        self.owned = blocks.assign(gen.members, self.world)
        self._entered = gen

    def _enter_sharded(self, gen: Generation) -> None:
        """The sharded state's way into ``gen`` (zero=1/2): the members agree on the
        step they return to (those one step ahead restore their copy), a replacement
        receives the buffers, RNG and data cursor from the first holder, and the chunks
        are re-sharded among the members (:mod:`.zero`)."""
        assert self.sharded is not None and self.group is not None
        target, holders, old_gen = self.sharded.agree(self.group, self.world, self.steps_done)
        if self.sharded.held and self.steps_done > target:
            self.last_loss = self.sharded.restore()
            self.steps_done = target
            self.returned += 1
        joiners = tuple(s for s in gen.members if s not in holders)
        if joiners:
            rng, cursor = self._rng_and_cursor()
            items = [rng, *(b.data for b in self.module.buffers()), cursor]
            state.transfer(self.group, items, source=holders[0], receivers=joiners)
            if self.slot in joiners:
                self._take_rng_and_cursor(rng, cursor)
        self.sharded.reshard(
            self.group, self.store, holders=holders, old_gen=old_gen, number=gen.number
        )
        self.owned = blocks.assign(gen.members, self.world)
        self._entered = gen

    def _heal(self, exc: BaseException) -> None:
        start = time.perf_counter()
        if self.fault is not None:
            self.fault(self.steps_done, HEALING)
        if self.sharded is not None and self.sharded.pending:  # stepped, not gathered
            self.last_loss = self.sharded.restore()
        groups.abandon(self.group, exc)
        self.group = None
        old = self.gen
        self._settle(self.membership.agree(old.number + 1, old.members, self.steps_done))
        self.heals.append(
            heal_record("shrink", old, self.gen, at_step=self.steps_done, start=start, cause=exc)
        )

    def _grow(self, mask: int) -> None:
        start = time.perf_counter()
        joiners = tuple(s for s in range(self.world) if mask >> s & 1)
        old = self.gen
        if self.slot == old.members[0]:
            self.membership.admit(joiners, old.number + 1)
        gen = self.membership.agree(old.number + 1, old.members + joiners, self.steps_done)
        assert self.group is not None
        self.group.shutdown()  # every member finished its last collective on it
        self.group = None
        self._settle(gen)
        self.heals.append(
            heal_record("grow", old, self.gen, at_step=self.steps_done, start=start, cause=None)
        )

    # --- the step ----------------------------------------------------------------------
    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step on the global batch ``x, y`` of step :attr:`steps_done`
        (every member passes the same); returns the global mean loss. Heals and redoes the
        step if a member dies during it. Collective on the generation's members."""
        target = self.steps_done
        while True:
            try:
                if self.steps_done < target:  # sharded: returned to the step before
                    assert self._prev is not None
                    self._attempt(*self._prev)
                    continue
                loss = self._attempt(x, y)
                self._prev = (x, y)
                return loss
            except CollectiveError as exc:
                try:
                    self._heal(exc)
                except BaseException:
                    self.membership.leave()
                    raise
                if self.steps_done > target:  # received the finished step from a peer
                    return self.last_loss
            except BaseException:
                self.membership.leave()
                raise

    def _attempt(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        m, world = self.microbatch_size, self.world
        count = x.shape[0] // m
        if x.shape[0] % m or not is_power_of_two(count) or count % world:
            raise LayoutError(
                f"healing: global batch B={x.shape[0]}, microbatch_size m={m}, world "
                f"W={world}: M=B/m must be a power of two divisible by W (each slot's block "
                f"of M/W micro-batches is a whole subtree)"
            )
        per, scale = count // world, 1.0 / count
        assert self.group is not None
        if isinstance(self.sharded, ShardedParams):  # zero=3: the parameters for this step
            if self.fault is not None:
                self.fault(self.steps_done, GATHERING)
            if self.units is not None:
                self.units.begin(self.group, owned=self.owned, per=per)
            else:
                self.sharded.unshard(self.group)
        leader = self.slot == self.members[0]
        mask = self.membership.pending_joins(self.members) if leader else 0
        mine = sorted(self.owned[self.slot])
        if isinstance(self.sharded, ShardedParams):  # frees the parameters, then sums
            partials = self.compute.partials(
                x, y, step=self.steps_done, mine=mine, per=per, scale=scale, mask=mask,
                reproducible=self.reproducible,
            )  # fmt: skip
            if self.units is not None:  # the rounds of a member with fewer blocks: idle
                most = max(len(b) for b in self.owned.values())
                self.units.idle(most - len(mine))
                self.units.finish()
            hook = None if self.fault is None else partial(self.fault, self.steps_done, SUMMED)
            total = self.sharded.exchange(
                partials,
                owned=self.owned,
                world=world,
                group=self.group,
                exact=self.reproducible,
                summed=hook,
            )
        else:
            total = self.compute.run(
                x,
                y,
                step=self.steps_done,
                mine=mine,
                per=per,
                scale=scale,
                mask=mask,
                owned=self.owned,
                group=self.group,
            )
        if self.sharded is not None:
            self.optimizer.zero_grad(set_to_none=True)
            self.sharded.step(total, self.last_loss)
            if isinstance(self.sharded, ShardedParams):
                self.sharded.free()  # counted done: the next step's start gathers
            else:
                if self.fault is not None:
                    self.fault(self.steps_done, GATHERING)
                self.sharded.gather(self.group)
        else:
            offset = 0
            for p in self.params:
                p.grad = total[offset : offset + p.numel()].view_as(p)  # a view: no copy
                offset += p.numel()
            self.optimizer.step()
        self.steps_done += 1
        self.last_loss = total[-2] * scale
        joiners = int(total[-1].item())
        if joiners:
            self._grow(joiners)
        return self.last_loss

    def unshard(self) -> None:
        """``zero=3``: gather the full parameters into the model (to read or save them;
        the next step frees them again after its backward). Collective on the members:
        every one calls it at the same step. Nothing to do otherwise."""
        if isinstance(self.sharded, ShardedParams):
            self.sharded.unshard(self.group)

    def wait_for_replacements(self, timeout: float) -> None:
        """Block at this step boundary until every missing slot has a replacement asking
        to join, or had one since it was lost (that died on arrival), at most ``timeout``
        s (raises naming the missing slots): the next step admits them all, for a job
        that would rather wait than train at a smaller size.
        Every member calls it at the same step; it reads the store, no collective."""
        self.membership.wait_for_replacements(self.members, timeout)

    def close(self) -> None:
        """Stop this member's threads (local; call after the last step)."""
        self.compute.close()
        self.membership.finish()
        if self.group is not None:
            self.group.shutdown()
        progress.stop()
