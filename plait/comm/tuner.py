"""``algorithm="auto"``: pick an algorithm per (backend, collective, message bytes, world size).

The choice comes from a table that ``plait bench comm --tune`` measures and writes (JSON,
by default ``~/.cache/plait/comm_tune.json``, or the file named by ``PLAIT_TUNE_FILE``)::

    {"version": 1, "backend": "gloo", "transport": "gloo", "torch": "2.13.0+cpu",
     "table": {"all_reduce": {"4": [[65536, "native"], [67108864, "ring"]]}}}

Each row says: up to this many bytes, use this algorithm (the last row also covers
larger messages). A world size missing from the table uses the nearest one measured.
Every rank must see the same table (ranks of one host read the same file); debug mode
checks it, since the resolved algorithm is part of each collective's signature.

A table is used only where it was measured: on a group of its backend (``"backend"``,
gloo when absent) and, on gloo, of its transport (``"transport": "shm"`` for a group whose
ranks all share memory, ``"gloo"`` otherwise). Elsewhere the rule of the group's backend
applies, and a table of another backend is said once in the log. The rules without a
table (:func:`rule_for`):

* gloo: :func:`default_rule`, fitted to gloo over loopback on two CPU cores;
* gloo with every rank sharing memory: :func:`shm_rule`;
* any other backend (NCCL, and any device backend: :func:`is_device_backend`):
  ``"native"`` for every collective and size (:func:`device_rule`). The backend's own
  collective runs its ring or tree on the device stream; plait's algorithms, built on
  Python ``isend``/``irecv``, add a kernel launch and a Python step per hop. They stay
  available there by name (``algorithm="ring"``), their bytes counted as anywhere.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from plait import settings

log = logging.getLogger("plait")

KIB, MIB = 1 << 10, 1 << 20

# Backends whose collectives run on host memory: the measured rules below are theirs.
HOST_BACKENDS = ("gloo",)


def is_device_backend(backend: str) -> bool:
    """A backend whose collectives run on a device (``"nccl"``, ``"xccl"``, PyTorch's
    ``"fake"`` test backend, ...): everything but gloo (shared memory is a transport under
    gloo groups, not a backend)."""
    return backend not in HOST_BACKENDS


def default_rule(collective: str, nbytes: int, world_size: int) -> str:
    """The choice without a table, read off ``benchmarks/comm.py`` (README, Benchmarks).

    On 2 cores with gloo over loopback a message hop costs 0.1-1 ms of thread wake-ups,
    so small messages go to the algorithm with the fewest sequential hops: ``naive``
    (two) while the world is small enough that rank 0 is not yet a bottleneck. Reduce-
    scatter and all-gather use the ring from there up: it sends half the bytes of gloo's
    own, which all-reduces the whole buffer. Large all-reduces stay with gloo, whose C++
    ring overlaps its reductions better than plait's; reduce takes the binomial tree up to
    16 MiB; large all-to-alls post every message at once.
    """
    small_world = world_size <= 4
    if collective == "all_reduce":
        return "naive" if small_world and nbytes <= 1 * MIB else "native"
    if collective == "reduce_scatter":
        return "naive" if small_world and nbytes <= 256 * KIB else "ring"
    if collective == "all_gather":
        return "ring"
    if collective == "broadcast":
        return "naive" if small_world and nbytes <= 256 * KIB else "native"
    if collective == "reduce":
        return "tree" if nbytes <= 16 * MIB else "native"
    if collective == "all_to_all":
        return "naive" if nbytes >= 4 * MIB else "native"
    return "native"


def shm_rule(collective: str, nbytes: int, world_size: int) -> str:
    """The choice without a table for a group whose ranks all share memory
    (``benchmarks/results/comm_shm.md`` and ``comm_shm_rooted.md``): the shared-memory
    collectives where they exist; for the rooted ones and all-to-all, ``naive``, fastest
    in 14 of 18 cells at worlds 2 and 4 from 4 KiB to 16 MiB and within the noise in the
    others (a copy into a peer's ring costs the root little, so the fewest hops win), and
    the binomial tree above 4 ranks, where the root's n-1 copies would add up."""
    if collective in ("all_reduce", "reduce_scatter", "all_gather"):
        return "shm"
    if collective in ("broadcast", "reduce"):
        return "naive" if world_size <= 4 else "tree"
    if collective == "all_to_all":
        return "naive"
    return default_rule(collective, nbytes, world_size)


def device_rule(collective: str, nbytes: int, world_size: int) -> str:
    """The choice without a table on a device backend: the backend's own collective, for
    every collective, size and world size (NCCL picks its ring or tree per message itself,
    ``NCCL_ALGO``; torchtitan, Megatron and DeepSpeed call it the same way)."""
    return "native"


def rule_for(backend: str, *, shm: bool = False) -> Callable[[str, int, int], str]:
    """The rule ``auto`` follows without a table on a group of ``backend`` (``shm``: every
    rank of the group shares memory with this one, which only gloo groups use)."""
    if is_device_backend(backend):
        return device_rule
    return shm_rule if shm else default_rule


_table: dict[str, dict[int, list[tuple[int, str]]]] | None = None
_transport = "gloo"
_backend = "gloo"
_loaded_from: str | None = None
_ignored_said: set[tuple[str, str]] = set()  # (table's backend, group's backend) logged


def table_path() -> Path:
    env = os.environ.get("PLAIT_TUNE_FILE")
    why = settings.tune_file_problem(env or "")
    if why is not None:
        raise ValueError(why)
    return Path(env) if env else Path.home() / ".cache" / "plait" / "comm_tune.json"


def load(path: str | os.PathLike[str] | None = None) -> None:
    """(Re)load the tuning table; a missing file means the default rule (said once in
    the log where ``PLAIT_TUNE_FILE`` named it: a typo would otherwise go unnoticed)."""
    global _table, _loaded_from, _transport, _backend
    named = path is None and bool(os.environ.get("PLAIT_TUNE_FILE"))
    p = Path(path) if path is not None else table_path()
    where = f"{p} (PLAIT_TUNE_FILE)" if named else str(p)
    _loaded_from = str(p)
    _transport = _backend = "gloo"
    _ignored_said.clear()
    if not p.exists():
        if named:
            log.warning("plait: %s does not exist; algorithm='auto' uses the default rule", where)
        _table = {}
        return
    try:
        data = json.loads(p.read_text())
    except ValueError as exc:
        raise ValueError(
            f"{where} is not a tuning table (JSON: {exc}); rewrite it with "
            f"`plait bench comm --tune`, or remove it"
        ) from None
    _transport = str(data.get("transport", "gloo"))
    _backend = str(data.get("backend", "gloo"))  # tables older than the field: all gloo
    if data.get("version") != 1:
        raise ValueError(f"{where}: unknown tuning table version {data.get('version')!r}")
    _table = {
        coll: {int(w): [(int(b), str(a)) for b, a in rows] for w, rows in per_world.items()}
        for coll, per_world in data.get("table", {}).items()
    }


def save(
    table: dict[str, dict[int, list[tuple[int, str]]]],
    path: Path,
    backend: str,
    transport: str = "gloo",
) -> None:
    """Write a tuning table atomically (write a temporary file, then rename), with the
    backend and transport it was measured on and the torch version that measured it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {
        "version": 1,
        "backend": backend,
        "transport": transport,
        "torch": torch.__version__,
        "table": {
            coll: {str(w): [[b, a] for b, a in rows] for w, rows in per_world.items()}
            for coll, per_world in table.items()
        },
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


def choose(
    collective: str, nbytes: int, world_size: int, *, shm: bool = False, backend: str = "gloo"
) -> str:
    """The algorithm ``auto`` uses for this collective, size and world size on a group of
    ``backend``; ``shm``: every rank of the group shares memory with this one."""
    if _table is None:
        load()
    assert _table is not None
    rule = rule_for(backend, shm=shm)
    per_world = _table.get(collective)
    if not per_world or not _measured_for(backend, shm):
        return rule(collective, nbytes, world_size)
    rows = per_world[min(per_world, key=lambda k: (abs(k - world_size), k))]
    picked = next((a for max_bytes, a in rows if nbytes <= max_bytes), rows[-1][1])
    if picked == "shm" and not shm:  # a table written without its transport recorded
        return rule(collective, nbytes, world_size)
    return picked


def _measured_for(backend: str, shm: bool) -> bool:
    """The loaded table was measured on this backend (and, on gloo, this transport); a
    table of another backend is said once per pair of backends."""
    if _backend != backend:
        if _table and (_backend, backend) not in _ignored_said:
            _ignored_said.add((_backend, backend))
            log.warning(
                "plait: the tuning table %s was measured on backend %r; algorithm='auto' on "
                "a %r group ignores it and uses %s (measure one there with `plait bench comm "
                "--tune`)",
                _loaded_from,
                _backend,
                backend,
                rule_for(backend, shm=shm).__name__,
            )
        return False
    if is_device_backend(backend):
        return True
    return (_transport == "shm") == shm
