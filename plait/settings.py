"""The ``PLAIT_*`` settings: every environment variable plait reads, and its valid values.

Each setting is parsed here, by one of a few parsers that refuse a bad value with a
``ValueError`` naming the variable, the value and the valid range (a value is never read
silently as its default). :data:`SETTINGS` lists them all; where each is read:

* at ``plait.init``, on every rank (``plait/runtime.py``): ``PLAIT_TIMEOUT``,
  ``PLAIT_DEBUG``, ``PLAIT_CHECK``, ``PLAIT_NODE_SIZE``, ``PLAIT_HEARTBEAT_TIMEOUT``,
  ``PLAIT_TRANSPORT``, ``PLAIT_SHM_RING_BYTES``, ``PLAIT_SHM_WINDOW_BYTES``,
  ``PLAIT_SHM_SPIN_US``, ``PLAIT_SHM_DIR``, ``PLAIT_RECORDER_SIZE``, ``PLAIT_RECORDER_DIR``;
  the settings every rank must share (the signature check and debug mode, the node size,
  the shared-memory ring and window bytes) are then compared across the ranks and a
  disagreement names the ranks and their values (``plait/comm/transport.py``);
* by a rank of ``plait run`` before it joins its job (``plait/launch/rank_entry.py``):
  ``PLAIT_CONNECT_TIMEOUT``, ``PLAIT_RENDEZVOUS_TIMEOUT``;
* by the launcher: ``PLAIT_MAX_NPROC``, ``PLAIT_HEARTBEAT_TIMEOUT``; ``plait run`` checks
  every setting with :func:`check` before it starts a rank, so a bad value stops the job
  once, at its start, with exit code 2;
* by the tuner, the first time ``algorithm="auto"`` chooses: ``PLAIT_TUNE_FILE``.

Timeouts are at least 1 s: each bounds a wait on other processes (a collective, the store's
first answer, the other ranks' arrival, a heartbeat), and on a machine shared with other
work a process is routinely descheduled for hundreds of milliseconds; a timeout below a
second fails healthy jobs with an error about the wait instead of the setting (0.001 s
ended in a raw c10d socket error).

Variables ``plait run`` sets for its ranks (:data:`LAUNCHER_VARIABLES`) are not settings.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

MIN_TIMEOUT_S = 1.0
_WHOLE = re.compile(r"^[+-]?\d+$")


@dataclass(frozen=True)
class Number:
    """A numeric setting: its variable, default, unit and valid range ``low .. high``."""

    name: str
    default: float | None  # None: unset means something the reader decides
    low: float
    high: float = math.inf
    unit: str = "seconds"
    whole: bool = False
    multiple: int = 1
    unset: tuple[str, ...] = ("",)  # values that mean "not set" (stripped)
    note: str = ""  # what the default or a special value means, said in the error

    def expected(self) -> str:
        """The valid values in words."""
        what = f"a whole number of {self.unit}" if self.whole else f"a finite number of {self.unit}"
        if self.multiple > 1:
            what += f", a multiple of {self.multiple},"
        if self.high == math.inf:
            return f"{what} >= {_shown(self.low)}"
        return f"{what} from {_shown(self.low)} to {_shown(self.high)}"

    def parse(self, value: Any, source: str | None = None) -> Any:
        """``value`` checked (an int where ``whole``, else a float); ``source`` names it in
        the error (default: the variable)."""
        number = _number(value, self.whole)
        ok = number is not None and self.low <= number <= self.high
        if number is None or not ok or (self.whole and number % self.multiple):
            more = [self.note] if self.note else []
            if self.default is not None:
                more.append(f"default {_shown(self.default)}")
            extra = f" ({'; '.join(more)})" if more else ""
            raise ValueError(f"{source or self.name}={value!r}: expected {self.expected()}{extra}")
        return number

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """The variable's value from ``environ`` (default ``os.environ``), checked; the
        default where it is unset or empty."""
        raw = (os.environ if environ is None else environ).get(self.name, "")
        if raw.strip() in self.unset:
            return self.default
        return self.parse(raw)


def _shown(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _number(value: Any, whole: bool) -> float | int | None:
    if isinstance(value, bool):
        return None
    if whole:
        if isinstance(value, int):
            return value
        text = str(value).strip()
        return int(text) if _WHOLE.match(text) else None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _seconds(name: str, default: float, note: str) -> Number:
    return Number(name, default, low=MIN_TIMEOUT_S, note=note)


TIMEOUT = _seconds(
    "PLAIT_TIMEOUT", 600.0, "how long a collective, and plait.init, may wait for the other ranks"
)
HEARTBEAT_TIMEOUT = _seconds(
    "PLAIT_HEARTBEAT_TIMEOUT", 5.0, "a rank silent this long counts as frozen"
)
CONNECT_TIMEOUT = _seconds(
    "PLAIT_CONNECT_TIMEOUT", 30.0, "how long a rank of plait run tries to reach the store"
)
RENDEZVOUS_TIMEOUT = _seconds(
    "PLAIT_RENDEZVOUS_TIMEOUT", 300.0, "how long a rank of plait run waits for the others to start"
)
NODE_SIZE = Number(
    "PLAIT_NODE_SIZE",
    None,
    low=1,
    whole=True,
    unit="ranks per node",
    unset=("", "0"),
    note="unset or 0: the ranks of each host",
)
RECORDER_SIZE = Number(
    "PLAIT_RECORDER_SIZE",
    2000,
    low=0,
    high=1_000_000,
    whole=True,
    unit="collectives",
    note="0 turns the flight recorder off",
)
SHM_RING_BYTES = Number(
    "PLAIT_SHM_RING_BYTES",
    512 << 10,
    low=4096,
    high=1 << 30,
    whole=True,
    multiple=4096,
    unit="bytes",
    note="each peer's message ring; the same on every rank",
)
SHM_WINDOW_BYTES = Number(
    "PLAIT_SHM_WINDOW_BYTES",
    2 << 20,
    low=4096,
    high=1 << 30,
    whole=True,
    multiple=4096,
    unit="bytes",
    note="each scratch window of the shared-memory collectives; the same on every rank",
)
SHM_SPIN_US = Number(
    "PLAIT_SHM_SPIN_US",
    50.0,
    low=0,
    high=1_000_000,
    unit="microseconds",
    note="a shared-memory wait spins this long before it sleeps; 0: sleep at once",
)
MAX_NPROC = Number(
    "PLAIT_MAX_NPROC",
    None,
    low=1,
    whole=True,
    unit="ranks",
    note="the most local ranks plait run starts; unset: 16 per CPU core",
)

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


def flag(name: str, raw: str, default: bool) -> bool:
    """A yes/no setting: ``1``/``0`` (also true/false, on/off, yes/no); empty: ``default``."""
    text = raw.strip().lower()
    if text == "":
        return default
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected 1 or 0 (also true/false, on/off)")


TRANSPORTS = ("auto", "shm", "gloo")


def transport(raw: Any, source: str = "PLAIT_TRANSPORT") -> str:
    """``auto``, ``shm`` or ``gloo`` (case and spaces ignored)."""
    mode = str(raw).strip().lower()
    if mode not in TRANSPORTS:
        raise ValueError(f"{source}={raw!r}: expected one of {', '.join(TRANSPORTS)}")
    return mode


def shm_dir_problem(raw: str) -> str | None:
    """Why ``PLAIT_SHM_DIR=raw`` cannot hold the shared-memory segments, or None (a
    directory the user named must exist and be writable: a silent fall back to gloo
    would hide the typo)."""
    if raw and not (os.path.isdir(raw) and os.access(raw, os.W_OK)):
        what = "does not exist" if not os.path.exists(raw) else "is not a writable directory"
        return (
            f"PLAIT_SHM_DIR={raw!r} {what}; point it at a writable directory on a memory "
            f"file system (/dev/shm) or unset it"
        )
    return None


def recorder_dir_problem(raw: str) -> str | None:
    """Why the flight recorder could not write its dumps into ``PLAIT_RECORDER_DIR=raw``,
    or None: it must be a directory, or one that can be created (its nearest existing
    parent a writable directory). A dump is written while a collective fails, when it is
    too late to say the directory was wrong."""
    if not raw:
        return None
    path = os.path.abspath(raw)
    if os.path.exists(path):
        if not os.path.isdir(path):
            return f"PLAIT_RECORDER_DIR={raw!r} is not a directory; name a directory or unset it"
        if not os.access(path, os.W_OK):
            return f"PLAIT_RECORDER_DIR={raw!r} is not writable; name a writable directory"
        return None
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not (os.path.isdir(parent) and os.access(parent, os.W_OK)):
        return (
            f"PLAIT_RECORDER_DIR={raw!r} cannot be created ({parent} is not a writable "
            f"directory); name a writable directory or unset it"
        )
    return None


def tune_file_problem(raw: str) -> str | None:
    """Why ``PLAIT_TUNE_FILE=raw`` cannot be a tuning table, or None (a file that does not
    exist yet is fine: ``plait bench comm --tune`` writes it; ``auto`` then warns and uses
    the default rule)."""
    if raw and os.path.isdir(raw):
        return f"PLAIT_TUNE_FILE={raw!r} is a directory; name a file (or unset it)"
    return None


def _refuse(problem: Callable[[str], str | None]) -> Callable[[str], None]:
    def check_one(raw: str) -> None:
        why = problem(raw)
        if why is not None:
            raise ValueError(why)

    return check_one


# Every setting: its variable and how a value is checked (raises ValueError naming it).
SETTINGS: dict[str, Callable[[str], Any]] = {
    **{
        n.name: n.parse
        for n in (
            TIMEOUT,
            HEARTBEAT_TIMEOUT,
            CONNECT_TIMEOUT,
            RENDEZVOUS_TIMEOUT,
            RECORDER_SIZE,
            SHM_RING_BYTES,
            SHM_WINDOW_BYTES,
            SHM_SPIN_US,
            MAX_NPROC,
        )
    },
    NODE_SIZE.name: lambda raw: NODE_SIZE.read({NODE_SIZE.name: raw}),
    "PLAIT_CHECK": lambda raw: flag("PLAIT_CHECK", raw, True),
    "PLAIT_DEBUG": lambda raw: flag("PLAIT_DEBUG", raw, False),
    "PLAIT_TRANSPORT": transport,
    "PLAIT_SHM_DIR": _refuse(shm_dir_problem),
    "PLAIT_RECORDER_DIR": _refuse(recorder_dir_problem),
    "PLAIT_TUNE_FILE": _refuse(tune_file_problem),
}

# Set by ``plait run`` for each rank (not settings; never checked here).
LAUNCHER_VARIABLES = (
    "PLAIT_JOB_ID",
    "PLAIT_ERROR_FILE",
    "PLAIT_LAUNCHER_PID",
    "PLAIT_FRESH_STORE",
    "PLAIT_RESTART_COUNT",
    "PLAIT_MAX_RESTARTS",
    "PLAIT_HEAL_JOIN",  # python -m plait.heal.run: "1" for a replacement (docs/healing.md)
)


_warned: set[str] = set()


def check(environ: Mapping[str, str] | None = None) -> list[str]:
    """Check every ``PLAIT_*`` setting of ``environ`` (default ``os.environ``).

    Raises ``ValueError`` naming every bad one (one line each). Returns warnings: a
    ``PLAIT_*`` variable that is no setting but nearly spells one (a typo, otherwise
    ignored in silence; other ``PLAIT_*`` names may be the user's own), each once per
    process."""
    env = os.environ if environ is None else environ
    bad = []
    for name, parse in SETTINGS.items():
        raw = env.get(name, "")
        if raw.strip() == "":
            continue
        try:
            parse(raw)
        except ValueError as exc:
            bad.append(str(exc))
    if bad:
        raise ValueError("\n".join(bad))
    warnings = []
    known = [*SETTINGS, *LAUNCHER_VARIABLES]
    for name in sorted(env):
        if name.startswith("PLAIT_") and name not in known and name not in _warned:
            _warned.add(name)
            near = difflib.get_close_matches(name, list(SETTINGS), n=1, cutoff=0.85)
            near = near or [s for s in SETTINGS if s.startswith(name)]
            if near:
                warnings.append(f"{name} is not a plait setting (did you mean {near[0]}?)")
    return warnings
