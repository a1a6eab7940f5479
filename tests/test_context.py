"""Context parallelism (ring attention, Ulysses) against one process on the whole
sequence in float64: attention alone (output, dq, dk, dv), plait's GPT and a Hugging Face
Llama under ``plait.prepare(strategy="cp")`` (loss, every parameter's gradient, parameters
after Adam steps), cp x dp, the bytes per attention layer against the formula, the causal
load balance, and the refusals."""

from __future__ import annotations

import pytest

from plait.strategies.context import imbalance, ring_work
from tests import context_fns as fns

TOL = 1e-10
CASES = [(True, True), (True, False), (False, True)]  # (causal, balanced)
pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_balanced_layout_gives_every_rank_the_same_causal_work(cp):
    balanced = ring_work(cp, causal=True, balanced=True)
    contiguous = ring_work(cp, causal=True, balanced=False)
    assert [sum(row) for row in balanced] == [2 * cp + 1] * cp
    assert [sum(row) for row in contiguous] == [4 * r + 3 for r in range(cp)]
    assert imbalance(balanced)["max_over_mean"] == 1.0
    assert imbalance(contiguous)["max_over_mean"] == pytest.approx((4 * cp - 1) / (2 * cp + 1))
    # both layouts compute the whole lower triangle of chunk pairs once
    total = 2 * cp * (2 * cp + 1) // 2
    assert sum(map(sum, balanced)) == sum(map(sum, contiguous)) == total
    assert [sum(row) for row in ring_work(cp, causal=False, balanced=True)] == [4 * cp] * cp


@pytest.mark.parametrize("kernel", ["ring", "ulysses"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize(("causal", "balanced"), CASES)
def test_attention_matches_one_process(ranks, kernel, cp, causal, balanced):
    results = ranks(cp, fns.attention_vs_oracle, kernel, 16, causal, balanced, timeout=120)
    want_work = [sum(row) for row in ring_work(cp, causal=causal, balanced=balanced)]
    for r, res in enumerate(results):
        assert res["out"] < TOL and max(res["grads"]) < TOL, res
        if kernel == "ring":
            assert res["work"] == want_work[r]  # the pairs the kernel computed


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize(("causal", "balanced"), CASES)
def test_ring_reference_arithmetic_matches_one_process(ranks, cp, causal, balanced):
    """The plain arithmetic the fused CPU kernel replaces (the path off CPU)."""
    for res in ranks(cp, fns.attention_vs_oracle, "ring", 16, causal, balanced, 2, False):
        assert res["out"] < TOL and max(res["grads"]) < TOL, res


@pytest.mark.parametrize("kernel", ["ring", "ulysses"])
@pytest.mark.parametrize("cp", [2, 4])  # kv heads 2: split at cp 2, repeated at cp 4 (Ulysses)
def test_grouped_query_attention_matches_one_process(ranks, kernel, cp):
    for res in ranks(cp, fns.attention_vs_oracle, kernel, 16, True, True, 2, timeout=120):
        assert res["out"] < TOL and max(res["grads"]) < TOL, res


@pytest.mark.parametrize("cp", [2, 4])
def test_bytes_per_attention_layer_equal_the_formula(ranks, cp):
    for res in ranks(cp, fns.attention_vs_oracle, "ring", 16, True, True, timeout=120):
        # K and V of every other rank forward; again (recompute) and dK/dV home in backward
        kv = res["kv_bytes"]
        assert res["sent"] == {
            "cp_kv": (cp - 1) * kv,
            "cp_kv_bwd": (cp - 1) * kv,
            "cp_dkv": (cp - 1) * kv,
        }
        assert res["calls"] == {"cp_kv": cp - 1, "cp_kv_bwd": cp - 1, "cp_dkv": cp - 1}
    for res in ranks(cp, fns.attention_vs_oracle, "ulysses", 16, True, True, timeout=120):
        # q, k, v, out forward and their gradients backward: each sends all but its own block
        assert res["calls"] == {"all_to_all": 8}
        assert res["sent"] == {"all_to_all": 8 * res["q_bytes"] * (cp - 1) // cp}


MODEL_CASES = [(2, "ring", True), (2, "ulysses", False), (4, "ring", False), (4, "ulysses", True)]


def _check(results, want):
    for res in results:
        assert max(abs(a - b) for a, b in zip(res["losses"], want["losses"], strict=True)) < 1e-10
        for name, g in want["grads"].items():
            assert float((res["grads"][name] - g).abs().max()) < TOL, name
        for name, v in want["state"].items():
            assert float((res["state"][name] - v).abs().max()) < 1e-8, name


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize(("world", "context", "balanced"), MODEL_CASES)
def test_model_under_cp_matches_one_process(ranks, family, world, context, balanced):
    want = fns.model_oracle(family, 1)
    _check(ranks(world, fns.model_under_cp, family, context, balanced, 1, timeout=240), want)


@pytest.mark.parametrize(("family", "context"), [("gpt", "ring"), ("llama", "ulysses")])
def test_cp_with_dp_matches_one_process(ranks, family, context):
    want = fns.model_oracle(family, 2)
    _check(ranks(4, fns.model_under_cp, family, context, True, 2, timeout=240), want)


@pytest.mark.parametrize(
    ("family", "context"), [("gpt", "ring"), ("gpt", "ulysses"), ("llama", "ring")]
)
def test_cp_with_tp_matches_one_process(ranks, family, context):
    want = fns.model_oracle(family, 1)
    want["grads"] = {}  # gradients live on tp shards: the parameters after the steps compare
    _check(ranks(4, fns.cp_tp, family, context, timeout=240), want)


def test_bad_input_is_refused_by_name(ranks):
    for got in ranks(2, fns.refusals, timeout=120):
        assert "10 tokens is not divisible by 2 * cp = 4" in got["uneven"]
        assert "3 attention heads, not divisible by cp=2" in got["ulysses_heads"]
        assert "no module of Linear calls" in got["no_attention"]
        assert "positions=" in got["no_positions"]
        assert "context='x'" in got["context"]
        assert "'cp' dimension" in got["no_cp"]
        assert "needs position_ids" in got["hf_positions"]
        assert "padding attention_mask" in got["hf_padding"]
        assert "sliding_window=4" in got["sliding_window"]
        assert "holds 3 tokens, not two equal chunks" in got["odd_tokens"]
        assert "has dimensions ['pp']" in got["pp_in_cp"]
        assert "the pipeline alone runs whole sequences" in got["cp_in_pipeline"]
        assert "strategy 'ptdp'" in got["cp_in_pipeline"] and "strategy 'ptdp'" in got["pp_in_cp"]
