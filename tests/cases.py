"""Collective test cases: inputs every rank can regenerate, and the local reference.

A case is plain data. ``inputs(case, rank, world)`` builds rank ``rank``'s arguments from
the case's seed, so the parent process can rebuild every rank's inputs and compute the
expected result in float64 without any communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait import comm

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
}
REDUCING = ("all_reduce", "reduce", "reduce_scatter")


@dataclass(frozen=True)
class Case:
    collective: str
    algorithm: str
    dtype: str
    numel: int  # tensor size; per-rank block size for reduce_scatter/all_gather/all_to_all
    op: str = "sum"
    root: int = 0
    seed: int = 0
    uneven: bool = False  # list arguments with a different block size per rank


def block_sizes(case: Case, world: int) -> list[int]:
    if case.uneven:
        return [(case.numel + 3 * r) % (case.numel + 5) for r in range(world)]
    return [case.numel] * world


def _values(case: Case, rank: int, numel: int, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(case.seed * 1000003 + rank * 7919 + salt)
    dtype = DTYPES[case.dtype]
    if dtype.is_floating_point:
        if case.op == "prod":
            x = torch.rand(numel, generator=g, dtype=torch.float64) + 0.5
        else:
            x = torch.randn(numel, generator=g, dtype=torch.float64)
        return x.to(dtype)
    if case.op == "prod":
        choices = torch.tensor([-2, -1, 1, 2], dtype=dtype)
        return choices[torch.randint(0, 4, (numel,), generator=g)]
    return torch.randint(-50, 50, (numel,), generator=g, dtype=dtype)


def inputs(case: Case, rank: int, world: int) -> list[torch.Tensor]:
    """Rank ``rank``'s input: one tensor, or one per destination rank (all_to_all, and
    reduce_scatter with uneven blocks)."""
    sizes = block_sizes(case, world)
    if case.collective in ("all_reduce", "broadcast", "reduce"):
        return [_values(case, rank, case.numel)]
    if case.collective == "reduce_scatter":
        return [_values(case, rank, s, salt=i) for i, s in enumerate(sizes)]
    if case.collective == "all_gather":
        return [_values(case, rank, sizes[rank])]
    if case.collective == "all_to_all":  # block i goes to rank i; its size is what i expects
        return [_values(case, rank, _a2a_size(case, rank, i), salt=i) for i in range(world)]
    raise AssertionError(case.collective)


def _a2a_size(case: Case, src: int, dst: int) -> int:
    return (case.numel + src + 2 * dst) % (case.numel + 3) if case.uneven else case.numel


def run(case: Case) -> list[torch.Tensor]:
    """Run one case on this rank; return what it ends with."""
    g = comm.world()
    n, r = g.size, g.rank
    mine = inputs(case, r, n)
    kw = {"group": g, "algorithm": case.algorithm}
    if case.collective == "all_reduce":
        t = mine[0].clone()
        comm.all_reduce(t, case.op, **kw)
        return [t]
    if case.collective == "broadcast":
        t = mine[0].clone() if r == case.root else torch.zeros_like(mine[0])
        comm.broadcast(t, case.root, **kw)
        return [t]
    if case.collective == "reduce":
        t = mine[0].clone()
        comm.reduce(t, case.root, case.op, **kw)
        return [t]
    if case.collective == "reduce_scatter":
        out = torch.empty_like(mine[r])
        arg = mine if case.uneven else torch.cat(mine)
        comm.reduce_scatter(out, arg, case.op, **kw)
        return [out]
    if case.collective == "all_gather":
        sizes = block_sizes(case, n)
        if case.uneven:
            outs = [torch.empty(s, dtype=mine[0].dtype) for s in sizes]
            comm.all_gather(outs, mine[0], **kw)
            return outs
        out = torch.empty(n * case.numel, dtype=mine[0].dtype)
        comm.all_gather(out, mine[0], **kw)
        return [out]
    if case.collective == "all_to_all":
        outs = [torch.empty(_a2a_size(case, i, r), dtype=mine[0].dtype) for i in range(n)]
        if case.uneven:
            comm.all_to_all(outs, mine, **kw)
            return outs
        out = torch.empty(n * case.numel, dtype=mine[0].dtype)
        comm.all_to_all(out, torch.cat(mine), **kw)
        return [out]
    raise AssertionError(case.collective)


def run_many(cases: list[Case]) -> list[list[torch.Tensor]]:
    """Runs on every rank of a pool: all cases, in order."""
    return [run(c) for c in cases]


def _fold(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    acc = tensors[0].double()
    for t in tensors[1:]:
        t = t.double()
        if op in ("sum", "avg"):
            acc = acc + t
        elif op == "prod":
            acc = acc * t
        elif op == "max":
            acc = torch.maximum(acc, t)
        else:
            acc = torch.minimum(acc, t)
    return acc / len(tensors) if op == "avg" else acc


def expected(case: Case, world: int) -> list[list[torch.Tensor]]:
    """What each rank must end with, computed locally in float64 (ints stay exact)."""
    ins = [inputs(case, r, world) for r in range(world)]
    c = case.collective
    if c == "all_reduce":
        total = _fold([x[0] for x in ins], case.op)
        return [[total] for _ in range(world)]
    if c == "broadcast":
        return [[ins[case.root][0]] for _ in range(world)]
    if c == "reduce":
        total = _fold([x[0] for x in ins], case.op)
        return [[total] if r == case.root else [ins[r][0]] for r in range(world)]
    if c == "reduce_scatter":
        return [[_fold([x[r] for x in ins], case.op)] for r in range(world)]
    if c == "all_gather":
        blocks = [x[0] for x in ins]
        return [blocks if case.uneven else [torch.cat(blocks)] for _ in range(world)]
    if c == "all_to_all":
        got = [[ins[src][dst] for src in range(world)] for dst in range(world)]
        return got if case.uneven else [[torch.cat(b)] for b in got]
    raise AssertionError(c)


def tolerance(case: Case, world: int) -> tuple[float, float]:
    """(rtol, atol) for comparing with the float64 reference: reductions round once per
    rank in the tensor's dtype; copies and max/min are exact."""
    dtype = DTYPES[case.dtype]
    if not dtype.is_floating_point or case.collective not in REDUCING or case.op in ("max", "min"):
        return 0.0, 0.0
    eps = torch.finfo(dtype).eps
    scale = 4.0 * world * eps
    return scale, scale * (4.0 if case.op in ("sum", "avg") else 1.0)


def check(case: Case, world: int, results: list[list[torch.Tensor]]) -> None:
    """Every rank's result matches the reference; results that every rank shares are
    bitwise equal across ranks."""
    want = expected(case, world)
    rtol, atol = tolerance(case, world)
    for r in range(world):
        got = results[r]
        assert len(got) == len(want[r]), (case, r)
        for a, b in zip(got, want[r], strict=True):
            assert a.dtype == DTYPES[case.dtype], (case, r, a.dtype)
            assert a.shape == b.shape, (case, r, a.shape, b.shape)
            exact = rtol == 0 or (case.collective == "reduce" and r != case.root)
            ref = b.to(a.dtype).double() if exact else b.double()
            torch.testing.assert_close(
                a.double(),
                ref,
                rtol=0 if exact else rtol,
                atol=0 if exact else atol,
                msg=lambda m, r=r: f"{case} rank {r}: {m}",
            )
    if case.collective in ("all_reduce", "all_gather", "broadcast"):
        for r in range(1, world):
            for a, b in zip(results[0], results[r], strict=True):
                assert torch.equal(a, b), f"{case}: rank {r} differs bitwise from rank 0"
