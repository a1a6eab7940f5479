"""Which tokens a context-parallel rank holds, and how much attention work each does.

The global sequence of ``S`` tokens is cut into ``2c`` chunks of ``S / 2c`` tokens (``c``
is the cp size). Context-parallel rank ``r`` holds two of them, side by side:

- ``balanced=True`` (the load balancer of torchtitan / Megatron-CP): chunks ``r`` and
  ``2c-1-r``. Under a causal mask a query chunk ``i`` attends to key chunks ``0 .. i``, so
  every rank has ``(r+1) + (2c-r) = 2c+1`` chunk pairs to compute: the same work;
- ``balanced=False`` (contiguous): chunks ``2r`` and ``2r+1``, the plain split: rank ``r``
  has ``4r+3`` chunk pairs, from 3 on rank 0 to ``4c-1`` on the last rank.

Everything here is local arithmetic (no communication).
"""

from __future__ import annotations

from typing import Any

import torch

from plait.comm.group import Group

WHO = "context parallelism"


def chunks_of(rank: int, cp: int, *, balanced: bool) -> tuple[int, int]:
    """The two global chunk indices (of ``2 * cp``) that cp rank ``rank`` holds, in order."""
    return (rank, 2 * cp - 1 - rank) if balanced else (2 * rank, 2 * rank + 1)


def check_length(seq: int, cp: int, *, what: str = "sequence") -> None:
    """Refuse a global length the ``2 * cp`` chunks cannot split evenly, naming it."""
    if seq % (2 * cp):
        raise ValueError(
            f"{WHO}: the {what} of {seq} tokens is not divisible by 2 * cp = {2 * cp} (each "
            f"of the cp={cp} ranks holds two equal chunks); pad or cut it to a multiple of "
            f"{2 * cp}"
        )


def positions(seq: int, cp: int, rank: int, *, balanced: bool) -> torch.Tensor:
    """Global position ids (int64, ``[S / cp]``) of the tokens cp rank ``rank`` holds."""
    check_length(seq, cp)
    n = seq // (2 * cp)
    return torch.cat(
        [torch.arange(i * n, (i + 1) * n) for i in chunks_of(rank, cp, balanced=balanced)]
    )


def cp_group(mesh: Any) -> Group:
    """The cp group of a :class:`~plait.Mesh` (its ``cp`` dimension), or a group as it is."""
    if isinstance(mesh, Group):
        return mesh
    names = getattr(mesh, "names", None)
    if names is None or "cp" not in names:
        raise ValueError(f"{WHO}: {mesh!r} has no 'cp' dimension; pass Mesh(cp=c, ...)")
    group: Group = mesh.group("cp")
    return group


def shard_sequence(
    x: torch.Tensor, mesh: Any, *, balanced: bool = True, dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens of ``x`` (the whole sequence along ``dim``) and their position ids.

    Returns ``(x_local, position_ids)``: ``x_local`` holds chunks :func:`chunks_of` along
    ``dim`` (``S / cp`` tokens), ``position_ids`` is ``[1, S / cp]`` (int64; pass it to a
    model that takes ``position_ids``, e.g. Hugging Face's). Local: every rank slices the same
    global ``x``. A length ``2 * cp`` does not divide is refused, naming both.
    """
    group = cp_group(mesh)
    cp, rank = group.size, group.rank
    seq = x.shape[dim]
    check_length(seq, cp)
    n = seq // (2 * cp)
    parts = [x.narrow(dim, i * n, n) for i in chunks_of(rank, cp, balanced=balanced)]
    return torch.cat(parts, dim=dim), positions(seq, cp, rank, balanced=balanced).unsqueeze(0)


def pair_kinds(
    rank: int, source: int, cp: int, *, causal: bool, balanced: bool
) -> list[tuple[int, int, str]]:
    """The chunk pairs cp rank ``rank`` computes with the keys of rank ``source``.

    Each entry is ``(local query chunk 0|1, source key chunk 0|1, kind)`` with ``kind``
    ``"full"`` (every query sees every key) or ``"diagonal"`` (the same chunk: causal mask
    inside it). Without a causal mask it is one ``"full"`` entry per chunk pair.
    """
    out = []
    qs, ks = chunks_of(rank, cp, balanced=balanced), chunks_of(source, cp, balanced=balanced)
    for a, qc in enumerate(qs):
        for j, kc in enumerate(ks):
            if not causal or kc < qc:
                out.append((a, j, "full"))
            elif kc == qc:
                out.append((a, j, "diagonal"))
    return out


def ring_work(cp: int, *, causal: bool, balanced: bool) -> list[list[int]]:
    """Chunk pairs computed by each cp rank (rows) at each ring step (columns).

    At step ``j`` rank ``r`` holds the keys of rank ``(r - j) mod cp``. A row's sum is the
    rank's work; ``sum over steps of the max over ranks`` is the ring's critical path (each
    step waits for the slowest rank's transfer). Local.
    """
    return [
        [len(pair_kinds(r, (r - j) % cp, cp, causal=causal, balanced=balanced)) for j in range(cp)]
        for r in range(cp)
    ]


def imbalance(work: list[list[int]]) -> dict[str, float]:
    """Per-rank totals of :func:`ring_work`, ``max / mean`` of them, and the critical path
    (the sum over steps of the slowest rank's pairs) over the ideal (mean total)."""
    totals = [sum(row) for row in work]
    mean = sum(totals) / len(totals)
    critical = sum(max(col) for col in zip(*work, strict=True))
    return {
        "min": float(min(totals)),
        "max": float(max(totals)),
        "max_over_mean": max(totals) / mean,
        "critical_over_mean": critical / mean,
    }
