"""Dynamic loss scaling: unscaling, growth, and a skip every rank agrees on."""

from __future__ import annotations

import pytest
import torch

from plait.amp import DynamicLossScaler
from tests import amp_fns, ddp_fns


def test_overflow_on_one_rank_skips_the_step_everywhere(ranks):
    for stepped, scale, unchanged in ranks(3, amp_fns.overflow_on_one_rank, 1):
        assert not stepped and scale == 512.0 and unchanged


def test_fsdp_float16_overflow_skips_the_step_on_every_rank(ranks):
    for skipped, scale, unchanged, moved in ranks(2, amp_fns.fsdp_fp16_overflow):
        assert skipped and scale == 2.0**39 and unchanged
        assert moved  # the same model and optimizer step once the scale fits


def test_clean_steps_unscale_exactly_and_grow_the_scale():
    model, reference = ddp_fns.make_model(), ddp_fns.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=256.0, growth_interval=2)
    for step in range(4):
        x, y = ddp_fns.batch(step)
        opt.zero_grad()
        ref_opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        assert scaler.step(opt)
        ref_opt.step()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b)  # powers of two scale and unscale exactly
    assert scaler.scale_value == 1024.0 and scaler.state_dict()["clean_steps"] == 4


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=2.0)
