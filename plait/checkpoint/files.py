"""Atomic files: a checkpoint is either complete on disk or not there at all.

Every file is written to a temporary name in the same directory, flushed to disk, and
renamed over its final name (``os.replace`` is atomic on one filesystem). A reader never
sees half a file; a crash leaves at most a stray ``*.tmp`` that the next save overwrites.
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def write_bytes_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def save_atomic(obj: Any, path: Path) -> None:
    """``torch.save(obj)`` to ``path``, atomically."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_bytes_atomic(path, buffer.getvalue())
