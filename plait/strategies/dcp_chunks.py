"""The mapping between plait's flat shards and the global offsets DCP stores.

``torch.distributed.checkpoint`` (DCP) stores every tensor of a state dict as rectangular
chunks of its global shape (offsets and sizes per dimension) and reshards on load by
intersecting the chunks a rank asks for with those on disk. plait's FSDP and ZeRO keep
*flat* element ranges instead: rank r of n holds elements ``[r*k, (r+1)*k)`` of a unit's
padded flat buffer, so of one parameter of shape ``(rows, cols)`` it holds a run of its
row-major elements that may start and end inside a row. Such a run is the union of at most
three rectangles per dimension level (:func:`flat_range_chunks`): the tail of a first row,
whole rows, the head of a last row.

:class:`ShardChunks` is a tensor of the one-process model's shape and dtype that holds only
this rank's rectangles, as views of the rank's own storage (a flat shard, an optimizer
state tensor). It implements DCP's checkpointable protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``), so DCP's own default planner saves
it (every rank writes its rectangles; ``.metadata`` holds the global shape and every
chunk) and loads into it (each rank reads only what overlaps its rectangles, writing into
the views, i.e. into the model's shards). Nothing else can compute with it: any torch
operation raises, naming what to use instead. Every layout's loader copies what
``dcp.load`` filled (or whole one-process tensors) back through :func:`copy_into` (into a
``ShardChunks``' views) and :func:`fill_flat` (into a flat range: FSDP's shards, ZeRO's
pieces). No communication here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Chunk:
    """One rectangle of a tensor of the one-process model: ``offsets`` and ``sizes`` per
    dimension; ``start``/``stop``: the same elements as a run of the row-major flattening
    (for a chunk of a flat range; 0 for the chunks of a split layer)."""

    offsets: Shape
    sizes: Shape
    start: int
    stop: int


def flat_range_chunks(shape: Sequence[int], start: int, stop: int) -> list[Chunk]:
    """The rectangles whose union is elements ``[start, stop)`` of the row-major
    flattening of a tensor of ``shape``, in flat order (each a contiguous run).

    >>> [(c.offsets, c.sizes) for c in flat_range_chunks((3, 4), 2, 11)]
    [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
    """
    shape = tuple(int(s) for s in shape)
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"flat_range_chunks: [{start}, {stop}) is not within {total} elements")
    out: list[Chunk] = []
    _split(shape, start, stop, (), (), 0, out)
    return out


def _split(
    shape: Shape, a: int, b: int, lead: Shape, ones: Shape, base: int, out: list[Chunk]
) -> None:
    """Append the rectangles of ``[a, b)`` of a tensor of ``shape`` found at index ``lead``
    of the outer dimensions (each of size 1 there, ``ones``); ``base``: the flat index of
    this sub-tensor's first element in the whole tensor."""
    if a >= b:
        return
    if len(shape) <= 1:
        sizes = (b - a,) if shape else ()
        offsets = (a,) if shape else ()
        out.append(Chunk(lead + offsets, ones + sizes, base + a, base + b))
        return
    inner = math.prod(shape[1:])
    rest = shape[1:]
    first, first_col = divmod(a, inner)
    last, last_col = divmod(b, inner)
    if first == last:  # within one row
        _split(rest, first_col, last_col, lead + (first,), ones + (1,), base + first * inner, out)
        return
    if first_col:  # the tail of the first row
        _split(rest, first_col, inner, lead + (first,), ones + (1,), base + first * inner, out)
        first += 1
    if last > first:  # whole rows
        out.append(
            Chunk(
                lead + (first,) + (0,) * len(rest),
                ones + (last - first,) + rest,
                base + first * inner,
                base + last * inner,
            )
        )
    if last_col:  # the head of the last row
        _split(rest, 0, last_col, lead + (last,), ones + (1,), base + last * inner, out)


class ShardChunks(torch.Tensor):
    """A tensor of the one-process model (``shape``, ``dtype``) of which this rank holds the
    rectangles ``chunks``, each with a local tensor (usually a view of the rank's shard).

    DCP saves and loads it through its checkpointable protocol (module docstring). Computing
    with it raises: it holds only pieces; gather the whole model with
    ``plait.checkpoint.full_state_dict(model)`` to compute with full tensors.
    """

    chunks: list[Chunk]
    pieces: list[torch.Tensor]

    @staticmethod
    def __new__(
        cls,
        shape: Sequence[int],
        chunks: list[Chunk],
        pieces: list[torch.Tensor],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> ShardChunks:
        self = torch.Tensor._make_wrapper_subclass(
            cls, tuple(int(s) for s in shape), dtype=dtype, device=device, requires_grad=False
        )
        return self  # type: ignore[no-any-return]

    def __init__(
        self,
        shape: Sequence[int],
        chunks: list[Chunk],
        pieces: list[torch.Tensor],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        for chunk, local in zip(chunks, pieces, strict=True):
            if tuple(local.shape) != chunk.sizes or local.dtype != dtype:
                raise ValueError(
                    f"ShardChunks: the local tensor of the chunk at {chunk.offsets} is "
                    f"{tuple(local.shape)} {local.dtype}, the chunk {chunk.sizes} {dtype}"
                )
        self.chunks = list(chunks)
        self.pieces = list(pieces)

    # --- DCP's checkpointable protocol (torch/distributed/_checkpointable.py) -------------
    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(chunk.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(
                        offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes)
                    ),
                    properties=TensorProperties.create_from_tensor(local),
                    size=self.size(),
                ),
            )
            for chunk, local in zip(self.chunks, self.pieces, strict=True)
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
            for c in self.chunks
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        hint = index.index
        if hint is not None and hint < len(self.chunks):
            if torch.Size(self.chunks[hint].offsets) == index.offset:
                return self.pieces[hint]
        for chunk, local in zip(self.chunks, self.pieces, strict=True):
            if torch.Size(chunk.offsets) == index.offset:
                return local
        raise ValueError(
            f"ShardChunks: {index.fqn!r} has no chunk at offsets {tuple(index.offset or ())} "
            f"on this rank (its chunks: {[c.offsets for c in self.chunks][:6]})"
        )

    # --- what it is not ---------------------------------------------------------------------
    def chunk_at(self, offsets: Sequence[int]) -> torch.Tensor | None:
        """The local tensor of the chunk at ``offsets``, or None."""
        for chunk, local in zip(self.chunks, self.pieces, strict=True):
            if chunk.offsets == tuple(offsets):
                return local
        return None

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return (
            f"ShardChunks(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"{len(self.chunks)} chunk(s) on this rank: "
            f"{[(c.offsets, c.sizes) for c in self.chunks][:4]})"
        )

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        raise RuntimeError(
            f"ShardChunks holds only this rank's pieces of a tensor, for "
            f"torch.distributed.checkpoint to save and load; {func} cannot run on it. Load "
            f"it into the model (model.load_state_dict(state) or "
            f"plait.checkpoint.dcp.set_model_state_dict), or gather the whole model with "
            f"plait.checkpoint.full_state_dict(model)"
        )


def shard_chunks(shape: Sequence[int], start: int, stop: int, flat: torch.Tensor) -> ShardChunks:
    """A :class:`ShardChunks` of elements ``[start, stop)`` of a tensor of ``shape``,
    whose values are ``flat`` (``stop - start`` elements; the local tensors are views)."""
    if flat.numel() != stop - start:
        raise ValueError(
            f"shard_chunks: {flat.numel()} local elements for the range [{start}, {stop})"
        )
    chunks = flat_range_chunks(shape, start, stop)
    flat = flat.reshape(-1)
    pieces = [flat[c.start - start : c.stop - start].view(c.sizes) for c in chunks]
    return ShardChunks(shape, chunks, pieces, dtype=flat.dtype, device=flat.device)


# --- copying loaded values into a rank's own tensors (shared by every layout's loader) -----
_DISTRIBUTED = ("DTensor", "ShardedTensor")


def _rectangle(chunk: Chunk) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))


def chunk_source(got: Any, chunk: Chunk, key: str, theirs: ShardChunks | None = None) -> Any:
    """The values of ``chunk`` in ``got``: the local tensor of ``got``'s chunk at the same
    offsets (``got`` a :class:`ShardChunks` that ``dcp.load`` filled), or that rectangle of
    ``got`` (a whole tensor of the one-process shape). Raises naming ``key`` when ``got``
    holds other chunks (made by another layout or world size) or is a DTensor."""
    if isinstance(got, ShardChunks):
        source = got.chunk_at(chunk.offsets)
        if source is None or tuple(source.shape) != chunk.sizes:
            mine = [c.offsets for c in theirs.chunks][:4] if theirs is not None else [chunk]
            raise ValueError(
                f"plait DCP load: {key!r} holds chunks at {[c.offsets for c in got.chunks][:4]} "
                f"on this rank, this model's are at {mine}: it was made by another layout or "
                f"world size. dcp.load into this model's own state dict "
                f"(plait.checkpoint.dcp.get_model_state_dict / get_optimizer_state_dict), "
                f"which reshards"
            )
        return source
    if isinstance(got, torch.Tensor) and type(got).__name__ not in _DISTRIBUTED:
        return got.detach()[_rectangle(chunk)]
    raise TypeError(
        f"plait DCP load: {key!r} is a {type(got).__name__}; pass this model's state dict "
        f"filled by dcp.load, or whole tensors"
    )


def copy_into(want: ShardChunks, got: Any, key: str) -> None:
    """Copy ``got`` (a :class:`ShardChunks` with ``want``'s chunks, or the whole tensor)
    into ``want``'s local views (skipping a view ``dcp.load`` already wrote into)."""
    for chunk, piece in zip(want.chunks, want.pieces, strict=True):
        source = chunk_source(got, chunk, key, want)
        if source.data_ptr() != piece.data_ptr():
            piece.copy_(source)


def fill_flat(
    dest: torch.Tensor, shape: Sequence[int], start: int, stop: int, got: Any, key: str
) -> None:
    """Write elements ``[start, stop)`` of the row-major flattening of a tensor of
    ``shape`` into ``dest`` (``stop - start`` elements), taken from ``got``: chunks that
    ``dcp.load`` filled (those of :func:`flat_range_chunks`) or the whole tensor."""
    if start == stop:
        return
    if isinstance(got, ShardChunks):
        for chunk in flat_range_chunks(shape, start, stop):
            piece = chunk_source(got, chunk, key)
            dest[chunk.start - start : chunk.stop - start] = piece.reshape(-1)
    else:
        dest.copy_(got.detach().reshape(-1)[start:stop])
