"""Joining and leaving the process group; the world group and sub-groups.

``init()`` reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so a script written for plait runs under
``plait run``, ``torchrun`` or ``plait.spawn`` alike.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from plait.comm import progress
from plait.comm.group import Group

DEFAULT_TIMEOUT_S = 600.0
_REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

_world: Group | None = None
_subgroups: list[Group] = []


def choose_backend() -> str:
    """NCCL when every local rank owns a CUDA device, gloo otherwise.

    The choice is made the same way on every rank of a host, so a host never mixes
    backends; several ranks sharing one GPU get gloo (which also moves CUDA tensors).
    """
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        return "nccl"
    return "gloo"


def share_cores() -> None:
    """Give each local rank its share of the cores for intra-op threads.

    N ranks each running as many threads as the machine has cores oversubscribe it, and
    spinning worker threads then delay every small kernel by milliseconds (the same reason
    torchrun sets OMP_NUM_THREADS=1). An explicit OMP_NUM_THREADS is respected.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_world > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, (cores or 1) // local_world))


def _debug_default(debug: bool | None) -> bool:
    if debug is not None:
        return debug
    return os.environ.get("PLAIT_DEBUG", "0") not in ("", "0", "false", "False")


def _timeout_default(timeout: float | None) -> float:
    if timeout is not None:
        if timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout}")
        return float(timeout)
    return float(os.environ.get("PLAIT_TIMEOUT", DEFAULT_TIMEOUT_S))


def init(
    *,
    backend: str | None = None,
    timeout: float | None = None,
    debug: bool | None = None,
    node_size: int | None = None,
    store: Any = None,
) -> Group:
    """Join the process group described by the environment; return the world group.

    ``backend``: ``"gloo"`` or ``"nccl"`` (default: :func:`choose_backend`).
    ``timeout``: seconds any collective may wait for other ranks (default 600, or
    ``PLAIT_TIMEOUT``). ``debug``: check every collective's signature across ranks
    (default: ``PLAIT_DEBUG=1``). ``node_size``: ranks per node for the hierarchical
    algorithms (default: ``PLAIT_NODE_SIZE``, else ranks per host). If
    ``torch.distributed`` is already initialized, plait uses that process group.
    Blocks until every rank has joined (at most ``timeout``).
    """
    global _world
    if _world is not None:
        return _world
    timeout_s = _timeout_default(timeout)
    share_cores()
    if dist.is_initialized():
        backend = str(dist.get_backend())
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        missing = [k for k in _REQUIRED_ENV if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"plait.init: environment variables {missing} are not set. Launch with "
                f"`plait run -n N script.py`, torchrun, or plait.spawn(fn, world_size=N), "
                f"which set them"
            )
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        backend = backend or choose_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
        if store is not None:
            kwargs["store"] = store
        else:
            kwargs["init_method"] = "env://"
        dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    progress.configure_from_env()
    _world = Group(
        pg=dist.group.WORLD,
        ranks=range(world_size),
        global_rank=rank,
        name="world",
        backend=backend,
        timeout=timeout_s,
        debug=_debug_default(debug),
        node_size=node_size or int(os.environ.get("PLAIT_NODE_SIZE", "0")) or None,
    )
    return _world


def world_or_none() -> Group | None:
    """The world group, or None before :func:`init` (single-process use)."""
    return _world


def is_initialized() -> bool:
    return _world is not None


def world() -> Group:
    """The group of all ranks (after :func:`init`)."""
    if _world is None:
        raise RuntimeError(
            "plait is not initialized: call plait.init() first (plait.spawn and "
            "`plait run` do it for you)"
        )
    return _world


def new_group(
    ranks: Sequence[int],
    *,
    name: str | None = None,
    timeout: float | None = None,
    node_size: int | None = None,
) -> Group | None:
    """A group of the given global ranks, or None on ranks outside it.

    Every rank of the world must call this, in the same order (it creates a backend
    process group). ``node_size`` groups the ranks into blocks of that many for the
    hierarchical algorithms (default: by host).
    """
    w = world()
    members = sorted(set(int(r) for r in ranks))
    if not members or members[0] < 0 or members[-1] >= w.size:
        raise ValueError(
            f"new_group: ranks {list(ranks)} must be distinct ranks in 0..{w.size - 1}"
        )
    if node_size is not None and node_size <= 0:
        raise ValueError(f"new_group: node_size must be positive, got {node_size}")
    timeout_s = _timeout_default(timeout) if timeout is not None else w.timeout
    pg = dist.new_group(members, timeout=datetime.timedelta(seconds=timeout_s))
    label = name or f"g{len(_subgroups) + 1}[{','.join(map(str, members))}]"
    if w.global_rank not in members:
        _subgroups.append(None)  # type: ignore[arg-type]  # keep numbering equal on all ranks
        return None
    group = Group(
        pg=pg,
        ranks=members,
        global_rank=w.global_rank,
        name=label,
        backend=w.backend,
        timeout=timeout_s,
        debug=w.debug,
        node_size=node_size,
    )
    _subgroups.append(group)
    return group


def shutdown() -> None:
    """Finish pending collectives and leave the process group."""
    global _world
    first_error: BaseException | None = None
    for g in [*_subgroups, _world]:
        if g is None:
            continue
        try:
            g.synchronize()
        except BaseException as exc:  # still leave the group; report the first failure
            first_error = first_error or exc
        g.shutdown()
    _subgroups.clear()
    _world = None
    if dist.is_initialized():
        dist.destroy_process_group()
    if first_error is not None:
        raise first_error
