"""Every collective x algorithm x world size x dtype x awkward size, against a local
float64 reference, with every rank's shared result bitwise equal."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plait.comm import SUPPORTED
from tests.cases import DTYPES, Case, check, run_many

WORLDS = [1, 2, 3, 4, 5, 8]
OPS = ["sum", "avg", "prod", "max", "min"]


def _grid(world: int) -> list[Case]:
    """All supported (collective, algorithm) pairs, all dtypes, awkward sizes."""
    sizes = sorted({0, 1, world - 1 if world > 1 else 2, world + 1, 37})
    cases = []
    ops = itertools.cycle(OPS)
    for (collective, algorithms), dtype, numel in itertools.product(
        SUPPORTED.items(), DTYPES, sizes
    ):
        for algorithm in algorithms:
            op = next(ops)
            if op == "avg" and dtype == "int64":
                op = "sum"
            root = (numel + len(algorithm)) % world
            uneven = collective in ("reduce_scatter", "all_gather", "all_to_all") and numel % 2 == 1
            cases.append(
                Case(collective, algorithm, dtype, numel, op, root, seed=numel, uneven=uneven)
            )
    return cases


@pytest.mark.parametrize("world", WORLDS)
def test_grid(ranks, world):
    cases = _grid(world)
    results = ranks(world, run_many, cases, timeout=300)
    for i, case in enumerate(cases):
        check(case, world, [results[r][i] for r in range(world)])


def _case_strategy(world: int) -> st.SearchStrategy[Case]:
    pairs = [(c, a) for c, algos in SUPPORTED.items() for a in algos]
    return st.builds(
        lambda pair, dtype, numel, op, root, seed, uneven: Case(
            pair[0],
            pair[1],
            dtype,
            numel,
            "sum" if (op == "avg" and dtype == "int64") else op,
            root % world,
            seed,
            uneven,
        ),
        st.sampled_from(pairs),
        st.sampled_from(list(DTYPES)),
        st.integers(0, 3000),
        st.sampled_from(OPS),
        st.integers(0, 7),
        st.integers(0, 2**16),
        st.booleans(),
    )


@pytest.mark.parametrize("world", [2, 3, 4, 5])
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_cases(ranks, world, data):
    cases = data.draw(st.lists(_case_strategy(world), min_size=1, max_size=12))
    results = ranks(world, run_many, cases, timeout=300)
    for i, case in enumerate(cases):
        check(case, world, [results[r][i] for r in range(world)])
