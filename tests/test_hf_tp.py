"""Tensor parallelism on a Hugging Face LlamaForCausalLM handed over whole to
``plait.prepare(model, opt, strategy="tp", mesh=Mesh(tp=t))``: the plan comes from the
model's family, the model's own forward returns the full logits and its ``labels=`` loss,
the AdamW optimizer keeps its two parameter groups, ``plait.clip_grad_norm_`` is global.

Compared with one process on the same global batch in float64 after 3 steps of 2
accumulation micro-steps with clipping active: the ranks sum partial products in another
order than the dense matmuls (observed differences ~1e-16..1e-14); we allow 1e-8.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tests import hf_tp_fns as fns  # noqa: E402

TOL = {"rtol": 1e-8, "atol": 1e-8}


def _same(got: dict, want: dict) -> None:
    torch.testing.assert_close(got["losses"], want["losses"], **TOL)
    torch.testing.assert_close(got["norms"], want["norms"], **TOL)
    assert all(n > fns.MAX_NORM for n in want["norms"])  # clipping acted on every step
    assert got["logits0"].shape[-1] == fns.VOCAB  # the full logits, padding cut off
    assert got["logits0"].shape == want["logits0"].shape
    torch.testing.assert_close(got["logits0"], want["logits0"], **TOL)
    assert list(got["state"]) == list(want["state"])
    for key, value in want["state"].items():
        assert got["state"][key].shape == value.shape, key
        torch.testing.assert_close(
            got["state"][key], value, **TOL, msg=lambda m, k=key: f"{k}: {m}"
        )


@pytest.mark.parametrize(("world", "tied", "kv_heads"), [(2, True, 2), (4, False, 2)])
def test_llama_tp_matches_one_process(ranks, world, tied, kv_heads):
    want = fns.oracle(tied=tied, kv_heads=kv_heads)
    for res in ranks(world, fns.train, tied=tied, kv_heads=kv_heads, timeout=300):
        _same(res, want)
        assert res["groups"][1] == 2 * 2 + 1  # two RMSNorms per layer and the final norm
        assert res["hyper"] == [(1e-2, 0.1), (3e-3, 0.0)]
        assert res["tied"] == tied
        # 4 query heads and 2 key/value heads: split at t = 2; at t = 4 each rank keeps the
        # key/value projections whole and computes the one head its query head reads
        assert res["kv_groups"] == (2 if world == 2 else 1)
        assert res["k_proj"] == ("ColumnParallelLinear" if world == 2 else "HeadSelectLinear")
        local, dense = res["local_numel"], res["dense_numel"]
        assert (
            local["model.layers.0.mlp.up_proj.weight"] * world
            == dense["model.layers.0.mlp.up_proj.weight"]
        )
        assert local["model.embed_tokens.weight"] == -(-fns.VOCAB // world) * 32


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_sequence_parallel_matches_one_process(ranks, family):
    """tp + sp: the RMSNorms on 1/t of the sequence (their gradients summed), each attention
    gathering the whole sequence for its own reshape, full logits out; Qwen3's per-head
    q_norm / k_norm with their gradients summed over the group."""
    want = fns.oracle(family=family, tied=False)
    results = ranks(2, fns.train, family=family, tied=False, sequence_parallel=True, timeout=300)
    for res in results:
        _same(res, want)
        assert res["sequence_parallel"]


def test_gpt2_tp_matches_one_process(ranks):
    """GPT-2's Conv1D layers split as the transposed linears they are, the fused c_attn
    per query / key / value part; the state comes back in Conv1D's own layout."""
    want = fns.oracle(family="gpt2", tied=True)
    for res in ranks(2, fns.train, family="gpt2", tied=True, timeout=300):
        _same(res, want)
        assert res["tied"] and res["split_size"] == 16  # this rank's query width
        assert res["hyper"] == [(1e-2, 0.1), (3e-3, 0.0)]
        local, dense = res["local_numel"], res["dense_numel"]
        for name in ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.bias"):
            key = f"transformer.h.1.{name}"
            assert local[key] * 2 == dense[key], key


@pytest.mark.parametrize(("world", "kv_heads"), [(2, 2), (4, 2)])
def test_torchtitan_shaped_llama_matches_one_process(ranks, world, kv_heads):
    """torchtitan's Llama 3 layout: subclassed Linear / Embedding, a complex RoPE buffer,
    per-head q/k norms, grouped-query attention (split at t = 2, kept whole at t = 4)."""
    want = fns.oracle(family="titan", tied=False, kv_heads=kv_heads)
    for res in ranks(world, fns.train, family="titan", tied=False, kv_heads=kv_heads, timeout=300):
        _same(res, want)
        assert res["kv_groups"] == (2 if world == 2 else 1)
        assert res["k_proj"] == ("ColumnParallelLinear" if world == 2 else "HeadSelectLinear")


@pytest.mark.faults
def test_ranks_seeded_apart_are_refused_by_name(ranks):
    for text in ranks(2, fns.seeded_apart, timeout=120):
        assert "parameter 'model.embed_tokens.weight' differs across the tensor-parallel" in text
        assert "rank 0 has sum" in text and "rank 1 has sum" in text
        assert "seed it identically" in text


def test_refusals_name_what_to_change(ranks):
    for out in ranks(2, fns.refusals, timeout=120):
        assert "has 3 key/value heads and the tensor-parallel size is 2" in out["kv"]
        assert "model.layers.*.self_attn" in out["kv"]
        assert "needs plan= for a Phi3ForCausalLM" in out["no_plan"]
        assert "'colwise'" in out["no_plan"]
        assert (
            "'layers.0.feed_forward.w1' is a _ScaledLinear, a subclass of nn.Linear with its "
            "own forward" in out["own_forward"]
        )


@pytest.mark.faults
def test_nonfinite_gradient_on_one_rank_raises_or_skips_on_every_rank(ranks):
    for out in ranks(2, fns.nonfinite, "raise", timeout=120):
        assert "rank 1 in parameter 'model.layers.1.mlp.up_proj.weight'" in out["error"]
        assert "every rank raises" in out["error"]
    for out in ranks(2, fns.nonfinite, "skip", timeout=120):
        assert out == {"unchanged": True, "skipped": 1}
