"""What a rank reads about itself each step: its peak memory and the bytes it sent.

Peak memory is the CUDA caching allocator's high-water mark
(``torch.cuda.max_memory_allocated``: the tensors' bytes, not what the allocator reserved)
when this process uses CUDA, else the process's resident set's high-water mark
(``getrusage``'s ``ru_maxrss``: everything the process touched, the Python interpreter and
torch's libraries included, and never lower than at any earlier point). Records say which
(``memory_kind``).

Bytes sent are plait's own counts (:func:`plait.comm.group_stats`): what plait's
algorithms handed to the transport, per group; a ``"native"`` collective counts its
payload (what the backend sends inside is not visible to plait). :class:`BytesSent` reads
them as differences between two readings, so nothing else that reads them is disturbed.
"""

from __future__ import annotations

import re
import resource
import sys
from typing import TYPE_CHECKING

import torch

from plait.comm import group as comm_group

if TYPE_CHECKING:
    from plait.mesh import Mesh

CUDA = "cuda max_memory_allocated"
RSS = "process max RSS"


def memory_kind() -> str:
    """:data:`CUDA` when this process has used CUDA, else :data:`RSS`."""
    return CUDA if torch.cuda.is_available() and torch.cuda.is_initialized() else RSS


def peak_memory(kind: str) -> int:
    """This rank's peak memory in bytes, as ``kind`` (:func:`memory_kind`) measures it."""
    if kind == CUDA:
        return int(torch.cuda.max_memory_allocated())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux says KiB


def group_label(name: str, dims: dict[str, str]) -> str:
    """A group's name for a record: its mesh dimension (``"tp"``, ``"dp+ep"``) when
    ``dims`` (group name -> dimension) or the name's pattern says it, else the name."""
    if name in dims:
        return dims[name]
    several = re.match(r"^mesh\d+\.([a-z]+(?:\+[a-z]+)+)\d*\[", name)
    return several.group(1) if several else name


class BytesSent:
    """Bytes this rank sent per group since the previous :meth:`read`."""

    def __init__(self, mesh: Mesh | None = None) -> None:
        self.dims: dict[str, str] = {}
        if mesh is not None:
            for d in mesh.names:
                g = mesh.group(d)
                if g is not None:
                    self.dims[g.name] = d
        self._last = self._totals()

    @staticmethod
    def _totals() -> dict[str, int]:
        out: dict[str, int] = {}
        for (group, _collective, algorithm), s in comm_group.group_stats().items():
            sent = s.payload_bytes if algorithm == "native" else s.bytes_sent
            out[group] = out.get(group, 0) + sent
        return out

    def read(self) -> dict[str, int]:
        """``{group label: bytes}`` since the previous read (groups that sent nothing are
        left out). A :func:`plait.comm.reset_stats` between two reads is seen where a count
        fell (it then counts from the reset), so reset before creating the reader, as the
        demo does, not during a run."""
        now = self._totals()
        out: dict[str, int] = {}
        for name, total in now.items():
            before = self._last.get(name, 0)
            sent = total - before if total >= before else total  # counts reset since
            if sent > 0:
                label = group_label(name, self.dims)
                out[label] = out.get(label, 0) + sent
        self._last = now
        return out


__all__ = ["CUDA", "RSS", "BytesSent", "group_label", "memory_kind", "peak_memory"]
