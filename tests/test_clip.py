"""plait.clip_grad_norm_ clips by the single-process global norm under every strategy."""

from __future__ import annotations

import pytest
import torch

from tests import clip_fns


@pytest.mark.parametrize("strategy", ["none", "ddp", "naive", "zero1", "zero2", "fsdp"])
def test_one_call_clips_like_one_process(ranks, strategy):
    world = 1 if strategy == "none" else 2
    want_norms, want = clip_fns.oracle(0.05, 3)
    assert min(want_norms) > 0.05  # the threshold really clips
    for norms, state in ranks(world, clip_fns.run, strategy, 0.05, 3):
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(want_norms))
        for key, value in want.items():
            torch.testing.assert_close(state[key], value, rtol=2e-5, atol=2e-6)
