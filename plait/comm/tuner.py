"""``algorithm="auto"``: pick an algorithm per (collective, message bytes, world size).

The choice comes from a table that ``plait bench comm --tune`` measures and writes (JSON,
by default ``~/.cache/plait/comm_tune.json``, or the file named by ``PLAIT_TUNE_FILE``)::

    {"version": 1, "backend": "gloo",
     "table": {"all_reduce": {"4": [[65536, "native"], [67108864, "ring"]]}}}

Each row says: up to this many bytes, use this algorithm (the last row also covers
larger messages). A world size missing from the table uses the nearest one measured.
Every rank must see the same table (ranks of one host read the same file); debug mode
checks it, since the resolved algorithm is part of each collective's signature.

With no table, :data:`DEFAULT_RULE` applies. It was read off ``benchmarks/comm.py`` on a
2-core machine with gloo over loopback: small messages go to the backend, whose single
call beats plait's several Python-driven steps; from the crossover up, the ring, whose
reduce-scatter and all-gather send half the bytes of gloo's own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# (collective) -> [(max bytes, algorithm), ...]; the last row also covers larger messages
DEFAULT_RULE: dict[str, list[tuple[int, str]]] = {
    "all_reduce": [(256 << 10, "native"), (1 << 62, "ring")],
    "reduce_scatter": [(16 << 10, "native"), (1 << 62, "ring")],
    "all_gather": [(16 << 10, "native"), (1 << 62, "ring")],
    "broadcast": [(1 << 62, "native")],
    "reduce": [(1 << 62, "native")],
    "all_to_all": [(1 << 62, "native")],
    "barrier": [(1 << 62, "native")],
}

_table: dict[str, dict[int, list[tuple[int, str]]]] | None = None
_loaded_from: str | None = None


def table_path() -> Path:
    env = os.environ.get("PLAIT_TUNE_FILE")
    return Path(env) if env else Path.home() / ".cache" / "plait" / "comm_tune.json"


def load(path: str | os.PathLike[str] | None = None) -> None:
    """(Re)load the tuning table; a missing file means the default rule."""
    global _table, _loaded_from
    p = Path(path) if path is not None else table_path()
    _loaded_from = str(p)
    if not p.exists():
        _table = {}
        return
    data = json.loads(p.read_text())
    if data.get("version") != 1:
        raise ValueError(f"{p}: unknown tuning table version {data.get('version')!r}")
    _table = {
        coll: {int(w): [(int(b), str(a)) for b, a in rows] for w, rows in per_world.items()}
        for coll, per_world in data.get("table", {}).items()
    }


def save(table: dict[str, dict[int, list[tuple[int, str]]]], path: Path, backend: str) -> None:
    """Write a tuning table atomically (write a temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {
        "version": 1,
        "backend": backend,
        "table": {
            coll: {str(w): [[b, a] for b, a in rows] for w, rows in per_world.items()}
            for coll, per_world in table.items()
        },
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


def choose(collective: str, nbytes: int, world_size: int) -> str:
    """The algorithm ``auto`` uses for this collective, size and world size."""
    if _table is None:
        load()
    assert _table is not None
    per_world = _table.get(collective)
    if per_world:
        w = min(per_world, key=lambda k: (abs(k - world_size), k))
        rows = per_world[w]
    else:
        rows = DEFAULT_RULE[collective]
    for max_bytes, algorithm in rows:
        if nbytes <= max_bytes:
            return algorithm
    return rows[-1][1]
