"""Tensor-parallel layers and the vocab-parallel loss against their dense counterparts
(outputs and every gradient), at tensor-parallel sizes 1, 2 and 4, in float64."""

from __future__ import annotations

import pytest

from tests import tensor_fns


@pytest.mark.parametrize("world", [1, 2, 4])
def test_layers_match_dense(ranks, world):
    results = ranks(world, tensor_fns.layers_match_dense, timeout=180)
    want = [
        "column",
        "column_gather",
        "row",
        "row_replicate",
        "mlp",
        "mlp+sp",
        "embedding",
        "embedding+sp",
    ]
    assert results == [want] * world


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_vocab_parallel_cross_entropy(ranks, world, smoothing):
    results = ranks(world, tensor_fns.cross_entropy_matches, smoothing, timeout=180)
    calls = 2 if world > 1 else 0  # MAX, then the stacked SUM; nothing in backward
    for counts in results:
        assert counts == {r: (calls, 0) for r in ("mean", "sum", "none")}
