"""A device mesh: the ranks as a grid of named dimensions, one group per line of the grid.

``Mesh(pp=2, dp=2, tp=2)`` lays 8 ranks out as a 2 x 2 x 2 grid and creates, once, the
groups along each dimension: ``mesh.group("tp")`` is the group of ranks that differ only in
their ``tp`` coordinate. Rank order follows the PTD-P rule (Narayanan et al. 2021): the
tensor-parallel dimension varies fastest, so its ranks are adjacent (on one host when a host
holds ``tp`` ranks or more), and the pipeline dimension varies slowest, so stages sit
furthest apart. The default order, innermost first, is ``tp, cp, ep, dp, pp``; other names
go between ``dp`` and ``pp`` in the order given; ``order=`` overrides it.

The arithmetic lives in :func:`layout`, a pure function testable without processes: with
16 ranks, ``tp=2, pp=4`` (and ``dp=-1``, inferred as 2) gives tensor groups [0,1], [2,3], ...,
pipeline groups [0,4,8,12], [1,5,9,13], ... and data groups [0,2], [1,3], [4,6], ...

A :class:`Mesh` holds no module-level state: two meshes live side by side in one process,
and every op takes the group it should use (``group=mesh.group("tp")``).
"""

from __future__ import annotations

import datetime
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch.distributed import distributed_c10d

from plait import runtime
from plait.comm import progress
from plait.comm.group import Group

# Innermost (fastest-varying) first: PTD-P's rule, tp adjacent and pp furthest apart.
DEFAULT_ORDER = ("tp", "cp", "ep", "dp", "pp")

# Numbers the meshes this process builds, only to give their groups distinct names
# (group names key the progress board and the flight recorder). Every rank builds meshes
# in the same order (construction is collective), so the numbers agree across ranks.
_mesh_ids = itertools.count()


@dataclass(frozen=True)
class Layout:
    """Which global rank sits at which coordinate of a mesh.

    ``names`` and ``sizes`` are listed outermost (slowest-varying) first; ``ranks[i]`` is
    the global rank at flat position ``i`` (row-major over ``sizes``).
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    ranks: tuple[int, ...]

    def size(self, name: str) -> int:
        return self.sizes[self._axis(name)]

    def _axis(self, name: str) -> int:
        if name not in self.names:
            raise KeyError(f"mesh has no dimension {name!r}; its dimensions are {list(self.names)}")
        return self.names.index(name)

    def _strides(self) -> list[int]:
        strides, s = [], 1
        for n in reversed(self.sizes):
            strides.append(s)
            s *= n
        return strides[::-1]

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of global ``rank`` along every dimension."""
        try:
            flat = self.ranks.index(rank)
        except ValueError:
            raise ValueError(
                f"rank {rank} is not in this mesh (ranks {list(self.ranks)})"
            ) from None
        return {
            n: (flat // st) % sz
            for n, st, sz in zip(self.names, self._strides(), self.sizes, strict=True)
        }

    def groups(self, *dims: str) -> list[list[int]]:
        """The groups along ``dims`` (ranks that differ only in those coordinates).

        Each group is listed in mesh order (the first of ``dims`` slowest); groups are
        ordered by the position of their first rank.
        """
        axes = [self._axis(d) for d in dims]
        if len(set(axes)) != len(axes):
            raise ValueError(f"dimensions {list(dims)} repeat a name")
        strides = self._strides()
        fixed = [a for a in range(len(self.names)) if a not in axes]
        out: list[list[int]] = []
        for base in _positions([self.sizes[a] for a in fixed], [strides[a] for a in fixed]):
            members = _positions([self.sizes[a] for a in axes], [strides[a] for a in axes])
            out.append([self.ranks[base + m] for m in members])
        return sorted(out, key=lambda g: self.ranks.index(g[0]))

    def group_of(self, rank: int, *dims: str) -> list[int]:
        """The group along ``dims`` that holds global ``rank``."""
        for g in self.groups(*dims):
            if rank in g:
                return g
        raise ValueError(f"rank {rank} is not in this mesh (ranks {list(self.ranks)})")

    def table(self) -> str:
        """One line per rank: its coordinates and the groups it belongs to."""
        lines = [
            "mesh " + " x ".join(f"{n}={s}" for n, s in zip(self.names, self.sizes, strict=True))
        ]
        for r in self.ranks:
            c = self.coords(r)
            where = " ".join(f"{n}={c[n]}" for n in self.names)
            groups = "  ".join(f"{n}:{self.group_of(r, n)}" for n in self.names)
            lines.append(f"rank {r:>3}  {where}  |  {groups}")
        return "\n".join(lines)


def _positions(sizes: Sequence[int], strides: Sequence[int]) -> list[int]:
    """Flat offsets of every index over ``sizes`` with ``strides`` (first axis slowest)."""
    out = [0]
    for size, stride in zip(sizes, strides, strict=True):
        out = [o + i * stride for o in out for i in range(size)]
    return out


def _ordered(dims: Mapping[str, int], order: Sequence[str] | None) -> list[str]:
    """Dimension names outermost first."""
    if order is not None:
        missing = set(dims) - set(order)
        extra = set(order) - set(dims)
        if missing or extra or len(set(order)) != len(order):
            raise ValueError(
                f"order {list(order)} must name each dimension {list(dims)} exactly once "
                f"(innermost first)"
            )
        return list(reversed(list(order)))
    known = [d for d in DEFAULT_ORDER if d in dims]
    other = [d for d in dims if d not in DEFAULT_ORDER]
    inner = [d for d in known if d != "pp"]
    outer = ["pp"] if "pp" in dims else []
    return outer + list(reversed(other)) + list(reversed(inner))  # outermost first


def layout(
    world_size: int,
    dims: Mapping[str, int],
    *,
    order: Sequence[str] | None = None,
    ranks: Sequence[int] | None = None,
) -> Layout:
    """The rank layout of a mesh of ``dims`` over ``world_size`` ranks (no processes).

    One size may be ``-1``: it is inferred from the others. The product of the sizes must
    equal ``world_size``; otherwise this raises ``ValueError`` naming the numbers.
    ``order`` lists the dimensions innermost (fastest-varying) first; ``ranks`` are the
    global ranks the mesh covers (default ``0 .. world_size-1``).
    """
    if not dims:
        raise ValueError("a mesh needs at least one dimension, e.g. Mesh(dp=2, tp=2)")
    for name, size in dims.items():
        if not isinstance(size, int) or (size < 1 and size != -1):
            raise ValueError(f"mesh dimension {name}={size!r}: sizes are positive integers (or -1)")
    free = [n for n, s in dims.items() if s == -1]
    sizes = dict(dims)
    known = math.prod(s for s in dims.values() if s != -1)
    if len(free) > 1:
        raise ValueError(f"only one mesh dimension may be -1 (inferred); got {free}")
    if free:
        if world_size % known:
            raise ValueError(
                f"cannot infer {free[0]}: {world_size} ranks are not a multiple of "
                f"{' x '.join(f'{n}={s}' for n, s in dims.items() if s != -1)} = {known}"
            )
        sizes[free[0]] = world_size // known
    total = math.prod(sizes.values())
    if total != world_size:
        text = " x ".join(f"{n}={s}" for n, s in sizes.items())
        raise ValueError(
            f"mesh {text} = {total} ranks, but the world has {world_size}; choose sizes whose "
            f"product is {world_size} (or set one of them to -1 to infer it)"
        )
    members = tuple(range(world_size)) if ranks is None else tuple(int(r) for r in ranks)
    if len(members) != world_size or len(set(members)) != world_size:
        raise ValueError(f"ranks {list(members)} must be {world_size} distinct ranks")
    names = _ordered(sizes, order)
    return Layout(tuple(names), tuple(sizes[n] for n in names), members)


def fingerprint(lay: Layout) -> str:
    """What every rank must agree on before a mesh creates its groups: dimension names
    and sizes (outermost first) and the ranks it covers, in order."""
    dims = ", ".join(f"{n}={v}" for n, v in zip(lay.names, lay.sizes, strict=True))
    return f"Mesh({dims}) over ranks {list(lay.ranks)}"


def agree_on_mesh(mine: str, timeout: float | None) -> None:
    """Compare this rank's mesh with every world rank's through the rendezvous store,
    before any group is created; raise ``ValueError`` on every rank naming each distinct
    mesh and the ranks that built it.

    Collective over the world: the k-th mesh (or flattened submesh) each rank builds is
    compared with the k-th of every other rank. One store round (a ``set`` and a ``wait``
    of ``world`` keys); it blocks at most ``timeout`` (default: the world's), then raises
    naming the ranks that built no mesh. Without it, ranks that disagree wait in process
    group creation until the collective timeout, and the store's error names no mesh.
    """

    w = runtime.world()
    if w.size == 1 or w.backend == "fake":  # fake: one process plays one rank, no store
        return
    store = distributed_c10d._get_default_store()
    # under torchrun the store outlives an attempt: a restart counts its meshes afresh
    base = f"{progress.attempt_namespace()}/plait/mesh"
    gen = (int(store.add(f"{base}/built", 1)) - 1) // w.size
    keys = [f"{base}/{gen}/{r}" for r in range(w.size)]
    store.set(keys[w.global_rank], mine)
    seconds = w.timeout if timeout is None else timeout
    try:
        store.wait(keys, datetime.timedelta(seconds=seconds))
    except Exception as exc:
        late = [r for r, k in enumerate(keys) if not store.check([k])]
        raise RuntimeError(
            f"rank {w.global_rank} built {mine} (mesh number {gen} of this job) and waited "
            f"{seconds:g}s for ranks {late} to build theirs: every rank of the world must "
            f"build the same meshes in the same order ({exc})"
        ) from exc
    built: dict[str, list[int]] = {}
    for r, k in enumerate(keys):
        built.setdefault(store.get(k).decode(), []).append(r)
    if len(built) > 1:
        text = "; ".join(f"ranks {rs} built {m}" for m, rs in built.items())
        raise ValueError(
            f"the ranks disagree on mesh number {gen} of this job ({text}); every rank of "
            f"the world must build the same mesh, in the same order (no group was created)"
        )


class Mesh:
    """The world (or ``ranks`` of it) as a grid of named dimensions with a group per line.

    Collective: every rank of the world must construct the same mesh, in the same order
    relative to other group creations (it creates the groups through
    :func:`plait.new_group`, once, here). Ranks outside ``ranks`` get ``None`` groups and
    may not query coordinates.

    ``mesh.group("tp")``, ``mesh.rank("pp")``, ``mesh.size("dp")``,
    ``mesh.submesh("dp", "tp")`` (collective too: it creates the flattened group),
    ``print(mesh)`` shows which global rank sits where.
    """

    def __init__(
        self,
        *,
        ranks: Sequence[int] | None = None,
        order: Sequence[str] | None = None,
        timeout: float | None = None,
        **dims: int,
    ) -> None:
        w = runtime.world()
        members = list(range(w.size)) if ranks is None else list(ranks)
        text = ", ".join(f"{n}={v}" for n, v in dims.items())
        asked = f"Mesh({text}, order={list(order) if order else None}, ranks={members})"
        try:
            self.layout = layout(len(members), dims, order=order, ranks=members)
        except ValueError as exc:
            agree_on_mesh(f"{asked}: refused ({exc})", timeout)
            raise
        self._print = fingerprint(self.layout)
        agree_on_mesh(self._print, timeout)
        self.global_rank = w.global_rank
        self._timeout = timeout
        self._id = next(_mesh_ids)
        self._groups: dict[tuple[str, ...], Group | None] = {}
        self._made: list[Group] = []  # this mesh's groups and its submeshes' flattened ones
        self._owner: Mesh = self  # whose _made a group created here joins
        self._destroyed = False
        for name in self.layout.names:
            self._groups[(name,)] = self._create((name,))

    # Told apart in the store's keys from another mesh over the same ranks (a mesh made
    # without the world's process group, plait.heal.store_mesh, names its incarnation).
    tag = ""

    def _agree(self, text: str) -> None:
        """Compare ``text`` with every rank's before creating groups (the world's store)."""
        agree_on_mesh(text, self._timeout)

    def _carried(self) -> dict[str, object]:
        """What a submesh inherits beyond the fields ``submesh`` sets (subclasses)."""
        return {}

    def _create(self, dims: tuple[str, ...]) -> Group | None:
        """Create the groups along ``dims``; collective over the world."""
        mine: Group | None = None
        label = "+".join(dims)
        for i, ranks in enumerate(self.layout.groups(*dims)):
            name = f"mesh{self._id}.{label}{i}{ranks}"
            g = runtime.new_group(ranks, name=name, timeout=self._timeout)
            if g is not None:
                mine = g
                self._owner._made.append(g)  # a submesh's: its root's
        return mine

    def destroy(self) -> None:
        """Destroy the groups this mesh created, its submeshes' flattened groups included
        (:func:`plait.destroy_group`: local, after this rank's collectives on them are
        done). The mesh and its submeshes are unusable afterwards; a submesh's own
        ``destroy`` leaves the groups to the mesh it came from. ``with plait.Mesh(...) as
        mesh:`` destroys them when the block ends."""
        made, self._made = self._made, []
        self._groups = {}
        self._destroyed = True
        first_error: BaseException | None = None
        for g in reversed(made):
            try:
                runtime.destroy_group(g)
            except BaseException as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    @property
    def names(self) -> tuple[str, ...]:
        """Dimension names, outermost first."""
        return self.layout.names

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self.layout.names, self.layout.sizes, strict=True))

    def size(self, dim: str | None = None) -> int:
        """Ranks along ``dim``, or in the whole mesh."""
        return len(self.layout.ranks) if dim is None else self.layout.size(dim)

    def rank(self, dim: str) -> int:
        """This rank's coordinate along ``dim``.

        Groups number their members in ascending global rank, so this equals
        ``group(dim).rank`` when global ranks ascend along ``dim`` (the default layout of a
        whole world); a mesh built with ``ranks=`` or ``order=`` may number them otherwise:
        use ``group(dim).rank`` (and the group's own numbering) for ``src``/``dst``."""
        return self.layout.coords(self.global_rank)[dim]

    def group(self, *dims: str) -> Group:
        """The group along ``dim`` that holds this rank (pass explicitly to collectives)."""
        key = tuple(dims)
        if self._destroyed:
            raise RuntimeError(f"{self!r} was destroyed (Mesh.destroy): build a new mesh")
        if key not in self._groups:
            raise KeyError(
                f"mesh has no group along {list(dims)}; single dimensions are {list(self.names)}"
                f" and flattened ones come from submesh(...)"
            )
        g = self._groups[key]
        if g is None:
            raise ValueError(f"rank {self.global_rank} is not in this mesh ({self.layout.ranks})")
        return g

    def submesh(self, *dims: str) -> Mesh:
        """The mesh along ``dims`` through this rank; it also holds the flattened group
        ``sub.group(*dims)``. Collective: every rank of the world must call it."""
        for d in dims:
            self.layout.size(d)  # raises naming the dimension
        order = [d for d in self.names if d in dims]
        flat = tuple(order)
        if len(flat) > 1:
            # the root mesh's fingerprint: a submesh's own layout differs across ranks
            self._agree(f"{self._print}.submesh{flat}")
        group = self._create(flat) if len(flat) > 1 else self._groups[flat]
        sub = object.__new__(type(self))
        sub.__dict__.update(self._carried())
        members = self.layout.group_of(self.global_rank, *order)
        sub.layout = Layout(flat, tuple(self.layout.size(d) for d in flat), tuple(members))
        sub.global_rank = self.global_rank
        sub._timeout = self._timeout
        sub._id = self._id
        sub._print = self._print
        sub._groups = {(d,): self._groups[(d,)] for d in flat}
        sub._groups[flat] = group
        sub._owner = self._owner  # destroys the flattened group
        sub._made = []
        sub._destroyed = False
        return sub

    def __repr__(self) -> str:
        return f"Mesh({', '.join(f'{n}={s}' for n, s in self.shape.items())})"

    def __str__(self) -> str:
        return self.layout.table()


__all__ = ["DEFAULT_ORDER", "Layout", "Mesh", "layout"]


def data_parallel_group(
    mesh: Mesh | Group | None, group: Group | None = None, *, who: str
) -> Group | None:
    """Where a data-parallel strategy runs, from ``mesh=`` (plait's one name for it) or
    ``group=`` (accepted as well): a :class:`~plait.comm.Group` as it is; a :class:`Mesh`'s
    ``dp`` dimension, or its only dimension of more than one rank. None when neither is
    given (the strategy then runs on the world). Both given is refused, and so is a mesh of
    several dimensions (naming them, and what to pass instead). Local: no communication.
    """
    if mesh is not None and group is not None and mesh is not group:
        raise TypeError(f"{who}: pass mesh= (a Mesh or a group) or group=, not both")
    where = mesh if mesh is not None else group
    if where is None or isinstance(where, Group):
        return where
    if not isinstance(where, Mesh):
        raise TypeError(
            f"{who}: mesh= must be a plait.Mesh or a plait.comm.Group, got {type(where).__name__}"
        )
    shape = where.shape
    wide = [n for n, size in shape.items() if size > 1]
    if set(wide) <= {"dp"} and "dp" in shape:
        return where.group("dp")
    if len(wide) == 1:
        return where.group(wide[0])
    raise ValueError(
        f"{who} runs on one group of ranks; the mesh has dimensions {shape}: pass "
        f"Mesh(dp=n) or mesh.group(name), or compose dimensions with strategy='ptdp'"
    )
