"""Checks before a rank joins: the right store, its own rank, a world that fills.

Without them a wrong ``MASTER_ADDR``, two processes given the same ``RANK``, or a
``WORLD_SIZE`` larger than the ranks started all end the same way: every rank waits in
``init_process_group`` until its timeout, and the error names nothing. :func:`preflight`
turns each into an error within a bounded time that names the address, port or ranks.

The store protocol (keys in the launcher's store, which is fresh for every attempt):

- ``plait/job``: the job's nonce, set by the launcher before any rank starts. A rank whose
  ``PLAIT_JOB_ID`` differs (or finds no such key) is talking to another job's store and
  stops: two jobs can never merge, whatever ports they were given.
- ``plait/world_size``: the first rank's ``WORLD_SIZE`` (compare-and-set); a rank with
  another value stops, naming both.
- ``plait/rank/<r>``: incremented by the rank that claims ``RANK=r``; a count above 1 means
  two processes were given the same rank.

Every check talks to the store only (no process group yet); :func:`preflight` blocks until
all ``WORLD_SIZE`` ranks have claimed their rank, or its deadline.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch.distributed as dist

JOB_KEY = "plait/job"
WORLD_KEY = "plait/world_size"
_POLL_S = 0.1


class RendezvousError(RuntimeError):
    """A rank could not join its job; the message says which address, port or ranks."""


def connect(
    addr: str,
    port: int,
    *,
    timeout: float,
    rank: int | None = None,
    setting: str = "timeout",
) -> Any:
    """A client of the store at ``addr:port``; raises :class:`RendezvousError` after
    ``timeout`` seconds naming the address, and ``setting`` (what set the timeout: e.g.
    ``PLAIT_CONNECT_TIMEOUT``), when nothing answers there."""

    who = f"rank {rank}" if rank is not None else "plait"
    start = time.monotonic()
    try:
        return dist.TCPStore(
            addr,
            port,
            None,
            False,
            timeout=datetime.timedelta(seconds=timeout),
        )
    except (RuntimeError, TimeoutError, OSError) as exc:
        waited = time.monotonic() - start
        raise RendezvousError(
            f"{who}: no rendezvous store answered at {addr}:{port} within "
            f"{setting}={timeout:g} s (waited {waited:.1f} s; MASTER_ADDR={addr}, "
            f"MASTER_PORT={port}; {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}). Check that MASTER_ADDR is the "
            f"address of the host running rank 0 / the launcher and that the port is open, "
            f"or raise {setting}"
        ) from None


def preflight(
    store: Any,
    *,
    addr: str,
    port: int,
    rank: int,
    world_size: int,
    job_id: str | None,
    timeout: float,
    setting: str = "timeout",
) -> None:
    """Check the store belongs to ``job_id``, claim ``rank``, wait for the world to fill.

    Blocks until all ``world_size`` ranks have claimed their rank (at most ``timeout``
    seconds, set by ``setting``: named when it runs out), then returns. Raises
    :class:`RendezvousError` naming what is wrong.
    """
    where = f"{addr}:{port}"
    if not 0 <= rank < world_size:
        raise RendezvousError(
            f"rank {rank}: RANK must be in 0..{world_size - 1} for WORLD_SIZE={world_size}"
        )
    if job_id is not None:
        if not store.check([JOB_KEY]):
            raise RendezvousError(
                f"rank {rank}: the store at {where} is not this plait job's (no {JOB_KEY!r} "
                f"key): another program holds that port. Use the MASTER_PORT the launcher "
                f"gave, or pick another port"
            )
        theirs = store.get(JOB_KEY).decode()
        if theirs != job_id:
            raise RendezvousError(
                f"rank {rank}: the store at {where} belongs to plait job {theirs}, not to "
                f"this job {job_id}: two jobs were given the same address and port. This "
                f"rank does not join it"
            )
    agreed = store.compare_set(WORLD_KEY, "", str(world_size)).decode()
    if agreed != str(world_size):
        raise RendezvousError(
            f"rank {rank}: WORLD_SIZE={world_size} here, but another rank of the job at "
            f"{where} started with WORLD_SIZE={agreed}: every rank must be given the same"
        )
    claims = store.add(f"plait/rank/{rank}", 1)
    if claims > 1:
        raise RendezvousError(
            f"rank {rank}: RANK={rank} was given to {claims} processes of the job at {where}; "
            f"every process needs its own RANK in 0..{world_size - 1}"
        )
    deadline = time.monotonic() + timeout
    keys = [f"plait/rank/{r}" for r in range(world_size)]
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            raise RendezvousError(
                f"rank {rank}: ranks {missing} of WORLD_SIZE={world_size} never joined the "
                f"job at {where} within {setting}={timeout:g} s: start them, lower "
                f"WORLD_SIZE, or raise {setting} if they start slowly"
            )
        time.sleep(_POLL_S)
