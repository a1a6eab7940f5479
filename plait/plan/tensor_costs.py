"""What 1D, 2D, 2.5D and 3D tensor parallelism send per layer, side by side.

For one linear layer ``Y = X W^T`` (``X`` of ``tokens x in``, ``W`` of ``in x out``, ``Y`` of
``tokens x out``; ``|.|`` in bytes), forward plus backward, bytes sent per rank averaged
over the ``P`` ranks (every rank sits in one group of each axis, so this is the average
over one group's members):

=====  ======================================================  ==============================
mode   what runs (see the modules in strategies/tensor)         papers' table (Colossal-AI)
=====  ======================================================  ==============================
1d     one all-reduce over P: of ``|X|`` (column-parallel,      ``2(P-1)/P`` of the activation
       backward) or ``|Y|`` (row-parallel, forward)
2d     3 q broadcasts of ``|X|/q^2`` and of ``|W|/q^2``, of      ``6(q-1)/q``
       which q of each are reduces (backward), over q ranks
2.5d   the same per depth layer on ``|X|/d``, plus a depth       ``3(q-1)(d+1)/(dq)``
       all-reduce of ``|W|/q^2``
3d     all-gathers and reduce-scatters over q ranks of           ``6(q-1)/q^3``
       ``|X|/q^2``, ``|W|/q^2``, ``|Y|/q^2``, two of each
=====  ======================================================  ==============================

Per-member averages of one collective of ``S`` bytes over ``n`` ranks, as plait's ring
algorithms send them (``plait.comm.stats``): broadcast (a chain) ``(n-1)/n S``; all-gather
(``S`` the result) and reduce-scatter (``S`` the input) ``(n-1)/n S``; all-reduce
``2(n-1)/n S``; reduce ``(n-1)/n S + (n-1)/n^2 S`` (a reduce-scatter, then every chunk to
the root). The papers count a reduce as ``(n-1)/n S`` (``algorithm="paper"``).

Relation to the table, with ``|W| = |X| = |Y|`` and the paper's reduce: 1D and 3D are
exactly the table's numbers in units of the activation ``|X|``; 2D's ``3(q-1)(|X|+|W|)/q^2
= 6(q-1)/q^2 |X|`` and 2.5D's ``3(q-1)(|X|/d + |W|)/q^2 = 3(q-1)(d+1)/(d q^2) |X|`` are the
table's numbers in units of ``|X|/q``; the table leaves 2.5D's depth all-reduce out.
:func:`linear_cost` returns both (``bytes_per_rank``: what plait sends, exactly;
``paper_bytes_per_rank``: the table's formula in bytes of the activation, ``|X|/q`` units
converted). ``tests/test_tensor_nd.py`` checks ``bytes_per_rank`` against the counters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from plait.strategies.tensor.grid import grid_shape

MODES = ("1d", "2d", "2.5d", "3d")


def collective_bytes(collective: str, n: int, size: Fraction, algorithm: str = "ring") -> Fraction:
    """Bytes one member of an ``n``-rank group sends on average for ``collective`` of
    ``size`` bytes (module doc). ``algorithm``: ``"ring"`` (plait's) or ``"paper"``."""
    if n == 1:
        return Fraction(0)
    share = Fraction(n - 1, n) * size
    if collective in ("broadcast", "all_gather", "reduce_scatter"):
        return share
    if collective == "all_reduce":
        return 2 * share
    if collective == "reduce":
        return share + (share / n if algorithm == "ring" else 0)
    raise ValueError(f"collective_bytes: unknown collective {collective!r}")


@dataclass(frozen=True)
class LinearCost:
    """One linear layer, forward + backward, per rank (module doc)."""

    mode: str
    ranks: int
    q: int
    depth: int
    bytes_per_rank: float  # what plait's algorithms send, averaged over the ranks
    paper_bytes_per_rank: float  # the table's formula, in bytes
    param_bytes_per_rank: float  # the weight's share on one rank
    activation_bytes_per_rank: float  # the input X's share on one rank
    formula: str


def grid_of(mode: str, ranks: int, depth: int | None = None) -> tuple[int, int]:
    """``(q, d)`` of ``mode`` over ``ranks`` (1D: ``(ranks, 1)``); ``ValueError`` if the
    size does not fit (see :func:`plait.strategies.tensor.grid.grid_shape`)."""
    if mode == "1d":
        return ranks, 1

    dims = grid_shape(mode, ranks, depth=depth)
    return dims["row"], dims.get("depth", 1) if mode == "2.5d" else 1


def linear_cost(
    mode: str,
    *,
    ranks: int,
    tokens: int,
    in_features: int,
    out_features: int,
    depth: int | None = None,
    bytes_per_element: int = 4,
    side: str = "column",
    algorithm: str = "ring",
) -> LinearCost:
    """The bytes one linear layer sends per rank in ``mode`` (module doc). ``side`` (1D
    only): ``"column"`` (all-reduce of ``dX`` backward) or ``"row"`` (of ``Y`` forward)."""
    if mode not in MODES:
        raise ValueError(f"linear_cost: mode {mode!r}; use one of {list(MODES)}")
    e = bytes_per_element
    X = Fraction(tokens * in_features * e)
    W = Fraction(in_features * out_features * e)
    Y = Fraction(tokens * out_features * e)
    q, d = grid_of(mode, ranks, depth)

    def c(name: str, n: int, size: Fraction) -> Fraction:
        return collective_bytes(name, n, size, algorithm)

    if mode == "1d":
        act = X if side == "column" else Y
        sent = c("all_reduce", ranks, act)
        paper = Fraction(2 * (ranks - 1), ranks) * act
        formula = "2(P-1)/P |X|"
        params, acts = W / ranks, X
    elif mode == "3d":
        x, w, y = X / q**2, W / q**2, Y / q**2
        sent = 2 * (c("all_gather", q, x) + c("all_gather", q, w) + c("all_gather", q, y))
        paper = Fraction(6 * (q - 1), q**3) * X
        formula = "2(q-1)(|X|+|W|+|Y|)/q^3; table 6(q-1)/q^3 |X|"
        params, acts = W / q**3, X / q**3
    else:
        x, w = X / (d * q * q), W / (q * q)
        step = 2 * c("broadcast", q, x) + 2 * c("broadcast", q, w)
        sent = q * (step + c("reduce", q, x) + c("reduce", q, w))
        if mode == "2.5d":
            sent += c("all_reduce", d, w)
            paper = Fraction(3 * (q - 1) * (d + 1), d * q) * X / q
            formula = "3(q-1)(|X|/d+|W|)/q^2 + 2(d-1)/d |W|/q^2; table 3(q-1)(d+1)/(dq) |X|/q"
        else:
            paper = Fraction(6 * (q - 1), q) * X / q
            formula = "3(q-1)(|X|+|W|)/q^2; table 6(q-1)/q |X|/q"
        params, acts = W / (q * q), X / (d * q * q)
    return LinearCost(
        mode,
        ranks,
        q,
        d,
        float(sent),
        float(paper),
        float(params),
        float(acts),
        formula,
    )


@dataclass(frozen=True)
class ModeCost:
    """One mode on one model: the linear layers' traffic per training step, per rank."""

    mode: str
    ranks: int
    valid: bool
    reason: str
    bytes_per_step: float  # sum over every linear layer, forward + backward
    paper_bytes_per_step: float
    param_bytes_per_rank: float  # the linear layers' weights
    activation_bytes_per_rank: float  # one layer's input


def gpt_linears(width: int, layers: int, vocab: int) -> list[tuple[int, int, str]]:
    """``(in, out, 1D side)`` of every linear of :class:`plait.models.GPT`: per block
    ``qkv`` (column), ``proj`` (row), ``fc1`` (column), ``fc2`` (row); then the head."""
    h = width
    block = [(h, 3 * h, "column"), (h, h, "row"), (h, 4 * h, "column"), (4 * h, h, "row")]
    return block * layers + [(h, vocab, "column")]


def compare_modes(
    *,
    ranks: int,
    tokens: int,
    width: int,
    layers: int,
    vocab: int,
    depth: int = 2,
    bytes_per_element: int = 4,
    algorithm: str = "ring",
) -> list[ModeCost]:
    """The four modes side by side for a GPT of ``width``/``layers``/``vocab`` on ``ranks``
    ranks with ``tokens`` tokens per step (a mode the size does not fit is listed with its
    reason). Pure arithmetic; the 1D head is column-parallel without its vocabulary
    cross-entropy's small all-reduces."""
    rows = []
    for mode in MODES:
        try:
            costs = [
                linear_cost(
                    mode,
                    ranks=ranks,
                    tokens=tokens,
                    in_features=i,
                    out_features=o,
                    depth=depth if mode == "2.5d" else None,
                    bytes_per_element=bytes_per_element,
                    side=side,
                    algorithm=algorithm,
                )
                for i, o, side in gpt_linears(width, layers, vocab)
            ]
        except ValueError as exc:
            rows.append(ModeCost(mode, ranks, False, str(exc).split(";")[0], 0, 0, 0, 0))
            continue
        rows.append(
            ModeCost(
                mode,
                ranks,
                True,
                "",
                math.fsum(c.bytes_per_rank for c in costs),
                math.fsum(c.paper_bytes_per_rank for c in costs),
                math.fsum(c.param_bytes_per_rank for c in costs),
                costs[0].activation_bytes_per_rank,
            )
        )
    return rows


def crossover_tokens(
    mode: str,
    *,
    ranks: int,
    width: int,
    layers: int,
    vocab: int,
    depth: int = 2,
    algorithm: str = "ring",
) -> float | None:
    """Tokens per step above which ``mode``'s linear layers send fewer bytes per rank than
    1D's on ``ranks`` ranks (``None``: never; ``0``: always). Both counts are linear in the
    tokens ``T`` (1D: ``c1 T``; the grid modes ``a + c T``, ``a`` the weights' traffic), so
    the crossover is ``a / (c1 - c)``. ``algorithm``: ``"ring"`` (what plait sends) or
    ``"paper"`` (the papers' reduce). Pure arithmetic."""

    def linears(m: str, tokens: int) -> float:
        rows = compare_modes(
            ranks=ranks,
            tokens=tokens,
            width=width,
            layers=layers,
            vocab=vocab,
            depth=depth,
            algorithm=algorithm,
        )
        row = next(r for r in rows if r.mode == m)
        if not row.valid:
            raise ValueError(f"{m} does not fit {ranks} ranks: {row.reason}")
        return row.bytes_per_step

    step = 4 * ranks * ranks  # divisible by every grid's batch blocks
    c1 = (linears("1d", 2 * step) - linears("1d", step)) / step
    a_plus_c = linears(mode, step)
    c = (linears(mode, 2 * step) - a_plus_c) / step
    a = a_plus_c - c * step
    if c >= c1:
        return None
    return max(0.0, a / (c1 - c))


def gpt_step_bytes(
    mode: str,
    *,
    ranks: int,
    batch: int,
    seq: int,
    width: int,
    layers: int,
    vocab: int,
    positions: int | None = None,
    depth: int | None = None,
    bytes_per_element: int = 4,
) -> float:
    """Bytes one rank sends on average in one training step (forward, loss, backward) of
    :class:`plait.models.GPT` (untied, dropout off) under ``mode`` with plait's ring
    algorithms: what ``plait.comm.stats`` counts, exactly (``benchmarks/tensor_modes.py``
    compares them). ``positions`` is the position table's rows (default ``seq``).

    1D (no sequence parallelism): ``(P-1)/P (8 L T h + 4 T h + 8 T)`` elements, ``T = b s``:
    four all-reduces of ``T h`` per block, the embedding's and the head input's, and the
    vocabulary cross-entropy's two (``T`` maxima, ``3 T`` sums). 2D / 2.5D / 3D, summed:

    - every linear layer (:func:`linear_cost`; the head's vocabulary padded to the grid);
    - every vector or table (biases, LayerNorm scale and shift, both embedding tables) of
      ``n`` elements: gathered over ``q`` ranks forward and reduce-scattered backward,
      ``2 (q-1)/q n/q``, plus, where it is replicated over ranks with other batch blocks,
      an all-reduce of its piece, ``2 (r-1)/r n/q^2`` (2.5D: ``r = d``; 3D: ``r = q``);
    - every LayerNorm: four all-reduces (two statistics, forward and backward) of one value
      per local token over the feature group, ``4 * 2 (q-1)/q T/parts``;
    - the loss: ``2 (q-1)/q * 3 T_l`` on the vocabulary group (``T_l`` the head's local
      tokens), and two one-element all-reduces per batch axis.
    """
    e = Fraction(bytes_per_element)
    T = batch * seq
    h, L = width, layers
    positions = seq if positions is None else positions
    if mode == "1d":
        t = ranks
        return float(Fraction(t - 1, t) * (8 * L * T * h + 4 * T * h + 8 * T) * e)
    q, d = grid_of(mode, ranks, depth)

    def ar(n: int, size: Fraction) -> Fraction:
        return collective_bytes("all_reduce", n, size)

    replicas = d if mode == "2.5d" else (q if mode == "3d" else 1)
    parts = {"2d": q, "2.5d": d * q, "3d": q * q}[mode]
    grid_multiple = q * q if mode == "3d" else q
    vocab_p = -(-vocab // grid_multiple) * grid_multiple

    def vector(n: int) -> Fraction:
        n_e = n * e
        return 2 * collective_bytes("all_gather", q, n_e / q) + ar(replicas, n_e / (q * q))

    total = Fraction(0)
    for i, o, _ in gpt_linears(width, layers, vocab_p):
        cost = linear_cost(
            mode,
            ranks=ranks,
            tokens=T,
            in_features=i,
            out_features=o,
            depth=depth,
            bytes_per_element=bytes_per_element,
        )
        total += Fraction(cost.bytes_per_rank)
    total += L * (vector(3 * h) + vector(h) + vector(4 * h) + vector(h))  # biases
    norms = 2 * L + 1
    total += norms * (2 * vector(h) + 4 * ar(q, T * e / parts))
    total += vector(vocab * h) + vector(positions * h)  # the embedding tables
    total += 3 * ar(q, T * e / parts)  # the head's rows are one of `parts` batch blocks
    batch_axes = [q] + ([d] if mode == "2.5d" else [q] if mode == "3d" else [])
    total += sum(2 * ar(n, e) for n in batch_axes)
    return float(total)


def format_modes(rows: list[ModeCost]) -> str:
    """A markdown table of :func:`compare_modes`."""
    out = [
        "| mode | ranks | linear bytes/step/rank | table formula | weight bytes/rank | "
        "activation bytes/rank |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if not r.valid:
            out.append(f"| {r.mode} | {r.ranks} | n/a: {r.reason} | | | |")
            continue
        out.append(
            f"| {r.mode} | {r.ranks} | {r.bytes_per_step:,.0f} | {r.paper_bytes_per_step:,.0f} | "
            f"{r.param_bytes_per_rank:,.0f} | {r.activation_bytes_per_rank:,.0f} |"
        )
    return "\n".join(out)


__all__ = [
    "MODES",
    "LinearCost",
    "ModeCost",
    "collective_bytes",
    "compare_modes",
    "crossover_tokens",
    "format_modes",
    "gpt_linears",
    "gpt_step_bytes",
    "grid_of",
    "linear_cost",
]
