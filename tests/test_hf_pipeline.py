"""Hugging Face models handed whole to ``plait.prepare(strategy="pipeline")`` equal one
process on the global batch: a tiny LlamaForCausalLM (grouped-query attention, RoPE,
RMSNorm; untied and tied) under 1F1B and the zero-bubble ZB-H1 at pp 2, float64, the
model's own ``labels=`` loss with ignored labels spread unevenly over micro-batches,
AdamW with two parameter groups (per-group lr and weight decay kept), 2 accumulation
micro-steps per step, ``plait.clip_grad_norm_`` active (max_norm below every norm);
3 optimizer steps. Also: a rank on another schedule is named on every rank at wrap time
(pp 4), and a NaN out of one stage raises (or skips) on every rank, naming it.

Tolerances: parameters and gradient norms at 1e-8 (float64; observed ~1e-15). The
losses are Hugging Face's: its causal-LM loss upcasts logits with ``.float()``, so the
loss *value* is float32 and its summation order differs between micro-batches and the
whole batch: compared at 1e-6. Its gradient is the same per element either way (the
softmax of each row, times 1/N), so the parameters still match in float64.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from tests import hf_pipeline_fns as fns  # noqa: E402

TOL = {"rtol": 1e-8, "atol": 1e-8}


@functools.cache
def oracle(family: str, tied: bool) -> dict:
    return fns.oracle(family, tied)


@pytest.mark.parametrize(
    ("family", "tied", "schedule"),
    [
        ("llama", False, "1f1b"),
        ("llama", False, "zb-h1"),
        ("llama", True, "1f1b"),
        ("gpt2", True, "zb-h1"),
    ],
)
def test_hf_model_whole_matches_one_process(ranks, family, tied, schedule):
    want = oracle(family, tied)
    results = ranks(2, fns.train, family, tied, schedule, 2, timeout=180)
    state: dict[str, torch.Tensor] = {}
    for res in results:
        assert res["groups"][0]["weight_decay"] == 0.1 and res["groups"][0]["lr"] == 1e-2
        assert res["groups"][1]["weight_decay"] == 0.0 and res["groups"][1]["lr"] == 2e-2
        torch.testing.assert_close(
            torch.tensor(res["losses"]), torch.tensor(want["losses"]), rtol=1e-6, atol=1e-6
        )
        torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(want["norms"]), **TOL)
        assert min(res["norms"]) > fns.MAX_NORM  # clipping was active every step
        for key, value in res["state"].items():
            if key in state:  # a tied weight on the first and the last stage
                torch.testing.assert_close(value, state[key], rtol=0, atol=0)
            state[key] = value
    assert "stage 0 (rank 0): embed" in results[0]["partition"]
    if schedule == "zb-h1":  # the modules plait has no split rule for are named
        unknown = {"llama": "LlamaRMSNorm", "gpt2": "Conv1D"}[family]
        for rank, res in enumerate(results):
            assert f"({unknown}: plait has no split rule for it)" in res["split"][rank]
    # every key of the model, each where the whole model has it
    missing = set(want["state"]) - set(state)
    assert missing <= ({"lm_head.weight", "transformer.wte.weight"} if tied else set()), missing
    for key, value in want["state"].items():
        got = state.get(key, state.get(fns.EMBEDDING[family]))
        assert got is not None, key
        torch.testing.assert_close(got, value, **TOL, msg=lambda s, k=key: f"{k}: {s}")


@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral", "qwen2", "qwen3"])
def test_plan_stages_reproduce_the_model(family):
    """The family's plan, cut in two stages that each rebuild rotary embeddings and the
    (full or sliding-window) causal mask from the positions: the model's own logits in
    float64 (one process, no ranks; 1e-12 allows a BLAS that blocks another way)."""
    from plait.models.plans import plan_for
    from plait.strategies.pipeline import Stage

    model = fns.MODELS[family](True) if family in fns.MODELS else fns.same_layout(family)
    plan = plan_for(model, "pipeline")
    layers = list(plan.layers)
    cut = [layers[:2], layers[2:]]
    stages = [
        Stage(c, s, context=plan.context, context_modules=plan.context_modules)
        for s, c in enumerate(cut)
    ]
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    x = ids
    for stage in stages:
        x = stage(x)
    torch.testing.assert_close(x, model(input_ids=ids).logits, rtol=1e-12, atol=1e-12)
    keys = {k for stage in stages for k in stage.state_dict()}
    assert keys == set(model.state_dict())


@pytest.mark.faults
def test_rank_on_another_schedule_is_named_on_every_rank(ranks):
    out = ranks(4, fns.disagree, 2, timeout=60)
    for r, text in enumerate(out):
        assert text.startswith("PipelineMismatchError"), (r, text)
        assert "schedule: rank 0 has '1f1b', rank 2 has 'gpipe'" in text, (r, text)


@pytest.mark.faults
@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_nan_out_of_one_stage_stops_every_rank(ranks, policy):
    out = ranks(2, fns.nonfinite, policy, 1, timeout=120)
    for r, res in enumerate(out):
        text = res["error"] if policy == "raise" else res["message"]
        assert text is not None, (r, res)
        assert "rank 1 (pp rank 1) holds a non-finite value in parameter" in text, (r, text)
        assert "'model.layers.1.mlp.up_proj.weight' (stage 1)" in text, (r, text)
        assert "stage 1 produced a non-finite output in micro-batch 0" in text, (r, text)
        if policy == "raise":
            assert text.startswith("NonFiniteGradientError"), (r, text)
        else:
            assert res["skipped"] == 1 and res["grads_none"] and res["unchanged"], (r, res)
    if policy == "skip":
        assert out[0]["next_loss"] == out[1]["next_loss"]
        assert torch.isfinite(torch.tensor(out[0]["next_loss"]))
