"""Wrap-time check that every rank built the same model."""

from __future__ import annotations

import torch

from plait.strategies.consistency import describe_parameters
from tests import consistency_fns


def test_same_model_passes(ranks):
    assert ranks(2, consistency_fns.check, -1) == ["ok", "ok"]


def test_reordered_modules_are_refused_on_every_rank_naming_rank_and_parameter(ranks):
    results = ranks(4, consistency_fns.check, 2)
    for text in results:
        assert "TestWrapper" in text
        assert "rank 2 differs from rank 0 at parameter #0" in text
        assert "'a.weight (5, 4) float32'" in text and "'b.weight (5, 5) float32'" in text
        assert "rank 1 differs" not in text and "rank 3 differs" not in text


def test_other_shape_is_named(ranks):
    results = ranks(2, consistency_fns.check, -1, 1)
    assert all("rank 1 differs from rank 0 at parameter #4" in t for t in results)
    assert all("'c.weight (6, 5) float32'" in t for t in results)


def test_describe_parameters_lines():
    lines = describe_parameters([("w", torch.zeros(2, 3, dtype=torch.float64))])
    assert lines == ["w (2, 3) float64"]
