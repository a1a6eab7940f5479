"""Every collective x algorithm x world size x dtype x awkward size, against a local
float64 reference, with every rank's shared result bitwise equal; on the default
transport, and on the shared-memory transport (``PLAIT_TRANSPORT=shm``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plait import RankPool
from plait.comm import SUPPORTED, transport
from tests.cases import DTYPES, Case, check, run_many
from tests.comm_trust_fns import half_avg, half_values
from tests.faultlog import record

WORLDS = [1, 2, 3, 4, 5, 8]
OPS = ["sum", "avg", "prod", "max", "min"]
SHM_WORLDS = [2, 3, 4]
# the default pool's ranks share memory (algorithm "shm" works there) unless the default
# transport is gloo or shared memory cannot work on this machine
SHM_BY_DEFAULT = transport.parse_mode(None) != "gloo" and transport.unsupported("gloo") is None
NO_SHM = transport.unsupported("gloo") is not None


def _pairs(shm: bool) -> dict[str, tuple[str, ...]]:
    return {c: tuple(a for a in algos if shm or a != "shm") for c, algos in SUPPORTED.items()}


def _grid(world: int, shm: bool = SHM_BY_DEFAULT) -> list[Case]:
    """All supported (collective, algorithm) pairs, all dtypes, awkward sizes."""
    sizes = sorted({0, 1, world - 1 if world > 1 else 2, world + 1, 37})
    cases = []
    ops = itertools.cycle(OPS)
    for (collective, algorithms), dtype, numel in itertools.product(
        _pairs(shm).items(), DTYPES, sizes
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


@pytest.fixture(scope="module")
def shm_ranks() -> Iterator[dict[int, RankPool]]:
    pools: dict[int, RankPool] = {}
    yield pools
    for pool in pools.values():
        pool.close()


@pytest.mark.skipif(NO_SHM, reason="no shared-memory transport on this machine")
@pytest.mark.parametrize("world", SHM_WORLDS)
def test_grid_on_shared_memory(shm_ranks, world):
    """The same grid with every local peer on shared memory (algorithm "shm" included)."""
    pool = shm_ranks.get(world)
    if pool is None:
        pool = shm_ranks[world] = RankPool(world, timeout=60, env={"PLAIT_TRANSPORT": "shm"})
    cases = _grid(world, shm=True)
    results = pool.run(run_many, cases, timeout=300)
    for i, case in enumerate(cases):
        check(case, world, [results[r][i] for r in range(world)])


def _case_strategy(world: int) -> st.SearchStrategy[Case]:
    pairs = [(c, a) for c, algos in _pairs(SHM_BY_DEFAULT).items() for a in algos]
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


@pytest.mark.faults
def test_half_avg_does_not_overflow(ranks):
    """Issue 26 item 7: fp16 "avg" of 60000.0 at three ranks was inf (summed in fp16
    first); now each contribution is divided before the sum (PreMulSum), by every
    algorithm, and random values match the float64 mean within two fp16 ulps."""
    world = 3
    results = ranks(world, half_avg, timeout=120)
    big = [k for k in results[0] if k.endswith(" big")]
    wide = torch.stack([half_values(r).double() for r in range(world)])
    mean = wide.mean(0)
    # the rounding bound of a sum: one float16 rounding per term and per partial sum, each
    # relative to the terms' magnitude (not the mean's: terms may cancel)
    size = wide.abs().mean(0)
    assert results[0], "no case ran"
    for key in results[0]:
        name = key.split()[-1]
        collective = key.split()[0]
        for r in range(world):
            if collective == "reduce" and r != 0:
                continue
            value = torch.tensor(results[r][key], dtype=torch.float64)
            if name == "big":
                expect, scale = torch.full_like(value, 60000.0), torch.full_like(value, 60000.0)
            elif collective == "reduce_scatter":
                n = value.numel()
                expect, scale = mean[r * n : (r + 1) * n], size[r * n : (r + 1) * n]
            else:
                expect, scale = mean, size
            bound = 2 * world * torch.finfo(torch.float16).eps * scale
            assert torch.isfinite(value).all(), f"{key} rank {r}: {value}"
            assert ((value - expect).abs() <= bound).all(), f"{key} rank {r}: {value} vs {expect}"
    record(
        row=26,
        fault="#7 float16 avg all-reduce of 60000.0 at 3 ranks",
        detected_after_s=None,
        named_correctly=None,
        state_equal=True,
        note=f"60000.0 on every rank by {len(big)} collective/algorithm pairs (was inf)",
    )
