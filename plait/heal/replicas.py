"""Healing the data-parallel dimension of PTD-P: a replica is a whole ``pp x tp x cp``
group; when one of its ranks dies the whole replica leaves, the other replicas go on
without a restart, and a replacement replica joins at a step boundary.

``ReplicaTrainer(build, replica={"pp": 2, "tp": 2}, world=N, address="host:port",
rank=r)``: ``N`` processes in ``R = N / P`` replicas of ``P`` ranks (``P``: the product of
``replica``; ranks ``rP .. rP+P-1`` form replica ``r``; ``R`` a power of two). Each
replica builds its own mesh from the store (:class:`.store_mesh.StoreMesh`, ``dp = 1``:
no world process group, so a replacement's new processes can make theirs), and
``build(mesh)`` makes the model-parallel model on it (``plait.compose(model, optimizer,
mesh=mesh, ...)``: anything with ``step(x, y) -> loss``, ``sync_gradients()``,
``parameters()`` and ``optimizer``). Then ``while trainer.steps_done < steps:
trainer.step(*global_batch(trainer.steps_done))``.

One step, with the global batch of ``B`` rows cut into ``R`` blocks of ``B / R`` (the
blocks of :mod:`.blocks` over replicas instead of ranks):

1. the replica runs ``build``'s ``step`` on each block it owns (its own while every
   replica lives; a dead replica's blocks go to the survivors), reading each block's
   gradient (the mean over its rows) as a flat vector per rank, plus two elements: the
   block's loss and the leader's mask of replacement replicas asking to join;
2. the ranks at the same position ``q`` of every live replica (they hold the same shards)
   add the ``R`` blocks along the tree over block index on their position's group
   (``heal<n>.p<q>``, :func:`.blocks.block_tree_all_reduce`): the same bits whoever
   computed each block, so the parameters stay ``torch.equal`` to the uninterrupted run;
3. the replica agrees that every position's exchange succeeded (one all-reduce, max, of
   two numbers on the replica's group: the failure flag and the join mask, which rode
   only in position 0's exchange), then every rank steps its optimizer on ``sum / R``.

Faults. A collective *inside* a replica failing (``step``, or the step-3 agreement) means
a rank of this replica died: the replica is lost; its live ranks abandon their groups
(telling their position peers at once), say that they leave and raise
:class:`ReplicaLost` (the process exits; ``plait.heal.run`` restarts it as a
replacement). A position's exchange failing means another replica lost a rank: the
step-3 agreement carries the failure to every rank of this replica, none steps, and the
replica heals with the others: a new generation agreed per replica
(:class:`~.membership.Membership` with ``replica_size``), the position groups rebuilt
among the live replicas, the most advanced state sent position by position to those
behind (a replica one step ahead: every position's exchange of the failed step had
completed on it), received into new tensors and applied only once every position of the
replica has its part (the same agreement), so a replica never mixes two steps; then the
step is redone with the dead replica's blocks spread over the survivors.

Growing back: the ``P`` processes of a replacement replica (``join=True``) ask to join;
when all ``P`` asked, the leader's mask names the replica, every member admits it after
the step, the replacement builds its mesh under the generation's number and receives each
position's state (parameters, optimizer state, buffers, RNG, data cursor) from a live
replica.

Communication contract, per step: inside the replica, what ``build``'s model sends
(PTD-P's, over tp/pp/cp) once per owned block, and one all-reduce of two float64 numbers;
across replicas, on each position's group, :func:`.blocks.block_tree_all_reduce` of this
rank's gradient vector (``2(n-1)/n`` of it with one block each, ``n`` live replicas).
Not overlapped with the backward (the data-parallel trainer's buckets are not used
here). What is not built: ZeRO across replicas (each rank holds its shard's full
optimizer state, as ``zero=0``), the arrival-order mode (the tree is always used).
"""

from __future__ import annotations

import datetime
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from plait.comm import ops, progress, watchdog
from plait.comm.errors import CollectiveError
from plait.comm.group import Group
from plait.heal import blocks, groups, launch, state
from plait.heal.membership import Excluded, Generation, Membership, heal_record, mark_lost
from plait.heal.model_checks import buffers_of, params_device, warn_random
from plait.heal.store_mesh import StoreMesh
from plait.heal.trainer import ARRIVED, HEALING, Fault
from plait.strategies.reproducible.tree import LayoutError, is_power_of_two


class ReplicaLost(RuntimeError):
    """A rank of this process's replica died: the whole replica leaves the job (this
    process exits; a replacement replica takes its slots)."""


class _Heal(Exception):
    """A position's exchange failed on some rank of this (intact) replica."""


class ReplicaTrainer:
    """The training step of a PTD-P job whose data-parallel replicas survive their ranks
    (module docstring). ``heartbeat_timeout``, ``timeout``, ``connect_timeout``,
    ``backend``, ``threads``: as :class:`~.trainer.HealingTrainer`'s. ``fault``: called
    before every block with (step, block), when healing starts with (step, ``HEALING``),
    when a replacement was admitted with (-1, ``ARRIVED``)."""

    def __init__(
        self,
        build: Callable[[StoreMesh], Any],
        *,
        replica: Mapping[str, int],
        world: int,
        address: str,
        rank: int,
        join: bool = False,
        backend: str = "gloo",
        heartbeat_timeout: float = 2.0,
        timeout: float = 60.0,
        connect_timeout: float = 10.0,
        threads: int | None = 1,
        fault: Fault | None = None,
    ) -> None:
        size = math.prod(replica.values())
        if "dp" in replica:
            raise ValueError(
                "healing: replica= names the model-parallel dimensions of one replica "
                "(pp, tp, cp, ep); the data-parallel one is the replicas themselves"
            )
        if world % size or not is_power_of_two(world // size):
            raise LayoutError(
                f"healing: {world} ranks in replicas of {size} ({dict(replica)}): the number "
                f"of replicas must be a whole power of two (the blocks of the fixed tree)"
            )
        if threads is not None:
            torch.set_num_threads(threads)
        self.size, self.replicas, self.rank = size, world // size, rank
        self.index, self.position = divmod(rank, size)
        self.backend, self.fault = backend, fault
        self.timeout, self.connect_timeout = timeout, connect_timeout
        host, port = address.rsplit(":", 1)
        self.store = dist.TCPStore(
            host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout)
        )
        progress.configure(host, int(port))
        watchdog.configure(heartbeat_timeout)
        self.membership = Membership(
            self.store,
            slot=rank,
            world=world,
            heartbeat_timeout=heartbeat_timeout,
            timeout=timeout,
            replica_size=size,
        )
        number = 0
        if join:
            self.membership.request_join()
            number = self.membership.wait_admitted()
        first = self.index * size
        if backend == "nccl":  # the mesh's communicators are made on this rank's GPU
            torch.cuda.set_device(
                int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
            )
        incarnation = f"plait/heal/replica{self.index}/{'gen' + str(number) if join else 'start'}"
        # every dimension PTD-P reads (a missing one would make compose build a world
        # mesh); the data-parallel one is 1: the replicas are the data parallelism
        dims = {"pp": 1, "tp": 1, **replica, "dp": 1}
        self.mesh = StoreMesh(
            self.store,
            prefix=incarnation,
            ranks=range(first, first + size),
            rank=rank,
            backend=backend,
            timeout=timeout,
            connect_timeout=connect_timeout,
            **dims,
        )
        # every rank of the replica: the per-step agreement (and the state's)
        self.replica_group = groups.make(
            dist.PrefixStore(f"{incarnation}/all", self.store),
            tuple(range(first, first + size)),
            rank,
            name=f"{incarnation}.all",
            backend=backend,
            timeout=timeout,
            connect_timeout=connect_timeout,
        )
        self.model = build(self.mesh)
        warn_random(self.model, rank)
        self.optimizer: torch.optim.Optimizer = self.model.optimizer
        self.params = list(self.model.parameters())
        self.buffers = buffers_of(self.model)
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(
                f"healing: rank {rank}'s parameters have dtypes {sorted(map(str, dtypes))}; "
                f"the exchange carries one flat vector of one dtype"
            )
        self.dtype = dtypes.pop()
        # every tensor a collective carries lives here (on NCCL: the current CUDA device)
        self.device = params_device(self.params, backend=backend, who=f"rank {rank}")
        self.steps_done = 0
        self.last_loss = torch.tensor(float("nan"))
        self.heals: list[dict[str, Any]] = []
        self.group: Group | None = None
        self._entered: Generation | None = None
        self.gen: Generation
        if join:
            gen = self.membership.agree(number, (), -1, wait_all=True, propose=False)
            if fault is not None:
                fault(-1, ARRIVED)
            self._settle(gen)
        else:
            self._settle(self.membership.agree(0, tuple(range(world)), 0, wait_all=True))

    @classmethod
    def from_env(cls, build: Callable[[StoreMesh], Any], **kwargs: Any) -> ReplicaTrainer:
        """Built from the launcher's environment, as :meth:`.HealingTrainer.from_env`
        (``RANK``, ``WORLD_SIZE``: all the job's processes, ``MASTER_ADDR:MASTER_PORT``,
        ``PLAIT_HEAL_JOIN=1`` for a replacement)."""
        env = launch.environment()
        return cls(
            build,
            world=env["world"],
            address=env["address"],
            rank=env["slot"],
            join=env["join"],
            **kwargs,
        )

    # --- generations -------------------------------------------------------------------
    @property
    def members(self) -> tuple[int, ...]:
        """The live ranks (whole replicas)."""
        return self.gen.members

    def live_replicas(self) -> tuple[int, ...]:
        return tuple(sorted({s // self.size for s in self.gen.members}))

    def _settle(self, gen: Generation) -> None:
        """Enter ``gen``, and the next ones while entering fails."""
        for _ in range(2 * self.replicas + 2):
            try:
                self._enter(gen)
                return
            except (CollectiveError, RuntimeError, TimeoutError) as exc:
                if isinstance(exc, (Excluded, ReplicaLost)):
                    raise
                groups.abandon(self.group, exc)
                self.group = None
                gen = self.membership.agree(gen.number + 1, gen.members, self.steps_done)
        raise RuntimeError(
            f"healing: rank {self.rank}: {2 * self.replicas + 2} generations failed one "
            f"after another (last: {gen.number}, members {list(gen.members)}); giving up"
        )

    def _enter(self, gen: Generation) -> None:
        """Build this position's group of ``gen`` and receive the state if behind. Every
        rank of the replica agrees that all of this worked before anything is applied, so
        the replica enters the generation whole or not at all."""
        mark_lost(self.store, self._entered, gen)  # slots lost while they trained: when
        self.gen = gen
        q = self.position
        mine = tuple(s for s in gen.members if s % self.size == q)
        if gen.number == 0:
            source, receivers = mine[0], mine[1:]
        else:
            receivers = tuple(s for s in gen.receivers if s % self.size == q)
            source = min(s for s in mine if s not in receivers)
        failure: BaseException | None = None
        received: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        try:
            self.group = groups.build(
                self.store,
                gen,
                self.rank,
                backend=self.backend,
                timeout=self.timeout,
                connect_timeout=self.connect_timeout,
                members=mine,
                label=f".p{q}",
            )
            if receivers:
                received = self._transfer(gen, source, receivers)
        except (CollectiveError, RuntimeError, TimeoutError) as exc:
            failure = exc
        failed, _ = self._agree_replica(failure is not None, None, what="entering a generation")
        if failed:
            raise CollectiveError(
                f"healing: rank {self.rank}: replica {self.index} could not enter generation "
                f"{gen.number} (here: {failure or 'fine; another position failed'})"
            )
        if received is not None:
            items, bufs = received
            state.apply_received(items, bufs)
            state.set_rng_state(items[-2], self.device)
            self.steps_done = int(items[-1][0].item())
            self.last_loss = items[-1][1].clone()
        self.owned = blocks.assign(self.live_replicas(), self.replicas)
        self._entered = gen

    def _transfer(
        self, gen: Generation, source: int, receivers: tuple[int, ...]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """This position's state from ``source`` to ``receivers``; on a receiver, the
        state's tensors and what arrived for them (applied by the caller)."""
        key = f"plait/heal/gen{gen.number}/manifest/p{self.position}"
        if self.rank == source:
            self.store.set(key, state.manifest(self.optimizer))
        elif self.rank in receivers:
            state.adopt_manifest(self.optimizer, self.store.get(key).decode())
        rng = state.rng_state(self.device)
        cursor = torch.tensor(
            [float(self.steps_done), float(self.last_loss)], dtype=torch.float64, device=self.device
        )
        items = state.tensors_of(self.params, self.buffers, self.optimizer, rng, cursor)
        assert self.group is not None
        bufs = state.transfer(self.group, items, source=source, receivers=receivers, apply=False)
        return None if bufs is None else (items, bufs)

    def _agree_replica(
        self, failed: bool, mask: torch.Tensor | None, *, what: str
    ) -> tuple[bool, int]:
        """Max over the replica's ranks of ``[failed, mask]`` (one all-reduce of two
        float64 on the device, one host read); a failure of this all-reduce itself means
        a rank of the replica died: :class:`ReplicaLost`."""
        flags = torch.zeros(2, dtype=torch.float64, device=self.device)
        flags[0] = float(failed)
        if mask is not None:
            flags[1:] = mask.reshape(1)
        if self.size > 1:
            try:
                ops.all_reduce(flags, "max", group=self.replica_group)
            except CollectiveError as exc:
                raise self._lost(exc, what) from exc
        failed_any, joiners = flags.tolist()
        return bool(failed_any), int(joiners)

    def _lost(self, exc: BaseException, what: str) -> ReplicaLost:
        """Leave: this replica lost a rank (``exc`` raised in ``what``)."""
        groups.abandon(self.group, exc)  # this position's peers stop waiting at once
        self.group = None
        self.mesh.abandon(exc)
        groups.abandon(self.replica_group, exc)
        self.membership.leave()
        return ReplicaLost(
            f"healing: rank {self.rank} (replica {self.index}, position {self.position}): a "
            f"rank of this replica failed during {what} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); the whole replica leaves and "
            f"the others go on; start the replica again as a replacement (PLAIT_HEAL_JOIN=1)"
        )

    def _heal(self, exc: BaseException) -> None:
        start = time.perf_counter()
        if self.fault is not None:
            self.fault(self.steps_done, HEALING)
        groups.abandon(self.group, exc)
        self.group = None
        old = self.gen
        self._settle(self.membership.agree(old.number + 1, old.members, self.steps_done))
        self._record("shrink", old, start, exc)

    def _grow(self, mask: int) -> None:
        start = time.perf_counter()
        joiners = tuple(
            s
            for r in range(self.replicas)
            if mask >> r & 1
            for s in range(r * self.size, (r + 1) * self.size)
        )
        old = self.gen
        if self.rank == old.members[0]:
            self.membership.admit(joiners, old.number + 1)
        gen = self.membership.agree(old.number + 1, old.members + joiners, self.steps_done)
        assert self.group is not None
        self.group.shutdown()
        self.group = None
        self._settle(gen)
        self._record("grow", old, start, None)

    def _record(self, kind: str, old: Generation, start: float, exc: BaseException | None) -> None:
        self.heals.append(
            heal_record(kind, old, self.gen, at_step=self.steps_done, start=start, cause=exc)
        )

    # --- the step ----------------------------------------------------------------------
    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step on the global batch ``x, y`` of step :attr:`steps_done` (the
        same on every rank); returns the global mean loss. Heals and redoes the step if a
        replica loses a rank; raises :class:`ReplicaLost` if it is this one's."""
        target = self.steps_done
        while True:
            try:
                return self._attempt(x, y)
            except _Heal as exc:
                try:
                    self._heal(exc.__cause__ or exc)
                except BaseException:
                    self.membership.leave()
                    raise
                if self.steps_done > target:  # received the finished step from a peer
                    return self.last_loss
            except BaseException:
                self.membership.leave()
                raise

    def _attempt(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        count = self.replicas
        if x.shape[0] % count:
            raise LayoutError(
                f"healing: global batch B={x.shape[0]} is not divisible by the {count} "
                f"replicas (each replica's block is B/{count} rows)"
            )
        rows = x.shape[0] // count
        leader = self.rank == self.members[0]
        mask = self._joining() if leader else 0
        partials: dict[int, torch.Tensor] = {}
        try:
            for i, v in enumerate(sorted(self.owned[self.index])):
                if self.fault is not None:
                    self.fault(self.steps_done, v)
                self.optimizer.zero_grad(set_to_none=True)
                part = slice(v * rows, (v + 1) * rows)
                loss = self.model.step(x[part], y[part])
                self.model.sync_gradients()
                extra = torch.full(
                    (2,), float(mask * (i == 0)), dtype=self.dtype, device=self.device
                )
                extra[0] = loss.detach().reshape(())
                partials[v] = torch.cat([_grad(p) for p in self.params] + [extra])
        except CollectiveError as exc:
            raise self._lost(exc, "the replica's forward and backward") from exc
        assert self.group is not None
        owned = {s: self.owned[s // self.size] for s in self.group.ranks}
        failure: CollectiveError | None = None
        total = None
        try:
            total = blocks.block_tree_all_reduce(
                partials, owned=owned, world=count, group=self.group
            )
        except CollectiveError as exc:
            failure = exc
        failed, joiners = self._agree_replica(
            failure is not None,
            None if total is None else total[-1],
            what="the step's agreement",
        )
        if failed:  # some position's exchange failed: no rank of this replica steps
            raise _Heal() from (
                failure
                or CollectiveError(
                    f"healing: rank {self.rank}: another position of replica {self.index} "
                    f"failed its exchange"
                )
            )
        assert total is not None
        total.mul_(1.0 / count)  # the mean over the blocks (a power of two: exact)
        offset = 0
        for p in self.params:
            p.grad = total[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        self.last_loss = total[-2].clone()
        if joiners:
            self._grow(joiners)
        return self.last_loss

    def _joining(self) -> int:
        """The leader's mask of replacement replicas whose every rank asked to join."""
        slots = self.membership.pending_joins(self.members)
        mask = 0
        for r in range(self.replicas):
            want = range(r * self.size, (r + 1) * self.size)
            if all(slots >> s & 1 for s in want):
                mask |= 1 << r
        return mask

    def wait_for_replacements(self, timeout: float) -> None:
        """Block at this step boundary until every rank of every lost replica has a
        replacement asking to join (at most ``timeout`` s): the next step admits them.
        Every rank calls it at the same step; it reads the store, no collective."""
        self.membership.wait_for_replacements(self.members, timeout)

    def close(self) -> None:
        """Stop this rank's groups and threads (local; after the last step)."""
        self.membership.finish()
        if self.group is not None:
            self.group.shutdown()
        self.mesh.destroy()
        self.replica_group.shutdown()
        progress.stop()


def _grad(p: torch.Tensor) -> torch.Tensor:
    return (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
