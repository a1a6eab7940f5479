"""Asynchronous collectives, sub-groups, hierarchy and point-to-point messages."""

from __future__ import annotations

import pytest
import torch

from tests import rank_fns


@pytest.mark.parametrize("algorithm", ["ring", "native", "halving_doubling"])
def test_async_collectives_complete_in_issue_order(ranks, algorithm):
    world, count, numel = 3, 5, 1000
    results = ranks(world, rank_fns.async_many, count, numel, algorithm)
    for per_rank in results:
        for i in range(count):
            expected = sum(r + i for r in range(world))
            assert torch.equal(per_rank[i], torch.full((numel,), float(expected)))
        assert torch.equal(per_rank[-1], torch.full((numel,), float(world)))


def test_overlapping_subgroups(ranks):
    results = ranks(4, rank_fns.subgroups)
    assert results[0] == {"pair": [1.0]}
    assert results[2] == {"pair": [5.0]}
    assert results[1] == {"pair": [1.0], "odd": [4.0, 3.0]}
    assert results[3] == {"pair": [5.0], "odd": [4.0, 3.0]}


@pytest.mark.parametrize("world,node_size", [(4, 2), (5, 2), (6, 3)])
def test_hierarchical_groups_by_node(ranks, world, node_size):
    numel = 50
    results = ranks(world, rank_fns.hierarchical, node_size, numel)
    want = [float(k * sum(range(1, world + 1))) for k in range(numel)]
    for reduced, broadcast, _stat in results:
        assert reduced == want
        assert broadcast == [float(world - 1)] * numel
    # only node leaders (group rank % node_size == 0) talk across nodes, so they send more
    leaders = [results[r][2]["sent"] for r in range(0, world, node_size)]
    members = [results[r][2]["sent"] for r in range(world) if r % node_size]
    assert min(leaders) > max(members)


def test_point_to_point_ring(ranks):
    world = 3
    results = ranks(world, rank_fns.p2p_ring, 4)
    assert results[0] == [float(world)] * 4
    assert results[1] == [1.0] * 4
    assert results[2] == [2.0] * 4


def test_bad_arguments_raise_before_communicating(ranks):
    for errors in ranks(2, rank_fns.bad_arguments):
        assert "no error" not in errors, errors
        text = "\n".join(errors)
        for fragment in [
            "src=2 is not a rank",
            "dst=-1",
            "input has 7 elements",
            "output has 5 elements",
            "dtype torch.float64",
            "meta",
            "'avg' needs a floating-point",
            "unknown reduce op",
            "unknown algorithm 'butterfly'",
            "'tree' does not implement all_to_all",
            "must be a torch.Tensor",
            "dtype torch.bool",
            "divisible by the group size",
            "is this rank",
            "list of 2 tensors",
        ]:
            assert fragment in text, (fragment, text)
