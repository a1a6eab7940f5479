"""The proof behind an inferred tensor-parallel plan covers the whole model
(plait.models.verify_plan): every kind of block, forward and backward, on simulated ranks
in one process (no rank pool)."""

from __future__ import annotations

import threading

import pytest
import torch

from plait.models import simulate_ranks
from plait.models.infer import PlanInferenceError, infer_tp_plan
from tests import zoo_planted


def test_a_plan_right_on_block_0_and_wrong_on_block_3_is_refused():
    model = zoo_planted.planted(mixed=3)
    with pytest.raises(PlanInferenceError) as info:
        infer_tp_plan(model, tp=2)
    text = str(info.value)
    assert "does not reproduce block 3 of 'layers'" in text
    assert "self_attn.mix_heads=True (block 0: False)" in text  # how its kind differs
    assert "its output differs" in text


def test_the_same_model_without_the_mixing_block_is_proven():
    plan = infer_tp_plan(zoo_planted.planted(mixed=-1), tp=2)
    assert plan.styles["layers.*.self_attn.o_proj"] == "rowwise"
    assert not any(getattr(s, "kind", s) == "per_head" for s in plan.styles.values())


def test_a_wrong_first_block_is_refused_before_the_others():
    with pytest.raises(PlanInferenceError, match="no split of block 'layers.0.self_attn'"):
        infer_tp_plan(zoo_planted.planted(mixed=0), tp=2)


def test_gemma3_per_head_norms_are_summed():
    """Gemma 3's q_norm/k_norm act on each rank's heads: right forward, partial gradients.
    The proof finds that their sum over the ranks is the dense gradient and gives them the
    "per_head" style (which sums them); the first block alone, forward only, did not."""
    pytest.importorskip("transformers")
    from tests import zoo_fns

    model = zoo_fns.build("gemma3")
    plan = infer_tp_plan(model, tp=2)
    for norm in ("q_norm", "k_norm"):
        assert plan.styles[f"model.layers.*.self_attn.{norm}"] == "per_head"
    # the scaled embedding (its own forward) and the head tied to it stay whole
    assert "model.embed_tokens" not in plan.styles and "lm_head" not in plan.styles


def test_attention_sinks_are_split_with_their_heads():
    """GPT-OSS's attention sinks: one learned logit per head, held by the attention module
    itself: split with the heads (a whole copy would give a rank the wrong heads' sinks, or
    the wrong count); its sparse blocks stay whole on every rank."""
    pytest.importorskip("transformers")
    from tests import zoo_fns

    plan = infer_tp_plan(zoo_fns.build("gpt_oss"), tp=2)
    (heads,) = plan.attention
    assert heads.head_params == ("sinks",)
    assert not any("experts" in k or "router" in k for k in plan.styles)


def test_simulated_ranks_meet_at_every_collective():
    """A rank whose forward makes one collective fewer is found, not waited on forever."""
    bus = simulate_ranks._Bus(2)
    bus.barrier = threading.Barrier(2, timeout=0.5)
    errors = []

    def rank(r: int) -> None:
        try:
            for _ in range(2 - r):
                bus.all_reduce(r, torch.ones(2))
        except Exception as exc:  # noqa: BLE001
            errors.append(type(exc).__name__)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert errors == ["BrokenBarrierError"]
