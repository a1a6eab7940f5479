"""Which transport carries each peer's messages: shared memory on one host, gloo otherwise.

``attach(group, mode)`` runs once per group, at its creation (``plait.init``,
``plait.new_group``), on every rank of the group; it blocks on the other ranks through
the rendezvous store (at most the group's timeout). ``mode`` comes from
``plait.init(transport=...)`` or ``PLAIT_TRANSPORT``:

* ``"gloo"``: every message goes through the process group (gloo's TCP, also on one host).
* ``"shm"``: peers on this host through shared memory (``shm.py``); refused with a
  ``ValueError`` where shared memory cannot work (not Linux x86-64, NCCL, no segment dir).
* ``"auto"`` (the default): as ``"shm"`` where it works, else gloo, with a warning when a
  segment could not be made (naming the directory, the bytes asked and the bytes free).

An explicit ``PLAIT_SHM_DIR`` that is not a writable directory is refused (``ValueError``
on every rank, ``auto`` too: falling back to gloo would hide the typo).

Steps, each a round through the store under ``plait/shm/<group>/<generation>/``:

1. each rank publishes its mode and its *host key*: host name, boot id, the device and
   inode of the segment directory, its pid and network namespaces (two ranks share memory
   only if all agree; ranks in two network namespaces are two hosts, as the two-host
   tests make them), plus the ``node_size`` block when the group has one (simulated hosts
   talk gloo). Every rank publishes, ``gloo`` ones too: ranks that chose different modes
   raise ``ValueError`` on every rank naming each rank's mode (one rank alone on
   ``PLAIT_TRANSPORT=gloo`` used to leave the others waiting for its key); so do ranks
   that disagree on a setting every rank must share (:func:`shared_settings`: the
   signature check, debug mode, the node size, and for shared memory the ring and window
   bytes), naming each value and its ranks (``PLAIT_SHM_WINDOW_BYTES`` set on one rank
   only used to end in a tensor size error inside a collective);
2. each rank with local peers creates its segment ``plait-shm-<pid>-<nonce>-...`` (pid and
   a random nonce: no two jobs or groups collide), reserves every byte of it
   (``posix_fallocate``: no SIGBUS later when the directory fills up) and publishes its
   path, size and token; if any local rank failed, all of them fall back to gloo (auto)
   or raise naming it (shm);
3. each rank maps its peers' segments, checks their tokens, says so, and once every local
   peer has mapped its segment unlinks it: from then on no file exists, so no exit path
   (kill -9 included) can leak one. A rank killed inside these milliseconds leaves its
   file behind (and the others, stopped while waiting, theirs): ``plait run`` removes the
   segments named by its ranks' pids when the attempt ends, and :func:`remove_stale`
   deletes files whose creator's pid is gone at the next group creation on the host.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import re
import secrets
import socket
import zlib
from typing import TYPE_CHECKING, Any

from torch.distributed import distributed_c10d

from plait import settings
from plait.comm import shm

if TYPE_CHECKING:
    from plait.comm.group import Group

MODES = ("auto", "shm", "gloo")
DEFAULT_MODE = "auto"
PREFIX = "plait-shm-"
RING_BYTES = int(settings.SHM_RING_BYTES.default or 0)  # 512 KiB
WINDOW_BYTES = int(settings.SHM_WINDOW_BYTES.default or 0)  # 2 MiB
STALE_NAME = re.compile(rf"^{PREFIX}(\d+)-")  # the creator's pid

log = logging.getLogger("plait")
_cleaned = False


def parse_mode(value: str | None) -> str:
    """``value``, else ``PLAIT_TRANSPORT``, else :data:`DEFAULT_MODE`; checked."""
    if value is not None:
        return settings.transport(value, "transport")
    return settings.transport(os.environ.get("PLAIT_TRANSPORT", "") or DEFAULT_MODE)


_SIZES = {n.name: n for n in (settings.SHM_RING_BYTES, settings.SHM_WINDOW_BYTES)}


def _bytes_setting(name: str, default: int) -> int:
    """``PLAIT_SHM_RING_BYTES`` or ``PLAIT_SHM_WINDOW_BYTES`` (checked), else ``default``."""
    raw = os.environ.get(name, "")
    return default if raw.strip() == "" else int(_SIZES[name].parse(raw))


def configure() -> tuple[int, int]:
    """Check this process's shared-memory settings (``plait.init`` calls it first, so a
    bad value is named before any rank waits on another): returns (ring bytes, window
    bytes) and sets the spin of a shared-memory wait from ``PLAIT_SHM_SPIN_US``."""
    ring = _bytes_setting("PLAIT_SHM_RING_BYTES", RING_BYTES)
    window = _bytes_setting("PLAIT_SHM_WINDOW_BYTES", WINDOW_BYTES)
    shm.SPIN_S = float(settings.SHM_SPIN_US.read()) * 1e-6
    return ring, window


def segment_dir() -> str:
    return os.environ.get("PLAIT_SHM_DIR", "/dev/shm")


def bad_setting() -> str | None:
    """Why an explicit ``PLAIT_SHM_DIR`` cannot serve, or None: a directory the user named
    must exist and be writable (a silent fall back to gloo would hide the typo)."""
    return settings.shm_dir_problem(os.environ.get("PLAIT_SHM_DIR", ""))


def unsupported(backend: str) -> str | None:
    """Why shared memory cannot serve this process, or None."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return (
            f"the shared-memory transport needs Linux on x86-64 (its ordering relies on "
            f"x86-64 stores), this is {platform.system()} {platform.machine()}"
        )
    if backend != "gloo":
        return f"the shared-memory transport carries CPU tensors for gloo, not {backend!r}"
    if not os.path.isdir(segment_dir()) or not os.access(segment_dir(), os.W_OK):
        return f"{segment_dir()} is not a writable directory (set PLAIT_SHM_DIR)"
    return None


def host_key(node: int | None) -> str:
    """What two ranks must share to share memory (see the module docstring)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    d = os.stat(segment_dir())
    spaces = []
    for ns in ("pid", "net"):  # other pid numbers; another network namespace: another host
        try:
            spaces.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
        except OSError:
            spaces.append("?")
    key = f"{socket.gethostname()}|{boot}|{d.st_dev}:{d.st_ino}|{'|'.join(spaces)}"
    return key if node is None else f"{key}|node{node}"


def remove_stale(directory: str | None = None) -> list[str]:
    """Delete segment files whose creating process no longer exists; return their paths."""
    directory = directory or segment_dir()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        m = STALE_NAME.match(name)
        if m is None or shm.pid_alive(int(m.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    if removed:
        log.warning(
            "plait: removed %d shared-memory segment(s) left by a killed job: %s",
            len(removed),
            ", ".join(removed),
        )
    return removed


def _store() -> Any:

    return distributed_c10d._get_default_store()


def _wait_all(store: Any, group: Group, keys: list[str], what: str) -> list[str]:

    try:
        store.wait(keys, datetime.timedelta(seconds=group.timeout))
    except Exception as exc:
        late = [k for k in keys if not store.check([k])]
        raise RuntimeError(
            f"group {group.name!r}: rank {group.global_rank} waited {group.timeout:g}s for "
            f"{what} of the other ranks; missing: {late} ({exc})"
        ) from exc
    return [store.get(k).decode() for k in keys]


def attach(group: Group, mode: str, *, store: Any = None) -> None:
    """Give ``group`` a shared-memory link to its ranks on this host (``mode`` permitting).

    Collective over the group's ranks: every rank must call it, in the same order.
    ``store``: where the ranks meet (default: the default process group's store; a group
    made outside ``plait.init``, as healing's generations, passes its own).
    """
    global _cleaned
    if group.size == 1:
        return
    fatal = bad_setting() if mode != "gloo" else None
    why = None if mode == "gloo" else fatal or unsupported(group.backend)
    mykey = host_key(me_node(group)) if why is None and mode != "gloo" else ""
    store = _store() if store is None else store
    me, n = group.rank, group.size
    gen = (int(store.add(f"plait/shm/{group.name}/joined", 1)) - 1) // n
    base = f"plait/shm/{group.name}/{gen}/"
    # every rank publishes its mode (gloo included): a rank that alone chose another
    # transport is named on every rank instead of leaving the others waiting for its key;
    # so are the settings every rank must share
    offer = {
        "mode": mode,
        "key": mykey,
        "why": why,
        "fatal": fatal is not None,
        "shared": shared_settings(group, mode),
    }
    store.set(f"{base}host/{me}", json.dumps(offer))
    offers = [
        json.loads(o)
        for o in _wait_all(store, group, [f"{base}host/{r}" for r in range(n)], "the host keys")
    ]
    _agree_mode(group, offers)
    _agree_settings(group, offers)
    if mode == "gloo":
        return
    refused = [
        (r, o["why"]) for r, o in enumerate(offers) if o["why"] and (o["fatal"] or mode == "shm")
    ]
    if refused:
        text = "; ".join(f"rank {group.ranks[r]}: {w}" for r, w in refused)
        raise ValueError(f"transport={mode!r} for group {group.name!r}: {text}")
    if why is not None:
        return
    if not _cleaned:
        remove_stale()
        _cleaned = True
    hosts = [o["key"] for o in offers]
    local = [r for r in range(n) if hosts[r] == mykey]
    if len(local) == 1:
        return
    peers = [r for r in local if r != me]
    ring = _bytes_setting("PLAIT_SHM_RING_BYTES", RING_BYTES)
    window = _bytes_setting("PLAIT_SHM_WINDOW_BYTES", WINDOW_BYTES)
    first, stride, scratch_at = shm.layout(n, len(peers), ring, window)
    size = scratch_at + 2 * window
    token = secrets.randbits(62)
    path = os.path.join(
        segment_dir(),
        f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{zlib.crc32(group.name.encode()):08x}-{gen}",
    )
    mine: shm.Segment | None = None
    try:
        try:
            mine = shm.Segment(path, size, create=True)
            mine.q[0], mine.q[1], mine.q[2] = shm.MAGIC, token, os.getpid()
            store.set(f"{base}seg/{me}", f"ok {path} {size} {ring} {window} {token} {os.getpid()}")
        except OSError as exc:
            store.set(f"{base}seg/{me}", f"fail {exc}")
        infos = _wait_all(
            store, group, [f"{base}seg/{r}" for r in local], "the shared-memory segments"
        )
        failed = [(r, i[5:]) for r, i in zip(local, infos, strict=True) if i.startswith("fail")]
        if failed:
            text = "; ".join(f"rank {group.ranks[r]}: {why}" for r, why in failed)
            if mode == "shm":
                raise RuntimeError(
                    f"transport='shm': group {group.name!r} could not make its shared-memory "
                    f"segments ({text}); free space in {segment_dir()} or use 'auto'/'gloo'"
                )
            log.warning("plait: group %r uses gloo on this host: %s", group.name, text)
            return
        assert mine is not None
        parsed = {r: i.split() for r, i in zip(local, infos, strict=True)}
        rings: dict[int, int] = {me: ring}
        scratch: dict[int, tuple[int, int]] = {}
        try:
            opened = _open_peers(group, local, parsed)
        except Exception as exc:
            store.set(f"{base}mapped/{me}", f"fail {exc}")
            raise
        for r in local:
            _, _, _, rb, wb, _, _ = parsed[r]
            rings[r] = int(rb)
            if int(wb):
                theirs = [x for x in local if x != r]
                scratch[r] = (shm.layout(n, len(theirs), int(rb), int(wb))[2], int(wb))
        inbound = {r: first + peers.index(r) * stride for r in peers}
        store.set(f"{base}mapped/{me}", "ok")
        done = _wait_all(
            store, group, [f"{base}mapped/{r}" for r in local], "the mapping of segments"
        )
        bad = [
            f"rank {group.ranks[r]}: {d[5:]}"
            for r, d in zip(local, done, strict=True)
            if d.startswith("fail")
        ]
        if bad:
            for seg, _, _ in opened.values():
                seg.close()
            raise RuntimeError(
                f"group {group.name!r}: shared-memory segments could not be mapped "
                f"({'; '.join(bad)}); set PLAIT_TRANSPORT=gloo"
            )
        group.shm = shm.ShmLink(group, mine, opened, inbound, rings, scratch)
        mine = None  # the link owns it now
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        if mine is not None:
            mine.close()


def me_node(group: Group) -> int | None:
    """This rank's simulated host, where the group has ``node_size`` (else None)."""
    return group.rank // group.node_size if group.node_size else None


def _agree_mode(group: Group, offers: list[dict[str, Any]]) -> None:
    """Raise on every rank when the ranks of ``group`` chose different transports."""
    modes: dict[str, list[int]] = {}
    for r, o in enumerate(offers):
        modes.setdefault(o["mode"], []).append(group.ranks[r])
    if len(modes) > 1:
        text = "; ".join(f"ranks {rs} chose {m!r}" for m, rs in modes.items())
        raise ValueError(
            f"group {group.name!r}: the ranks disagree on the transport ({text}); set the "
            f"same PLAIT_TRANSPORT (or plait.init(transport=...)) on every rank"
        )


def shared_settings(group: Group, mode: str) -> dict[str, Any]:
    """The settings every rank of ``group`` must share, by the name a message gives them:
    a rank alone without the signature check or debug mode sends other tags or waits for
    signatures nobody writes (a hang until the timeout); another node size picks other
    algorithms; other shared-memory ring or window bytes (shm and auto only) misread the
    peers' segments (a tensor size error deep inside a collective)."""
    shared: dict[str, Any] = {
        "the signature check (check=, PLAIT_CHECK)": group.check,
        "debug mode (debug=, PLAIT_DEBUG)": group.debug,
        "node_size (PLAIT_NODE_SIZE)": group.node_size,
    }
    if mode != "gloo":
        shared["PLAIT_SHM_RING_BYTES"] = _bytes_setting("PLAIT_SHM_RING_BYTES", RING_BYTES)
        shared["PLAIT_SHM_WINDOW_BYTES"] = _bytes_setting("PLAIT_SHM_WINDOW_BYTES", WINDOW_BYTES)
    return shared


def _agree_settings(group: Group, offers: list[dict[str, Any]]) -> None:
    """Raise on every rank when the ranks of ``group`` disagree on a shared setting,
    naming each setting's values and the ranks holding each (after :func:`_agree_mode`:
    the ranks chose one transport)."""
    differ = []
    for name in offers[0]["shared"]:
        values: dict[str, list[int]] = {}
        for r, o in enumerate(offers):
            values.setdefault(_shown(o["shared"].get(name)), []).append(group.ranks[r])
        if len(values) > 1:
            text = "; ".join(f"ranks {rs} have {v}" for v, rs in values.items())
            differ.append(f"{name} ({text})")
    if differ:
        raise ValueError(
            f"group {group.name!r}: the ranks disagree on {'; and on '.join(differ)}; "
            f"set the same value on every rank (the same environment, or the same "
            f"plait.init arguments)"
        )


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "unset" if value is None else str(value)


def _open_peers(
    group: Group, local: list[int], parsed: dict[int, list[str]]
) -> dict[int, tuple[shm.Segment, int, int]]:
    """Map every local peer's segment: (segment, pid, offset of this rank's ring in it)."""
    me, n = group.rank, group.size
    opened: dict[int, tuple[shm.Segment, int, int]] = {}
    try:
        for r in local:
            if r == me:
                continue
            _, p, s, rb, wb, tok, pid = parsed[r]
            theirs = [x for x in local if x != r]
            f, st, _ = shm.layout(n, len(theirs), int(rb), int(wb))
            seg = shm.Segment(p, int(s), create=False)
            opened[r] = (seg, int(pid), f + theirs.index(me) * st)
            if seg.q[0] != shm.MAGIC or seg.q[1] != int(tok):
                raise RuntimeError(
                    f"rank {group.global_rank} opened {p} of rank {group.ranks[r]} but found "
                    f"another segment there"
                )
    except Exception:
        for seg, _, _ in opened.values():
            seg.close()
        raise
    return opened
