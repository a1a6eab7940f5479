"""Bytes one tensor-parallel transformer layer sends, against the formula (PTD-P §3.2):
forward + backward, ring algorithms, ``8 b s h (t-1)/t`` elements per rank per layer, the
same with sequence parallelism, plus the all-reduce of the gradients of the replicated
parameters that see a slice of the sequence there (ln1 and ln2 weight and bias, and the
biases of the two row-parallel layers: 6 h elements, ``12 h (t-1)/t``)."""

from __future__ import annotations

import pytest

from tests import tensor_acct_fns as fns


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_layer_bytes_match_formula(ranks, world, sp):
    t, b, s, h, elem = world, fns.B, fns.S, fns.H, 4
    for sent in ranks(world, fns.layer_bytes, sp, timeout=120):
        layer = 8 * b * s * h * (t - 1) // t * elem
        if sp:
            # 2 all-gathers + 2 reduce-scatters forward, the duals backward, of b*s*h each
            assert sent["all_gather/ring#calls"] == 4 and sent["reduce_scatter/ring#calls"] == 4
            assert sent["all_gather/ring"] + sent["reduce_scatter/ring"] == layer
            assert sent["all_reduce/ring#calls"] == 6  # ln1, ln2 (weight, bias), 2 row biases
            assert sent["all_reduce/ring"] == 2 * 6 * h * (t - 1) // t * elem
        else:
            # "g" after attention and MLP forward, "f" before them backward
            assert sent == {"all_reduce/ring": layer, "all_reduce/ring#calls": 4}


def test_bytes_counted_per_group(ranks):
    """plait.comm.group_stats() keeps the tp and dp traffic of one mesh apart."""
    t, b, s, h, elem = 2, fns.B, fns.S, fns.H, 4
    for out in ranks(4, fns.bytes_per_group, timeout=120):
        assert set(out["sent"]) == {out["tp"], out["dp"]}
        assert out["sent"][out["tp"]] == {"all_reduce/ring": 8 * b * s * h * (t - 1) // t * elem}
        # ring all-reduce over dp = 2 of the (already tp-sharded) gradients: 2 (d-1)/d of them
        assert out["sent"][out["dp"]] == {"all_reduce/ring": out["grad_numel"] * elem}
