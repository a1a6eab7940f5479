"""Padded batches under the pipeline: ``pipe.step(input_ids, labels, attention_mask=mask)``
(and ``ptdp.step``) equal one process calling ``model(input_ids=, attention_mask=,
labels=)`` on the global batch. Each stage slices its micro-batch's rows of the mask
locally and rebuilds the model's own causal (and sliding-window) masks from them.

Batches: 4 rows of 8 tokens, left- and right-padded rows of different lengths (pads
masked, labels -100 on them), 2 micro-batches, both holding padding. Float64, 3 AdamW
steps with two parameter groups, 2 accumulation micro-steps, ``clip_grad_norm_`` active
on every step. Cases: a Llama under 1F1B and under ZB-H1 with recomputation, a Qwen2
with full and sliding-window layers, a Mixtral without the load-balancing loss (pp 2), a
Llama under PTD-P pp2 x tp2 and pp2 x dp2 (the mask cut into each replica's rows). Also:
the family plans cut in two stages reproduce the model's logits on a padded batch in one
process (GPT-2 included), and the refusals: a plan with a batch loss (Mixtral's
load-balancing loss), plait's GPT, an ``nn.Sequential``, a mask of other rows than the
batch. The models run the SDPA attention (``hf_pipeline_padded_fns.sdpa``: why).

Tolerances: parameters and norms at 1e-8 (float64); losses at 1e-6 (the model's loss
upcasts logits to float32, see tests/test_hf_pipeline.py).
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from tests import hf_pipeline_fns as base  # noqa: E402
from tests import hf_pipeline_padded_fns as fns  # noqa: E402

TOL = {"rtol": 1e-8, "atol": 1e-8}


@functools.cache
def oracle(family: str, average: bool = False) -> dict:
    return fns.oracle(family, average)


def _matches(results: list[dict], want: dict) -> None:
    state: dict[str, torch.Tensor] = {}
    for res in results:
        torch.testing.assert_close(
            torch.tensor(res["losses"]), torch.tensor(want["losses"]), rtol=1e-6, atol=1e-6
        )
        torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(want["norms"]), **TOL)
        assert min(res["norms"]) > base.MAX_NORM  # clipping was active every step
        state.update(res["state"])
    assert set(state) == set(want["state"])
    for key, value in want["state"].items():
        torch.testing.assert_close(state[key], value, **TOL, msg=lambda s, k=key: f"{k}: {s}")


@pytest.mark.parametrize(
    ("family", "schedule", "recompute"),
    [
        ("llama", "1f1b", False),
        ("llama", "zb-h1", True),
        ("qwen2", "1f1b", False),
        ("mixtral", "1f1b", False),
    ],
)
def test_padded_batch_matches_one_process(ranks, family, schedule, recompute):
    results = ranks(2, fns.train, family, schedule, recompute, timeout=120)
    _matches(results, oracle(family))


@pytest.mark.parametrize(("pp", "dp", "tp"), [(2, 1, 2), (2, 2, 1)])
def test_padded_batch_under_ptdp_matches_one_process(ranks, pp, dp, tp):
    results = ranks(4, fns.train_ptdp, pp, dp, tp, timeout=180)
    _matches(results, oracle("llama", average=True))  # PTD-P averages its step calls


def test_the_mask_matters():
    """The oracle's padded run differs from the same ids without the mask: the cases above
    could not pass while ignoring it."""
    model = fns.MODELS["llama"]()
    ids, mask, _ = fns.padded_batch(0)
    with torch.no_grad():
        masked = model(input_ids=ids, attention_mask=mask).logits
        unmasked = model(input_ids=ids).logits
    keep = mask.bool()
    assert (masked[keep] - unmasked[keep]).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral", "qwen2", "mixtral"])
def test_plan_stages_reproduce_the_model_on_a_padded_batch(family):
    """The family's plan cut in two stages, each building its masks from the mask's rows:
    the model's own logits with ``attention_mask`` (one process, float64)."""
    from plait.models.plans import plan_for
    from plait.strategies.pipeline import Stage

    model = fns.MODELS[family]()
    plan = plan_for(model, "pipeline")
    assert plan.inputs[0] == "attention_mask"
    layers = list(plan.layers)
    stages = [
        Stage(c, s, context=plan.context, context_modules=plan.context_modules)
        for s, c in enumerate([layers[:2], layers[2:]])
    ]
    ids, mask, _ = fns.padded_batch(1)
    x = ids
    for stage in stages:
        x = stage(x, attention_mask=mask)
    want = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(x, want, rtol=1e-12, atol=1e-12)


def test_attention_mask_refused_where_the_plan_cannot_honour_it(ranks):
    out = ranks(2, fns.refusals, timeout=120)
    for res in out:
        text = res["batch loss"]
        assert text.startswith("ValueError: pipeline: attention_mask= with "), text
        assert "MixtralForCausalLM's load-balancing loss" in text, text
        assert "config.output_router_logits=False" in text, text
        for key, name in (("gpt", "GPT"), ("sequential", "Sequential")):
            text = res[key]
            assert f"the pipeline plan of {name} has no such per-micro-batch input" in text, text
            assert "inputs=('attention_mask',)" in text, text
        assert "attention_mask= is (2, 8); pass a tensor with the batch's 4 rows" in res["rows"]
        float(res["aux unpadded"])
    assert out[0]["aux unpadded"] == out[1]["aux unpadded"]
