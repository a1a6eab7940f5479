"""The GPT under tensor parallelism (and + sequence parallelism) equals the one-process
oracle after several Adam steps, parameters compared through ``full_state_dict``, tied and
untied; bad plans are refused naming the module.

Tolerance: float64; the ranks sum partial products in another order than the dense
matmuls, so results agree to rounding (observed ~1e-16..1e-14); we allow 1e-10.
"""

from __future__ import annotations

import pytest
import torch

from tests import tensor_gpt_fns as fns

TOL = {"rtol": 1e-10, "atol": 1e-10}


# sequence parallelism over one rank is plain TP: (1, True) is left out
@pytest.mark.parametrize(
    ("world", "sp"), [(1, False), (2, False), (2, True), (4, False), (4, True)]
)
@pytest.mark.parametrize("tied", [False, True])
def test_gpt_matches_oracle(ranks, world, tied, sp):
    want, want_losses = fns.oracle(tied)
    results = ranks(world, fns.train, tied, sp, timeout=300)
    for res in results:
        got = res["state"]
        assert list(got) == list(want)  # the dense model's keys, in order
        for key in want:
            assert got[key].shape == want[key].shape, key
            torch.testing.assert_close(got[key], want[key], **TOL, msg=lambda m, k=key: f"{k}: {m}")
        torch.testing.assert_close(res["losses"], want_losses, **TOL)
        assert res["tied"] == tied
        # each rank holds 1/t of every split weight (vocabulary padded to a multiple of t)
        for name, n in res["local_numel"].items():
            dense = res["dense_numel"][name]
            split = any(k in name for k in ("qkv", "proj", "fc1", "fc2.weight", "tok", "head"))
            if name.endswith("fc2.bias") or name.endswith("proj.bias"):
                split = False
            if split and "tok" not in name and "head" not in name:
                assert n * world == dense, name
            elif split:
                assert n == -(-13 // world) * 16, name
            else:
                assert n == dense, name


def test_refusals_name_what_to_change(ranks):
    results = ranks(2, fns.refusals, timeout=120)
    for out in results:
        assert "'blocks.0.attn' has 3 attention heads, not divisible by" in out["heads"]
        assert "'layers.0'" in out["width"] and "out_features 5 is not divisible" in out["width"]
        assert "'layer.0' matches no module" in out["unknown"]
        assert "'tok' is a Embedding; style 'colwise' applies to nn.Linear" in out["style"]
        assert "module 'ln_f' (LayerNorm)" in out["uncovered"]
        assert "'sequence' style" in out["uncovered"]
        assert "['tok.weight', 'head.weight'] are one shared tensor" in out["half_tied"]
        assert "'mha' is an nn.MultiheadAttention" in out["mha"]
        assert "needs plan= for a MLP" in out["no_plan"]
        assert "module 'drop' has dropout 0.1" in out["dropout"]


@pytest.mark.parametrize("sp", [False, True])
def test_gpt_under_dp_and_tp_matches_oracle(ranks, sp):
    want, _ = fns.oracle(False, size=2 * fns.BATCH)
    for got in ranks(4, fns.train_dp_tp, sp, timeout=300):
        assert list(got) == list(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], **TOL, msg=lambda m, k=key: f"{k}: {m}")
