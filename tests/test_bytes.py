"""Bytes each rank sends match the algorithm's theory (plait.comm.stats)."""

from __future__ import annotations

import pytest

from tests import rank_fns

F32 = 4


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("numel", [1200, 1001])
def test_ring_all_reduce_sends_2_n_minus_1_over_n(ranks, world, numel):
    results = ranks(world, rank_fns.bytes_of, "all_reduce", "ring", numel)
    size = numel * F32
    theory = 2 * (world - 1) / world * size
    for sent, received in results:
        # uneven chunks differ by one element: at most one element per step off theory
        assert abs(sent - theory) <= 2 * (world - 1) * F32
        assert abs(received - theory) <= 2 * (world - 1) * F32
    assert sum(s for s, _ in results) == sum(r for _, r in results)
    if numel % world == 0:
        assert all(sent == theory for sent, _ in results)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather"])
def test_ring_reduce_scatter_and_all_gather_send_n_minus_1_over_n(ranks, world, collective):
    numel = 240 * world
    results = ranks(world, rank_fns.bytes_of, collective, "ring", numel)
    theory = (world - 1) / world * numel * F32
    assert all(sent == theory and received == theory for sent, received in results)


@pytest.mark.parametrize("world", [2, 4])
def test_halving_doubling_matches_ring_for_powers_of_two(ranks, world):
    numel = 64 * world
    results = ranks(world, rank_fns.bytes_of, "all_reduce", "halving_doubling", numel)
    theory = 2 * (world - 1) / world * numel * F32
    assert all(sent == theory for sent, _ in results)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_naive_all_reduce_root_sends_n_minus_1_times(ranks, world):
    numel = 300
    size = numel * F32
    results = ranks(world, rank_fns.bytes_of, "all_reduce", "naive", numel)
    assert results[0] == ((world - 1) * size, (world - 1) * size)
    assert all(r == (size, size) for r in results[1:])


def test_ring_broadcast_is_a_chain(ranks):
    numel = 1000
    results = ranks(4, rank_fns.bytes_of, "broadcast", "ring", numel, 1)
    size = numel * F32
    # root 1 -> 2 -> 3 -> 0: everyone but the chain's end (rank 0) forwards the buffer once
    assert results == [(0, size), (size, 0), (size, size), (size, size)]
