"""The launcher's rendezvous store: a ``TCPStore`` hosted on 127.0.0.1 for each attempt
(:func:`host_store`), and when its port is taken, the process that holds it
(:class:`PortInUse`)."""

from __future__ import annotations

import datetime
import errno
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist


class PortInUse(RuntimeError):
    """The launcher could not bind its store's port; the message names port and owner."""


def _port_owner(port: int) -> str:
    """'pid 123 (python)' for the process listening on a local TCP ``port``, if visible."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) > 9 and parts[3] == "0A" and int(parts[1].split(":")[1], 16) == port:
                inodes.add(parts[9])
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    comm = (proc / "comm").read_text().strip()
                    return f"pid {proc.name} ({comm})"
        except OSError:
            continue
    return "another process"


def host_store(port: int | None, *, timeout: float = 300.0) -> Any:
    """A rendezvous store on 127.0.0.1 (a free port unless ``port`` is given)."""

    try:
        return dist.TCPStore(
            "127.0.0.1",
            port or 0,
            None,
            True,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as exc:
        text = str(exc).lower()
        in_use = "in use" in text or "bind" in text or getattr(exc, "errno", 0) == errno.EADDRINUSE
        if port and in_use:
            raise PortInUse(
                f"port {port} on 127.0.0.1 is already in use by {_port_owner(port)}: another "
                f"job's store? Pick another --master-port, or leave it out (a free port is "
                f"chosen)"
            ) from None
        raise
