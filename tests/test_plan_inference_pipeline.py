"""Pipeline plans inferred for Hugging Face causal LMs no plait family knows
(:mod:`plait.models.infer_pipeline`): the Llama layout, proven on a forward against the
model's own logits and loss (again with the head scaled to large logits), or refused naming
the difference.

Inferred and trained: OLMo 2 (norms after the sublayers, q/k norms) under 1F1B and Phi-3
under ZB-H1 at pp 2 equal one process on the global batch (float64, 3 AdamW steps with two
parameter groups, 2 accumulation micro-steps, clipping active; parameters and norms 1e-8,
the float32 loss values 1e-6 as in tests/test_hf_pipeline.py). Inferred (the proof
passes): Gemma (its scaled embedding is a module of its own), StableLM. Gemma 2 (soft-capped
logits), Cohere (scaled logits) and Granite with its multipliers fail the Llama layout's proof
and get the plan recorded from their own forward (plait.models.infer_recorded).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from plait.models.plans import plan_for  # noqa: E402
from tests import hf_inferred_fns as fns  # noqa: E402

TOL = {"rtol": 1e-8, "atol": 1e-8}


@pytest.mark.parametrize("family", ["olmo2", "phi3", "gemma", "stablelm"])
def test_llama_layout_models_get_an_inferred_plan(family):
    model = fns.build(family)
    head = model.lm_head.weight.detach().clone()
    plan = plan_for(model, "pipeline")
    assert plan is not None and "inferred: Llama layout" in plan.name
    assert [layer.name for layer in plan.layers] == [
        "embed", "model.layers.0", "model.layers.1", "head",
    ]  # fmt: skip
    assert torch.equal(model.lm_head.weight, head)  # the proof's scaled head restored
    assert model.training  # and the mode


@pytest.mark.parametrize(
    ("family", "extra"),
    [
        ("gemma2", {}),
        ("cohere", {}),
        ("granite", {"embedding_multiplier": 12.0, "logits_scaling": 8.0}),
    ],
)
def test_models_whose_forward_does_more_get_a_recorded_plan(family, extra):
    """Soft-capped logits (Gemma 2), scaled logits (Cohere), multipliers (Granite): the
    Llama layout's plan is refused by its proof, the plan recorded from the model's own
    forward runs them as the model does and passes it."""
    model = fns.build(family, **extra)
    head = model.lm_head.weight.detach().clone()
    plan = plan_for(model, "pipeline")
    assert plan is not None and "recorded from its forward" in plan.name
    assert [layer.name for layer in plan.layers] == [
        "embed", "model.layers.0", "model.layers.1", "head",
    ]  # fmt: skip
    assert torch.equal(model.lm_head.weight, head) and model.training


def test_models_not_shaped_like_a_causal_lm_are_left_to_the_pipeline():
    assert plan_for(nn.Sequential(nn.Linear(2, 2)), "pipeline") is None


@pytest.mark.parametrize(("family", "schedule"), [("olmo2", "1f1b"), ("phi3", "zb-h1")])
def test_inferred_plan_trains_as_one_process(ranks, family, schedule):
    want = fns.oracle(family)
    state: dict[str, torch.Tensor] = {}
    for res in ranks(2, fns.train, family, schedule, timeout=180):
        torch.testing.assert_close(
            torch.tensor(res["losses"]), torch.tensor(want["losses"]), rtol=1e-6, atol=1e-6
        )
        torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(want["norms"]), **TOL)
        state |= res["state"]
    assert set(state) == set(want["state"])
    for key, value in want["state"].items():
        torch.testing.assert_close(state[key], value, **TOL, msg=lambda m, k=key: f"{k}: {m}")
