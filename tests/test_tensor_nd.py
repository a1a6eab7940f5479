"""2D (SUMMA), 2.5D (Tesseract) and 3D tensor parallelism against dense computation.

Each operation (the matmul and its two backward products, the linear layer with bias,
LayerNorm, embedding, the vocabulary head with its loss on batch shards) equals the dense
one in float64, at 4 ranks (2D, q=2) and 8 ranks (2.5D q=2 d=2, 3D q=2), under the default
rank layout and a permuted one (reversed ranks, other dimension order). The GPT under each
mode equals the one-process oracle after several Adam steps. Tolerance as in
tests/test_tensor_gpt.py: float64, sums in another order, 1e-10.
"""

from __future__ import annotations

import pytest
import torch

from tests import tensor_gpt_fns
from tests import tensor_nd_fns as fns

TOL = {"rtol": 1e-10, "atol": 1e-10}
WORLD = {"2d": 4, "2.5d": 8, "3d": 8}


@pytest.mark.parametrize(
    ("mode", "permuted"), [("2d", False), ("2d", True), ("2.5d", True), ("3d", False), ("3d", True)]
)
def test_ops_match_dense(ranks, mode, permuted):
    results = ranks(WORLD[mode], fns.ops, mode, permuted, timeout=180)
    coords = {r["coords"] for r in results}
    assert len(coords) == WORLD[mode]  # every rank a distinct grid cell
    losses = {round(r["loss"], 12) for r in results}
    assert len(losses) == 1  # the global-batch loss, the same on every rank


@pytest.mark.parametrize(("mode", "permuted"), [("2d", True), ("2.5d", False), ("3d", True)])
def test_gpt_matches_oracle(ranks, mode, permuted):
    want, want_losses = tensor_gpt_fns.oracle(False, size=fns.GPT_BATCH)
    results = ranks(WORLD[mode], fns.train_gpt, mode, permuted, timeout=300)
    for res in results:
        got = res["state"]
        assert list(got) == list(want)  # the dense model's keys, in order
        for key in want:
            assert got[key].shape == want[key].shape, key
            torch.testing.assert_close(got[key], want[key], **TOL, msg=lambda m, k=key: f"{k}: {m}")
        torch.testing.assert_close(res["losses"], want_losses, **TOL)
    # parameters per rank: weights 1/q^2 (2D, 2.5D) or less; all ranks hold the same count
    local = {r["local_numel"] for r in results}
    assert len(local) == 1
    dense = results[0]["dense_numel"]
    assert local.pop() * 4 <= dense + 4 * 13 * 16  # 1/q^2 (head padded 13 -> 16 columns)
