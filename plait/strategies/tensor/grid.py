"""The processor grids of 2D, 2.5D and 3D tensor parallelism, read from a :class:`plait.Mesh`.

A grid names the mesh dimensions it runs on (no global rank arithmetic): ``"row"`` and
``"col"`` for 2D (``q x q``), plus ``"depth"`` for 2.5D (``d x q x q``) and 3D
(``q x q x q``). This rank's *coordinate* along a dimension is its place in the mesh, and an
:class:`Axis` is the group of ranks that differ only in that coordinate, together with the
map from coordinate to rank inside the group. The two differ whenever the mesh is built
with another ``order=`` or a permuted ``ranks=``: :func:`plait.new_group` numbers a group's
members by global rank, the mesh by position. Every broadcast root, reduce destination and
gathered block below is looked up through that map, which is what makes the operations
correct through any rank order (Colossal-AI computes roots from a hard-coded global layout
and breaks under any other).

Which group is which, for 2D (rank ``(i, j)`` = row ``i``, column ``j``):

- ``grid.row``: the ranks of my grid row, ``(i, 0) .. (i, q-1)`` = ``mesh.group("col")``
  (they differ in their column coordinate);
- ``grid.col``: the ranks of my grid column, ``(0, j) .. (q-1, j)`` = ``mesh.group("row")``;
- ``grid.depth``: the ranks that differ only in depth (2.5D and 3D).

:func:`grid_shape` checks a world size up front and names the nearest valid sizes;
:func:`grid_mesh` builds the mesh (the grid's dimensions innermost, then any others).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from plait import comm
from plait.comm.group import Group
from plait.mesh import DEFAULT_ORDER, Mesh

MODES = ("2d", "2.5d", "3d")


@dataclass(frozen=True)
class Axis:
    """One line of the grid through this rank.

    ``group`` is the communication group; ``coord`` this rank's coordinate along the line;
    ``members[k]`` the rank inside ``group`` of the member at coordinate ``k``.
    """

    name: str
    group: Group
    coord: int
    members: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.group.size

    def root(self, k: int) -> int:
        """The group rank of the member at coordinate ``k`` (a broadcast root)."""
        return self.members[k]


@dataclass(frozen=True)
class Grid:
    """The 2D / 2.5D / 3D grid through this rank (see the module doc).

    ``q`` is the side of the square (cube) of tensor-parallel ranks, ``d`` the depth
    (2.5D: number of batch layers; 3D: ``q``; 2D: 1). ``row``, ``col``, ``depth`` are
    :class:`Axis` objects; ``depth`` is ``None`` in 2D.
    """

    mode: str
    q: int
    d: int
    row: Axis
    col: Axis
    depth: Axis | None

    @property
    def i(self) -> int:
        """My row coordinate."""
        return self.col.coord

    @property
    def j(self) -> int:
        """My column coordinate."""
        return self.row.coord

    @property
    def k(self) -> int:
        """My depth coordinate (0 in 2D)."""
        return 0 if self.depth is None else self.depth.coord

    @property
    def size(self) -> int:
        return self.q * self.q * self.d


def _nearest(valid: list[int], size: int) -> list[int]:
    below = [v for v in valid if v < size]
    above = [v for v in valid if v > size]
    return ([below[-1]] if below else []) + ([above[0]] if above else [])


def grid_shape(mode: str, size: int, *, depth: int | None = None) -> dict[str, int]:
    """The mesh dimensions of a ``mode`` grid over ``size`` tensor-parallel ranks.

    2D needs a perfect square ``q * q``; 2.5D ``depth * q * q`` (``depth`` given); 3D a
    perfect cube ``q**3``. Anything else raises ``ValueError`` naming the nearest valid
    sizes (pure function; no processes).
    """
    if mode not in MODES:
        raise ValueError(f"tensor-parallel mode {mode!r}: use one of {list(MODES)}")
    if size < 1:
        raise ValueError(f"{mode}: tensor-parallel size {size} must be positive")
    if mode == "2d":
        q = math.isqrt(size)
        if q * q != size:
            near = _nearest([n * n for n in range(1, q + 3)], size)
            raise ValueError(
                f"2d tensor parallelism needs a square number of ranks (q x q); {size} is "
                f"not one: use {' or '.join(map(str, near))} ranks, or 1D tensor parallelism"
            )
        return {"row": q, "col": q}
    if mode == "3d":
        q = round(size ** (1 / 3))
        if q**3 != size:
            near = _nearest([n**3 for n in range(1, q + 3)], size)
            raise ValueError(
                f"3d tensor parallelism needs a cube number of ranks (q x q x q); {size} is "
                f"not one: use {' or '.join(map(str, near))} ranks, or mode '2d' / '2.5d' / 1D"
            )
        return {"depth": q, "row": q, "col": q}
    if depth is None or depth < 1:
        raise ValueError(f"2.5d tensor parallelism needs depth= (a positive integer), got {depth}")
    if size % depth:
        raise ValueError(
            f"2.5d: {size} ranks are not a multiple of depth {depth}; use depth x q x q ranks"
        )
    q = math.isqrt(size // depth)
    if q * q * depth != size:
        near = _nearest([depth * n * n for n in range(1, q + 3)], size)
        raise ValueError(
            f"2.5d tensor parallelism needs depth x q x q ranks; {size} / depth {depth} = "
            f"{size // depth} is not a square: use {' or '.join(map(str, near))} ranks"
        )
    return {"depth": depth, "row": q, "col": q}


def grid_mesh(
    mode: str, size: int, *, depth: int | None = None, timeout: float | None = None, **others: int
) -> Any:
    """A :class:`plait.Mesh` with the grid of ``mode`` over ``size`` ranks and the other
    dimensions ``others`` (e.g. ``dp=2``). The grid's dimensions vary fastest (``col``, then
    ``row``, then ``depth``) so a grid row sits on adjacent ranks. Collective (builds groups).
    """

    dims = grid_shape(mode, size, depth=depth)
    clash = set(dims) & set(others)
    if clash:
        raise ValueError(f"grid_mesh: dimensions {sorted(clash)} belong to the {mode} grid")
    inner = [d for d in ("col", "row", "depth") if d in dims]
    rest = [d for d in DEFAULT_ORDER if d in others] + [d for d in others if d not in DEFAULT_ORDER]
    sizes: dict[str, Any] = {**dims, **others}
    return Mesh(order=inner + rest, timeout=timeout, **sizes)


def _axis(mesh: Any, dim: str, label: str) -> Axis:
    group = mesh.group(dim)
    line = mesh.layout.group_of(mesh.global_rank, dim)  # global ranks in coordinate order
    members = tuple(group.ranks.index(r) for r in line)
    return Axis(label, group, mesh.rank(dim), members)


def grid_from_mesh(mesh: Any, mode: str) -> Grid:
    """The grid of ``mode`` through this rank of ``mesh`` (which needs the dimensions
    ``row`` and ``col``, and ``depth`` for 2.5D and 3D, sized as :func:`grid_shape` says)."""
    if mode not in MODES:
        raise ValueError(f"tensor-parallel mode {mode!r}: use one of {list(MODES)}")
    if isinstance(mesh, Grid):
        if mesh.mode != mode:
            raise ValueError(f"grid is {mesh.mode!r}, not {mode!r}")
        return mesh
    names = set(getattr(mesh, "names", ()))
    need = {"row", "col"} | ({"depth"} if mode != "2d" else set())
    if not need <= names:
        raise ValueError(
            f"{mode} tensor parallelism runs on a mesh with dimensions {sorted(need)}, got "
            f"{sorted(names)}; build it with plait.strategies.tensor.grid_mesh({mode!r}, n) "
            f"or plait.Mesh(**grid_shape({mode!r}, n))"
        )
    q, q2 = mesh.size("row"), mesh.size("col")
    d = mesh.size("depth") if mode != "2d" else 1
    if q != q2 or (mode == "3d" and d != q):
        shape = {n: mesh.size(n) for n in sorted(need)}
        raise ValueError(
            f"{mode} tensor parallelism needs row == col{' == depth' if mode == '3d' else ''}; "
            f"the mesh has {shape}"
        )
    # 2D: grid.row is my grid row, the ranks that differ in their column coordinate
    row = _axis(mesh, "col", "row")
    col = _axis(mesh, "row", "col")
    depth = _axis(mesh, "depth", "depth") if mode != "2d" else None
    return Grid(mode, q, d, row, col, depth)


# --- axis-aware collectives: blocks in coordinate order, whatever the group's numbering ---
def gather_blocks(x: torch.Tensor, dim: int, axis: Axis, algorithm: str) -> torch.Tensor:
    """Concatenate the members' ``x`` along ``dim`` in coordinate order. Collective on
    ``axis.group``: one all-gather (each rank sends ``(n-1)/n`` of the result on the ring)."""
    if axis.size == 1:
        return x
    out = torch.empty((axis.size, *x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x.contiguous(), group=axis.group, algorithm=algorithm)
    out = out[list(axis.members)]  # group-rank order -> coordinate order
    dim = dim % x.dim()
    shape = list(x.shape)
    shape[dim] *= axis.size
    return out.movedim(0, dim).reshape(shape)


def reduce_scatter_blocks(x: torch.Tensor, dim: int, axis: Axis, algorithm: str) -> torch.Tensor:
    """Sum ``x`` over the axis and keep block ``axis.coord`` of ``dim``. Collective on
    ``axis.group``: one reduce-scatter (``(n-1)/n`` of ``x`` sent per rank on the ring)."""
    if axis.size == 1:
        return x
    dim = dim % x.dim()
    n = x.shape[dim]
    if n % axis.size:
        raise ValueError(
            f"reduce-scatter over {axis.name} group {axis.group.name!r}: dimension {dim} of "
            f"shape {tuple(x.shape)} is not a multiple of {axis.size}"
        )
    blocks = x.unflatten(dim, (axis.size, n // axis.size)).movedim(dim, 0)
    by_rank = torch.empty_like(blocks)
    by_rank[list(axis.members)] = blocks  # coordinate order -> group-rank order
    shape = list(x.shape)
    shape[dim] = n // axis.size
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, by_rank, group=axis.group, algorithm=algorithm)
    return out


def all_reduce(x: torch.Tensor, axis: Axis, algorithm: str) -> torch.Tensor:
    """``x`` summed over the axis (a new tensor). Collective: one all-reduce."""
    out = x.contiguous().clone()
    if axis.size > 1:
        comm.all_reduce(out, group=axis.group, algorithm=algorithm)
    return out


def block(x: torch.Tensor, dim: int, index: int, parts: int, what: str) -> torch.Tensor:
    """Block ``index`` of ``parts`` equal blocks of ``x`` along ``dim`` (no communication);
    ``ValueError`` naming ``what`` if ``parts`` does not divide it."""
    n = x.shape[dim]
    if n % parts:
        raise ValueError(
            f"{what}: dimension {dim} of shape {tuple(x.shape)} has {n} entries, not a "
            f"multiple of {parts}; choose sizes it divides"
        )
    size = n // parts
    return x.narrow(dim, index * size, size)


def padded(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


__all__: Sequence[str] = [
    "MODES",
    "Axis",
    "Grid",
    "all_reduce",
    "block",
    "gather_blocks",
    "grid_from_mesh",
    "grid_mesh",
    "grid_shape",
    "padded",
    "reduce_scatter_blocks",
]
