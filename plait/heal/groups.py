"""Process groups of one generation: built among the members, abandoned without a hang.

Each generation gets a process group of its own, made from the rendezvous store under the
prefix ``plait/heal/gen<n>/pg`` (so it never reads a failed generation's addresses) and
wrapped in a plait :class:`~plait.comm.group.Group` named ``heal<n>`` whose ranks are the
members' slots: plait's collectives, counters, sequence checks and stall watchdog work on
it as on any group.

Abandoning a failed generation's group (:func:`abandon`) must not wait for the dead rank:

* ``watchdog.fail`` records the error on the group, publishes the verdict under the
  group's name (a survivor still blocked in the failed collective on a live peer reads it
  within ``watchdog.CHECK_EVERY_S`` and ends its wait too) and closes this rank's
  connections of the group;
* the backend is aborted: gloo's ``abort`` ends its pending work; on NCCL,
  ``ProcessGroupNCCL.abort()`` tears the communicator down without a collective (what
  TorchFT does before re-initializing), so kernels waiting on a dead peer are released;
* the Group's worker thread is stopped and the object kept (not destroyed) until the
  process exits: destroying a backend whose peer died may block on its threads.

The next generation's communicator is then made from scratch among the members
(:func:`build`): gloo's ``ProcessGroupGloo(store, rank, size)``; on NCCL
``ProcessGroupNCCL(store, rank, size, options)`` on this rank's device, a new
``ncclCommInitRank`` whose unique id comes through the same prefixed store. Building blocks
until every member connected, at most ``connect_timeout`` seconds: a member that died after
checking in makes the build raise, and the survivors agree on the next generation.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from plait.comm import progress, transport, watchdog
from plait.comm.errors import CollectiveError
from plait.comm.group import Group
from plait.heal.membership import KEY, Generation

_abandoned: list[tuple[Group, Any]] = []  # kept until exit: see the module docstring


def build(
    store: Any,
    gen: Generation,
    slot: int,
    *,
    backend: str,
    timeout: float,
    connect_timeout: float,
    members: tuple[int, ...] | None = None,
    label: str = "",
) -> Group:
    """This slot's group of generation ``gen``. Collective on the members: every one
    calls it, and it returns once all connected (at most ``connect_timeout`` s).
    ``members``: the slots of the group (default: the generation's), ``label``: what
    tells the group apart from the generation's other groups (whole model-parallel
    replicas: one group per position, ``.p<q>``; named ``heal<n><label>``)."""
    members = gen.members if members is None else members
    prefix = dist.PrefixStore(f"{KEY}/gen{gen.number}/pg{label}", store)
    return make(
        prefix,
        members,
        slot,
        name=f"heal{gen.number}{label}",
        backend=backend,
        timeout=timeout,
        connect_timeout=connect_timeout,
    )


def make(
    prefix: Any,
    members: tuple[int, ...],
    slot: int,
    *,
    name: str,
    backend: str,
    timeout: float,
    connect_timeout: float,
) -> Group:
    """A plait :class:`~plait.comm.group.Group` named ``name`` over ``members`` (global
    ranks, this process's ``slot`` among them), its backend made from the store ``prefix``
    (no default process group involved) with plait's transport. Collective on the members,
    at most ``connect_timeout`` s; ``timeout`` bounds its collectives afterwards."""
    rank, size = members.index(slot), len(members)
    delta = datetime.timedelta(seconds=connect_timeout)
    pg: Any
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefix, rank, size, delta)
    elif backend == "nccl":
        # Not run on this machine (no GPU): the same interface, a fresh communicator per
        # generation on this rank's device (torch.cuda.set_device was called at start).
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = delta
        pg = dist.ProcessGroupNCCL(prefix, rank, size, options)
        pg._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
    else:
        raise ValueError(f"healing: backend {backend!r} is not 'gloo' or 'nccl'")
    if size > 1 and backend == "gloo":
        # gloo connects lazily per pair: one tiny exchange with every peer now, so that a
        # member that died after checking in fails the build, not the first training step
        flag = torch.zeros(1)
        pg.allreduce([flag]).wait(delta)
    group = Group(
        pg=pg,
        ranks=members,
        global_rank=slot,
        name=name,
        backend=backend,
        timeout=connect_timeout,  # a member dead during the transport's setup: this long
    )
    if size > 1:
        try:
            transport.attach(group, transport.parse_mode(None), store=prefix)
        except BaseException:
            abandon(group, CollectiveError(f"healing: the transport of {group.name} failed"))
            raise
    group.timeout, group.timeout_delta = timeout, datetime.timedelta(seconds=timeout)
    return group


def abandon(group: Group | None, error: BaseException) -> None:
    """Stop using ``group`` after ``error``: tell the other members, close this rank's
    connections, abort the backend, stop the worker thread (no communication waited on)."""
    if group is None or group.destroyed:
        return
    failure = error if isinstance(error, CollectiveError) else CollectiveError(str(error))
    try:
        watchdog.fail(group, failure)
    except Exception:
        pass
    if group.shm is not None:  # end this rank's local peers' shared-memory waits now
        group.shm.abort(None)
    pg = group.release()
    try:
        pg.abort()
    except Exception:  # a backend without abort: its connections are closed already
        pass
    group.shutdown()
    progress.unregister(group)
    _abandoned.append((group, pg))
