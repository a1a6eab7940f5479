"""A :class:`~plait.mesh.Mesh` over one model-parallel replica, made from the rendezvous
store without the world's process group.

A healing PTD-P job (:mod:`.replicas`) has no world group: a replica that dies is
replaced by new processes, which cannot join a process group made before they existed.
So each replica builds its own mesh (``pp x tp x cp``, ``dp = 1``) among its own ranks:
every line of the grid through this rank is a backend process group made from the store
under ``<prefix>/<dims><ranks>`` (:func:`.groups.make`: gloo or NCCL, plait's transport
between ranks of one host), wrapped in a plait :class:`~plait.comm.group.Group` whose
name starts with the prefix. The prefix names the replica's incarnation (its first
start, or the generation a replacement joined in), so a replacement never reads a dead
incarnation's addresses, counters or agreement keys (the mesh's :attr:`tag`, which
:func:`plait.strategies.compose.agreement.check_agreement` puts in its labels).

Everything else is :class:`~plait.mesh.Mesh`'s: ``group(dim)``, ``rank(dim)``, ``shape``,
``submesh`` (its flattened group made the same way), so :func:`plait.compose` takes it
as it is. Building it is collective over the replica's ranks (each line's ranks connect,
at most ``connect_timeout`` s); nothing is compared across ranks beyond what
``compose`` checks itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from plait.comm.group import Group
from plait.heal import groups
from plait.mesh import Mesh, fingerprint, layout


class StoreMesh(Mesh):
    """``StoreMesh(store, prefix=..., ranks=[...], rank=r, backend="gloo", timeout=...,
    connect_timeout=..., pp=2, tp=2)``: the mesh of one replica (module docstring)."""

    def __init__(
        self,
        store: Any,
        *,
        prefix: str,
        ranks: Sequence[int],
        rank: int,
        backend: str,
        timeout: float,
        connect_timeout: float,
        **dims: int,
    ) -> None:
        self.layout = layout(len(ranks), dims, ranks=ranks)
        self._print = fingerprint(self.layout)
        self.global_rank = rank
        self._timeout = timeout
        self._id = 0
        self._groups: dict[tuple[str, ...], Group | None] = {}
        self._made: list[Group] = []
        self._owner: Mesh = self
        self._destroyed = False
        self.store, self.prefix, self.backend = store, prefix, backend
        self.connect_timeout = connect_timeout
        self.tag = prefix
        for name in self.layout.names:
            self._groups[(name,)] = self._create((name,))

    def _agree(self, text: str) -> None:
        """Nothing to compare through the world's store: there is none (every rank of a
        replica builds the same mesh from the same recipe, which ``compose`` checks)."""

    def _carried(self) -> dict[str, object]:
        return {
            "store": self.store,
            "prefix": self.prefix,
            "backend": self.backend,
            "connect_timeout": self.connect_timeout,
            "tag": self.tag,
        }

    def _create(self, dims: tuple[str, ...]) -> Group | None:
        """This rank's group along ``dims``, from the store: collective over its ranks."""
        members = tuple(self.layout.group_of(self.global_rank, *dims))
        key = f"{'+'.join(dims)}{list(members)}"
        group = groups.make(
            dist.PrefixStore(f"{self.prefix}/{key}", self.store),
            members,
            self.global_rank,
            name=f"{self.prefix}.{key}",
            backend=self.backend,
            timeout=self._timeout if self._timeout is not None else 60.0,
            connect_timeout=self.connect_timeout,
        )
        self._owner._made.append(group)
        return group

    def destroy(self) -> None:
        """Stop this mesh's groups (local, after this rank's last collective on them):
        their worker threads and transport links."""
        made, self._made = self._made, []
        self._groups = {}
        self._destroyed = True
        for g in reversed(made):
            g.shutdown()

    def abandon(self, error: BaseException) -> None:
        """Give up this mesh's groups after ``error`` (the replica is lost): tell the peers,
        abort the backends, without waiting on a peer (:func:`.groups.abandon`)."""
        made, self._made = self._made, []
        self._groups = {}
        self._destroyed = True
        for g in reversed(made):
            groups.abandon(g, error)
