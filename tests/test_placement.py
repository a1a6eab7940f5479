"""Placements let one global norm count every element of a model-parallel model once."""

from __future__ import annotations

import math

import pytest
import torch

from tests import placement_fns


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_split_and_copied_parameters_clip_like_one_process(ranks, norm_type):
    w, b = placement_fns._full_grads()
    pw, pb = torch.nn.Parameter(torch.zeros_like(w)), torch.nn.Parameter(torch.zeros_like(b))
    pw.grad, pb.grad = w.clone(), b.clone()
    want = torch.nn.utils.clip_grad_norm_([pw, pb], 0.5, norm_type)
    assert float(want) > 0.5  # the threshold clips
    for r, (norm, (gw, gb)) in enumerate(
        ranks(2, placement_fns.clip_split_and_copied, norm_type, 0.5)
    ):
        assert norm == pytest.approx(float(want), rel=1e-12)
        torch.testing.assert_close(gw, pw.grad[r * 2 : (r + 1) * 2], rtol=1e-12, atol=0)
        torch.testing.assert_close(gb, pb.grad, rtol=1e-12, atol=0)


def test_a_parameter_left_unplaced_is_named(ranks):
    for msg in ranks(2, placement_fns.unplaced_refused):
        assert "parameter '1' was placed by no strategy" in msg


def test_tensor_parallel_inside_ddp_clips_by_the_global_norm(ranks):
    want_norms, want = placement_fns.tp_oracle(0.1)
    assert min(want_norms) > 0.1
    for norms, state in ranks(4, placement_fns.tp_inside_ddp, 0.1, timeout=180):
        assert norms == pytest.approx(want_norms, rel=1e-10)
        for key, value in want.items():
            torch.testing.assert_close(state[key], value, rtol=1e-9, atol=1e-12)
