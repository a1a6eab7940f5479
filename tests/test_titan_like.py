"""A model handed over whole, shaped like torchtitan's Llama 3 (a complex64 rotary buffer,
subclassed Linear/Embedding, RMSNorm, grouped-query attention), trains under DDP and FSDP
exactly as one process does (float64, clipping active, two AdamW parameter groups). Its
complex buffer used to stop the wrap (broadcast refused the dtype)."""

from __future__ import annotations

import pytest
import torch

from tests import titan_fns


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_titan_like_model_trains_like_one_process(ranks, strategy):
    want, want_norms = titan_fns.oracle()
    assert min(want_norms) > titan_fns.CLIP  # clipping is active
    for state, norms, same_table in ranks(2, titan_fns.train, strategy, timeout=180):
        assert same_table
        assert norms == pytest.approx(want_norms, rel=1e-10)
        for key, value in want.items():
            if key in state:
                torch.testing.assert_close(state[key], value, rtol=1e-8, atol=1e-10)
        assert set(state) >= {k for k in want if "freqs" not in k}
