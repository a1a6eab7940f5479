"""Partitioning by dimension: training on feature slices (a row-parallel first layer)
equals training on whole rows in one process (float64, 3 Adam steps)."""

from __future__ import annotations

import pytest
import torch

from plait.data import feature_range, split_features
from tests import tensor_fns


def test_split_features_slices_and_refuses():
    x = torch.arange(24.0).reshape(2, 12)
    assert split_features(x, rank=1, parts=3).tolist() == [[4, 5, 6, 7], [16, 17, 18, 19]]
    assert feature_range(12, rank=3, parts=4) == (9, 12)
    with pytest.raises(ValueError, match="12 features do not split into 5 equal slices"):
        split_features(x, rank=0, parts=5)
    with pytest.raises(ValueError, match="rank 3 is not in 0..2"):
        split_features(x, rank=3, parts=3)


@pytest.mark.parametrize("world", [2, 4])
def test_feature_slices_train_like_whole_rows(ranks, world):
    want = tensor_fns.feature_oracle(3)
    for got in ranks(world, tensor_fns.train_on_feature_slices, 3, timeout=120):
        assert list(got) == list(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-10, atol=1e-12)
