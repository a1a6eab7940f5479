"""Joining and leaving the process group; the world group and sub-groups.

``init()`` reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so a script written for plait runs under
``plait run``, ``torchrun`` (static or elastic c10d rendezvous) or ``plait.spawn`` alike;
under ``srun`` and Kubeflow's torch runtime it derives them from ``SLURM_*`` / ``PET_*``
first (:mod:`plait.launch.environment`). A script that called
``torch.distributed.init_process_group`` itself is adopted: ``plait.init()`` (or the
first plait call that needs the world group) uses that process group.

Settings read from the environment, each checked at ``init`` before anything else
happens (a bad value raises ``ValueError`` naming the variable, the value and the valid
range; ``plait/settings.py`` lists them all): ``PLAIT_TIMEOUT`` (seconds, >= 1),
``PLAIT_NODE_SIZE`` (ranks per node, >= 1), ``PLAIT_HEARTBEAT_TIMEOUT`` (seconds, >= 1),
``PLAIT_CHECK`` (``1``/``0``: the default-mode signature check), ``PLAIT_DEBUG``,
``PLAIT_RECORDER_SIZE`` and ``PLAIT_RECORDER_DIR`` (the flight recorder),
``PLAIT_TRANSPORT`` (``auto``/``shm``/``gloo``: shared memory between ranks of one host;
see ``plait/comm/transport.py``), ``PLAIT_SHM_RING_BYTES``, ``PLAIT_SHM_WINDOW_BYTES``,
``PLAIT_SHM_SPIN_US`` and ``PLAIT_SHM_DIR``.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from plait import settings as env_settings
from plait.comm import progress, recorder, watchdog
from plait.comm import transport as transport_mod
from plait.comm.group import Group
from plait.launch import environment as launch_env
from plait.launch import lifeline

DEFAULT_TIMEOUT_S = 600.0
_REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

_world: Group | None = None
_subgroups: list[Group] = []  # the live groups new_group made on this rank, oldest first
_groups_made = 0  # every new_group call so far, on every rank (default names count them)
_group_names: set[str] = set()  # every group's name, also on ranks outside it
_settings: dict[str, Any] = {}  # what the world group was made with, to compare re-inits


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


def _flag(name: str, value: bool | None, default: bool) -> bool:
    if value is not None:
        return bool(value)
    return env_settings.flag(name, os.environ.get(name, ""), default)


def _debug_default(debug: bool | None) -> bool:
    return _flag("PLAIT_DEBUG", debug, False)


def _seconds(value: Any, source: str) -> float:
    """A collective timeout (``timeout=`` or ``PLAIT_TIMEOUT``): finite, at least 1 s."""
    return float(env_settings.TIMEOUT.parse(value, source))


def _timeout_default(timeout: float | None) -> float:
    if timeout is not None:
        return _seconds(timeout, "timeout")
    return float(env_settings.TIMEOUT.read())


def _timeout_source(timeout: float | None, seconds: float) -> str:
    """The world group's timeout and where it came from, to name it when a wait runs out."""
    if timeout is not None:
        return f"timeout={seconds:g} s (plait.init)"
    if os.environ.get("PLAIT_TIMEOUT", "").strip():
        return f"PLAIT_TIMEOUT={seconds:g} s"
    return f"the default timeout of {seconds:g} s (PLAIT_TIMEOUT)"


def _node_size_default(node_size: int | None) -> int | None:
    if node_size is None:  # unset or 0 (kept for scripts that wrote it for "by host")
        return env_settings.NODE_SIZE.read()  # type: ignore[no-any-return]
    return int(env_settings.NODE_SIZE.parse(node_size, "node_size"))


def init(
    *,
    backend: str | None = None,
    timeout: float | None = None,
    debug: bool | None = None,
    node_size: int | None = None,
    store: Any = None,
    check: bool | None = None,
    heartbeat_timeout: float | None = None,
    transport: str | None = None,
) -> Group:
    """Join the process group described by the environment; return the world group.

    ``backend``: ``"gloo"`` or ``"nccl"`` (default: :func:`choose_backend`), or
    ``"fake"``: PyTorch's fake process group, this process playing rank ``RANK`` (default 0)
    of ``WORLD_SIZE`` without moving data; tensors for it live on the ``meta`` device
    (``plait/comm/device.py``, ``docs/devices.md``).
    ``timeout``: seconds any collective may wait for other ranks (default 600, or
    ``PLAIT_TIMEOUT``). ``debug``: check every collective's full signature through the
    store before it runs (default: ``PLAIT_DEBUG=1``). ``check``: the default-mode check
    (default on, ``PLAIT_CHECK=0`` turns it off): each collective's signature is folded
    into its messages' tags, so ranks that disagree exchange nothing and raise
    :class:`~plait.comm.CollectiveMismatch` within about a second (see
    ``plait/comm/watchdog.py``). ``heartbeat_timeout``: seconds a peer may stop beating
    while another rank waits on it before that wait raises
    :class:`~plait.comm.errors.PeerUnresponsive` (default 5, ``PLAIT_HEARTBEAT_TIMEOUT``;
    at least 1). ``node_size``: ranks per node for the hierarchical algorithms (default:
    ``PLAIT_NODE_SIZE``, else ranks per host). ``transport``: how ranks of one host
    exchange messages, ``"auto"`` (shared memory where it works, else gloo), ``"shm"``
    (shared memory, refused where it cannot work) or ``"gloo"`` (default ``"auto"``, or
    ``PLAIT_TRANSPORT``); every group created afterwards uses the same. With ``node_size``
    the blocks count as hosts: ranks of different blocks talk through gloo.

    If ``torch.distributed`` is already initialized (the script called
    ``init_process_group``), plait adopts that process group. A second call with the same
    arguments returns the existing world group; with different ones it raises (call
    :func:`shutdown` first). Blocks until every rank has joined (at most ``timeout``).
    """
    global _world
    if "PLAIT_LAUNCHER_PID" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        # launched by `plait run` or torchrun: die with the launcher (a kill -9 of the agent
        # must not leave ranks training). Not for a script started by hand (nohup etc.).
        lifeline.arm_from_env()
    asked = {
        "backend": backend,
        "timeout": None if timeout is None else _seconds(timeout, "timeout"),
        "debug": debug,
        "node_size": node_size,
        "check": check,
        "heartbeat_timeout": heartbeat_timeout,
        "transport": None if transport is None else transport_mod.parse_mode(transport),
    }
    if _world is not None:
        differ = [
            f"{k}={v!r} (the world group has {k}={_settings.get(k)!r})"
            for k, v in asked.items()
            if v is not None and _settings.get(k) != v
        ]
        if differ:
            raise ValueError(
                f"plait.init: already initialized, with other settings: {', '.join(differ)}. "
                f"Call plait.shutdown() first to initialize again with new settings, or "
                f"drop these arguments to get the existing world group."
            )
        return _world
    timeout_s = _timeout_default(timeout)
    debug_on = _debug_default(debug)
    check_on = _flag("PLAIT_CHECK", check, True)
    nodes = _node_size_default(node_size)
    beat_s = watchdog.configure(heartbeat_timeout)
    mode = transport_mod.parse_mode(transport)
    transport_mod.configure()  # PLAIT_SHM_RING_BYTES, PLAIT_SHM_WINDOW_BYTES, PLAIT_SHM_SPIN_US
    recorder_size = recorder.size_from_env()
    recorder.check_directory()
    if backend == "fake" and not dist.is_initialized():
        _init_fake(timeout_s)
    if dist.is_initialized():
        adopted = str(dist.get_backend())
        if backend is not None and backend != adopted:
            raise ValueError(
                f"plait.init: backend={backend!r}, but torch.distributed is already "
                f"initialized with {adopted!r}; drop backend= to adopt that process group"
            )
        backend = adopted
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        launch_env.apply()  # srun's SLURM_*, Kubeflow's PET_*: the torchrun variables
        share_cores()
        missing = [k for k in _REQUIRED_ENV if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"plait.init: environment variables {missing} are not set. Launch with "
                f"`plait run -n N script.py`, torchrun, srun (one task per rank) or "
                f"plait.spawn(fn, world_size=N), which set them"
            )
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        backend = backend or choose_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
        if store is not None:
            kwargs["store"] = store
        elif progress.attempt_namespace():
            # torchrun's agent store outlives the attempt: a restarted attempt must not
            # read the failed one's gloo addresses (connectFullMesh "Connection refused")
            kwargs["store"] = dist.PrefixStore(
                progress.attempt_namespace() + "/default_pg",
                dist.TCPStore(
                    os.environ["MASTER_ADDR"],
                    int(os.environ["MASTER_PORT"]),
                    world_size,
                    False,
                    timeout=datetime.timedelta(seconds=timeout_s),
                ),
            )
        else:
            kwargs["init_method"] = "env://"
        try:
            dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
        except (RuntimeError, OSError) as exc:  # c10d's store and socket errors included
            raise _join_failed(exc, rank, world_size, _timeout_source(timeout, timeout_s)) from exc
    if backend == "fake":
        progress.configure(None, None)  # one process: no board, heartbeats or stall checks
    else:
        _configure_store()
    recorder.configure(rank=rank, size=recorder_size)
    _world = Group(
        pg=dist.group.WORLD,
        ranks=range(world_size),
        global_rank=rank,
        name="world",
        backend=backend,
        timeout=timeout_s,
        debug=debug_on,
        node_size=nodes,
        check=check_on,
    )
    _settings.clear()
    _settings.update(
        backend=backend,
        timeout=timeout_s,
        debug=debug_on,
        node_size=nodes,
        check=check_on,
        heartbeat_timeout=beat_s,
        transport=mode,
    )
    if backend != "fake":  # the fake backend's ranks but one do not exist: no links
        transport_mod.attach(_world, mode)
    return _world


def _init_fake(timeout_s: float) -> None:
    """``backend="fake"``: PyTorch's fake process group as the default one, this process
    playing rank ``RANK`` (default 0) of ``WORLD_SIZE``. No data moves; plait treats it as a
    device backend for the ``meta`` device (``plait/comm/device.py``)."""
    # deferred: torch's testing package, needed only for the fake backend
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world_size = int(os.environ.get("WORLD_SIZE", "0"))
    rank = int(os.environ.get("RANK", "0"))
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"plait.init(backend='fake'): WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} and "
            f"RANK={os.environ.get('RANK')!r}; set WORLD_SIZE to the world this process "
            f"plays a rank of (e.g. 8) and RANK (default 0) to its rank"
        )
    dist.init_process_group(
        "fake",
        store=FakeStore(),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _join_failed(exc: BaseException, rank: int, world_size: int, timeout: str) -> RuntimeError:
    """The error of a rank that could not join the process group, naming the store and
    the timeout that bounded the wait (c10d's own says "wait timeout after 1ms")."""
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    text = str(exc).splitlines()[0] if str(exc) else ""
    timed_out = "timeout" in text.lower() or "timed out" in text.lower()
    how = f"did not complete within {timeout}" if timed_out else f"failed (timeout: {timeout})"
    advice = "; raise PLAIT_TIMEOUT (or plait.init(timeout=...))" if timed_out else ""
    return RuntimeError(
        f"plait.init: rank {rank} of {world_size}: joining the process group through the "
        f"store at {where} (MASTER_ADDR:MASTER_PORT) {how} ({type(exc).__name__}: {text})"
        f"{advice}"
    )


def _configure_store() -> None:
    """Point the progress board at the rendezvous store: MASTER_ADDR/MASTER_PORT, or the
    TCP store of a process group the script initialized itself."""
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        progress.configure_from_env()
        return
    try:
        found = distributed_c10d._get_default_store()
        while not isinstance(found, dist.TCPStore) and hasattr(found, "underlying_store"):
            found = found.underlying_store
        if isinstance(found, dist.TCPStore):
            progress.configure(found.host, found.port)
            return
    except Exception:
        pass
    progress.configure(None, None)  # no store: no board, heartbeats or stall checks


def _adopt() -> Group | None:
    """The world group, adopting a process group the script initialized itself."""
    if _world is None and dist.is_available() and dist.is_initialized():
        return init()
    return _world


def world_or_none() -> Group | None:
    """The world group, or None when neither :func:`init` nor
    ``torch.distributed.init_process_group`` was called (single-process use)."""
    return _adopt()


def is_initialized() -> bool:
    """plait (or ``torch.distributed``, which plait then adopts) is initialized."""
    return _adopt() is not None


def world() -> Group:
    """The group of all ranks (after :func:`init`, or adopting the process group of
    ``torch.distributed.init_process_group``)."""
    group = _adopt()
    if group is None:
        raise RuntimeError(
            "plait is not initialized: call plait.init() at the start of the script (it "
            "reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, which `plait run -n N "
            "script.py` and torchrun set; plait.spawn calls it for you), or initialize "
            "torch.distributed yourself and plait adopts it"
        )
    return group


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
    global _groups_made
    w = world()
    members = sorted(set(int(r) for r in ranks))
    if not members or members[0] < 0 or members[-1] >= w.size:
        raise ValueError(
            f"new_group: ranks {list(ranks)} must be distinct ranks in 0..{w.size - 1}"
        )
    if node_size is not None and node_size <= 0:
        raise ValueError(f"new_group: node_size must be positive, got {node_size}")
    timeout_s = _seconds(timeout, "timeout") if timeout is not None else w.timeout
    pg = dist.new_group(members, timeout=datetime.timedelta(seconds=timeout_s))
    _groups_made += 1
    label = name or f"g{_groups_made}[{','.join(map(str, members))}]"
    # The progress board and the checks key groups by name: a name used before gets a
    # suffix. Every rank calls new_group in the same order, so all agree on the suffix.
    base, n = label, 1
    while label in _group_names or label == w.name:
        n += 1
        label = f"{base}#{n}"
    _group_names.add(label)
    if w.global_rank not in members:
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
        check=w.check,
    )
    _subgroups.append(group)
    if w.backend != "fake":
        transport_mod.attach(group, _settings.get("transport", transport_mod.DEFAULT_MODE))
    return group


def reverse_group(group: Group) -> Group:
    """A second process group over ``group``'s ranks, for the messages that travel from a
    higher group rank to a lower one (``group`` carries the others); made once per group
    and destroyed with it.

    Why: NCCL runs every send and receive between two ranks on one stream per process
    group, in issue order, so a receive posted early blocks a send to the same peer
    queued behind it, and two ranks that each wait for the other's send deadlock (the
    pipeline posts receives early: ``tests/test_meta_device_p2p.py``). With each
    direction of a pair on its own process group, hence its own stream, a send is never
    queued behind a receive. Collective over the group's ranks only (every member calls
    it, in the same order; ``use_local_synchronization``): the first message of a
    pipeline makes it on device backends."""
    twin = getattr(group, "reverse", None)
    if twin is not None:
        return twin  # type: ignore[no-any-return]
    pg = dist.new_group(
        list(group.ranks), timeout=group.timeout_delta, use_local_synchronization=True
    )
    twin = Group(
        pg=pg,
        ranks=group.ranks,
        global_rank=group.global_rank,
        name=f"{group.name}.reverse",
        backend=group.backend,
        timeout=group.timeout,
        debug=group.debug,
        node_size=group.node_size,
        check=group.check,
    )
    group.reverse = twin
    _subgroups.append(twin)
    return twin


def live_groups() -> list[Group]:
    """The groups :func:`new_group` made on this rank that are not destroyed yet, oldest
    first (the world group is not among them)."""
    return list(_subgroups)


def destroy_group(group: Group | None) -> None:
    """Destroy a group made by :func:`new_group` on this rank: wait for its pending
    collectives, stop its worker thread, close its shared-memory link and free its backend
    process group (gloo holds three threads and a socket per peer for each group until
    then). Local, no communication: each member calls it once its own collectives on the
    group are done (a failure of a collective still pending is left to whoever waits on
    its handle, as at process exit). ``None`` (a rank outside the group) does nothing.
    Using the group afterwards raises naming it. The world group is left by
    :func:`shutdown`, not here.
    :meth:`plait.Mesh.destroy` destroys a mesh's groups; a :class:`plait.RankPool` destroys
    the groups a run made when the run returns."""
    if group is None:
        return
    if group is _world:
        raise ValueError("destroy_group: the world group is left by plait.shutdown()")
    if group.reverse is not None:  # reverse_group's twin goes with it
        destroy_group(group.reverse)
        group.reverse = None
    if group not in _subgroups:
        if group.destroyed:
            return
        raise ValueError(f"destroy_group: {group!r} was not made by plait.new_group on this rank")
    _subgroups.remove(group)
    group.settle()
    group.shutdown()
    pg = group.release()
    if dist.is_initialized() and pg is not None:
        dist.destroy_process_group(pg)


def destroy_groups(keep: Sequence[Group] = ()) -> None:
    """Destroy every live group of :func:`live_groups` but ``keep``, newest first; the first
    failure is raised after all are destroyed."""
    kept = {id(g) for g in keep}
    first_error: BaseException | None = None
    for g in reversed(live_groups()):
        if id(g) in kept:
            continue
        try:
            destroy_group(g)
        except BaseException as exc:
            first_error = first_error or exc
    if first_error is not None:
        raise first_error


def shutdown() -> None:
    """Finish pending collectives, destroy every group and leave the process group."""
    global _world, _groups_made
    first_error: BaseException | None = None
    for g in [*_subgroups, _world]:
        if g is None:
            continue
        try:
            g.synchronize()
        except BaseException as exc:  # still leave the group; report the first failure
            first_error = first_error or exc
        g.shutdown()
        g.release()
    _subgroups.clear()
    _group_names.clear()
    _groups_made = 0
    _world = None
    _settings.clear()
    progress.stop()  # no plait thread in the store or the backend past this point
    if dist.is_initialized():
        dist.destroy_process_group()
    if first_error is not None:
        raise first_error
