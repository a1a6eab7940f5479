"""Hugging Face Llama handed over whole to FSDP with one unit per decoder layer, with and
without Hugging Face's gradient checkpointing (the layer's forward re-run inside its
backward), equals one process: float64, two AdamW groups, clipping active."""

from __future__ import annotations

import pytest
import torch

from tests import hf_fsdp_fns as fns

pytest.importorskip("transformers")


@pytest.mark.parametrize("checkpointing", [False, True])
def test_llama_fsdp_per_layer_equals_one_process(ranks, checkpointing):
    want, want_norms = fns.oracle()
    assert min(want_norms) > fns.CLIP
    for state, norms in ranks(2, fns.train, checkpointing, timeout=180):
        assert norms == pytest.approx(want_norms, rel=1e-10)
        assert set(state) == set(want)
        for key, value in want.items():
            torch.testing.assert_close(state[key], value, rtol=1e-8, atol=1e-10)
