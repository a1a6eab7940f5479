"""DCP state of a :class:`~plait.strategies.zero.ZeroOptimizer` (ZeRO-1/2): its partition as
chunks.

ZeRO lays the trainable parameters end to end in one flat space and gives rank r a
contiguous range of it, cut at parameter boundaries into pieces (``Piece(param, start,
stop)``: elements ``[start, stop)`` of that parameter's flattening) and at param-group
boundaries into one local flat tensor per group (``opt.shards[g]``, whose state the local
optimizer keeps). A piece of parameter i in group g sits in ``opt.shards[g]`` at
``offsets[i] + start - lo - local[g][0]`` (``lo``: the rank's first flat element,
``local[g][0]``: where group g starts in the rank's range). :func:`optimizer_state` gives
each parameter's element-wise state as :class:`~plait.strategies.dcp_chunks.ShardChunks`
of its piece (views of the local state), scalars (``step``) as they are; the model itself
is replicated under ZeRO-1/2 and saved whole. Under PTD-P (or cp) with tensor parallelism
a piece is of a local tp slice: it is cut again by each block of the slice
(:func:`_rectangles`). ``roots``: the modules holding this rank's
parameters under the model's own names (the model; a pipeline's or PTD-P layout's stages,
whose ZeroOptimizer partitions their parameters over the dp group). No communication.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.checkpoint.dcp_tensor import named_tensors, split_chunks
from plait.strategies.dcp_chunks import Chunk, ShardChunks, chunk_source, flat_range_chunks
from plait.strategies.zero import ZeroOptimizer

PARAMS = "params"


def _names(roots: list[nn.Module], opt: ZeroOptimizer, who: str) -> dict[int, str]:
    return {i: key for i, (key, _, _) in _where(roots, opt, who).items()}


def _where(
    roots: list[nn.Module], opt: ZeroOptimizer, who: str
) -> dict[int, tuple[str, nn.Module, str]]:
    """``id(parameter) -> (key, module, attribute)`` of every parameter the optimizer
    holds (refusing one that is not the model's)."""
    names: dict[int, tuple[str, nn.Module, str]] = {}
    for key, m, name, t in named_tensors(roots):
        if isinstance(t, nn.Parameter):
            names.setdefault(id(t), (key, m, name))
    for g, group in enumerate(opt.param_groups):
        for p in group[PARAMS]:
            if id(p) not in names:
                raise ValueError(
                    f"plait.checkpoint.dcp.{who}: param group {g} of the ZeroOptimizer holds "
                    f"a tensor of shape {tuple(p.shape)} that is not a parameter of this "
                    f"rank's model; build the optimizer on the model's parameters()"
                )
    return names


def group_fqns(roots: list[nn.Module], opt: ZeroOptimizer, who: str) -> list[list[str]]:
    """The FQNs of each param group (frozen parameters included), in the group's order."""
    names = _names(roots, opt, who)
    return [[names[id(p)] for p in group[PARAMS]] for group in opt.param_groups]


def _pieces(opt: ZeroOptimizer) -> list[tuple[int, int, int, int, int]]:
    """Of every trainable parameter i: ``(i, group, start, stop, at)``: this rank's
    elements ``[start, stop)`` of it (``start == stop``: none) at ``at`` in its group's
    local flat tensor."""
    starts = opt._layout.group_starts
    mine = {p.param: p for p in opt.partition[opt.group.rank]}
    out = []
    for g in range(len(starts) - 1):
        for i in range(starts[g], starts[g + 1]):
            piece = mine.get(i)
            if piece is None:
                out.append((i, g, 0, 0, 0))
            else:
                at = opt._offsets[i] + piece.start - opt.lo - opt._local[g][0]
                out.append((i, g, piece.start, piece.stop, at))
    return out


#: (global offsets, sizes, positions in the piece of each element, row-major)
Rect = tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]


def _rectangles(
    m: nn.Module, name: str, p: torch.Tensor, start: int, stop: int, key: str
) -> tuple[tuple[int, ...], list[Rect]]:
    """The one-process shape of parameter ``key`` and this rank's ZeRO piece of it
    (elements ``[start, stop)`` of the flattening of ``p``, the local tensor: a tensor-
    parallel slice under PTD-P) as rectangles of that shape. Each block of a split layer
    (``dcp_tensor.split_chunks``) holds local elements in increasing flat order, so the
    piece's elements of a block are a run of the block's own flattening: at most three
    rectangles per dimension level (``flat_range_chunks``). A block stored transposed
    (GPT-2's ``Conv1D``) is refused by name."""
    numbers = torch.arange(p.numel()).view(p.shape)
    split = split_chunks(m, name, numbers)
    if split is None:
        shape = tuple(p.shape)
        runs = flat_range_chunks(shape, start, stop)
        return shape, [(c.offsets, c.sizes, torch.arange(c.start, c.stop) - start) for c in runs]
    out: list[Rect] = []
    for block, local in zip(split.chunks, split.pieces, strict=True):
        order = local.reshape(-1)
        if order.numel() > 1 and not bool((order[1:] > order[:-1]).all()):
            raise NotImplementedError(
                f"plait.checkpoint.dcp: {key!r} is stored transposed ({type(m).__name__}); "
                f"its ZeRO-1/2 optimizer pieces have no DCP mapping yet. Use zero=0, or "
                f"plait.checkpoint.save (it reshards across every layout)"
            )
        a, b = int((order < start).sum()), int((order < stop).sum())
        for c in flat_range_chunks(block.sizes, a, b):
            offsets = tuple(o + q for o, q in zip(block.offsets, c.offsets, strict=True))
            out.append((offsets, c.sizes, order[c.start : c.stop] - start))
    return tuple(split.shape), out


def _take(flat: torch.Tensor, positions: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """``flat[positions]`` shaped ``sizes``: a view when the positions are one run."""
    if positions.numel() == 0:
        return flat[:0].view(sizes)
    first = int(positions[0])
    if int(positions[-1]) - first + 1 == positions.numel():
        return flat[first : first + positions.numel()].view(sizes)
    return flat[positions].view(sizes)


def _is_elementwise(key: str, value: Any, shard: torch.Tensor) -> bool:
    return key != "step" and isinstance(value, torch.Tensor) and value.shape == shard.shape


def optimizer_state(roots: list[nn.Module], opt: ZeroOptimizer) -> dict[str, dict[str, Any]]:
    """``{fqn: {key: value}}`` of every trainable parameter whose group's local state
    exists on this rank (element-wise values cut to its piece, views)."""
    opt._sync_hyperparameters()
    where = _where(roots, opt, "get_optimizer_state_dict")
    state: dict[str, dict[str, Any]] = {}
    for i, g, start, stop, at in _pieces(opt):
        shard = opt.shards[g]
        local = opt.optim.state.get(shard)
        if not local:
            continue
        p = opt._params[i]
        fqn, m, name = where[id(p)]
        shape, rects = _rectangles(m, name, p, start, stop, fqn)
        chunks = [Chunk(o, s, 0, 0) for o, s, _ in rects]
        entry = {}
        for key, value in local.items():
            if _is_elementwise(key, value, shard):
                flat = value.detach().reshape(-1)[at : at + stop - start]
                pieces = [_take(flat, pos, s) for _, s, pos in rects]
                entry[key] = ShardChunks(
                    shape, chunks, pieces, dtype=flat.dtype, device=flat.device
                )
            else:
                entry[key] = value
        state[fqn] = entry
    return state


def load_optimizer_state(
    roots: list[nn.Module],
    opt: ZeroOptimizer,
    saved: dict[str, dict[str, Any]],
    hypers: list[dict[str, Any]],
) -> None:
    """Each group's local state: per element-wise key a flat tensor assembled from its
    parameters' pieces (chunks or whole tensors), scalars from its first parameter with
    state; each group's hyper-parameters from ``hypers``. Then the master shard is re-read
    from the (loaded) parameters."""
    where = _where(roots, opt, "set_optimizer_state_dict")
    local_state: dict[int, dict[str, Any]] = {}
    for i, g, start, stop, at in _pieces(opt):
        p = opt._params[i]
        fqn, m, name = where[id(p)]
        shape, rects = _rectangles(m, name, p, start, stop, fqn)
        shard = opt.shards[g]
        entry = local_state.setdefault(g, {})
        for key, value in saved.get(fqn, {}).items():
            if key != "step" and (
                isinstance(value, ShardChunks)
                or (isinstance(value, torch.Tensor) and tuple(value.shape) == shape)
            ):
                flat = entry.get(key)
                if not isinstance(flat, torch.Tensor) or flat.shape != shard.shape:
                    flat = torch.zeros(shard.shape, dtype=shard.dtype, device=shard.device)
                    entry[key] = flat
                piece = flat[at : at + stop - start]
                for offsets, sizes, pos in rects:
                    source = chunk_source(value, Chunk(offsets, sizes, 0, 0), f"{fqn} {key}")
                    piece[pos] = source.reshape(-1).to(piece.dtype)
            elif key not in entry:
                entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
    local_groups = []
    for g, hyper in enumerate(hypers):
        hyper = {k: v for k, v in hyper.items() if k != "param_names"}
        opt.param_groups[g].update(hyper)
        local_groups.append({**hyper, PARAMS: [g]})
    state = {g: entry for g, entry in local_state.items() if entry}
    opt.optim.load_state_dict({"state": state, "param_groups": local_groups})
    opt._refresh_shard()
