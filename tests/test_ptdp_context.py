"""Context parallelism inside PTD-P (:mod:`plait.strategies.compose.context`): plait's GPT
on a mesh with ``cp`` (the sequence split in every pipeline stage, each stage's attention
ring or Ulysses over the cp group, gradients and loss averaged over dp x cp) equals one
process on the whole sequences after 3 Adam steps: pp2 x cp2 (ring balanced, ring
contiguous, Ulysses), tp2 x cp2 (pp 1), pp2 x tp2 x cp2 with sequence parallelism, float64
(parameters 1e-8, losses 1e-10). Hugging Face's Llama and its own loss too. The
compositions it does not support are refused by name."""

from __future__ import annotations

import functools

import pytest
import torch

from tests import context_fns
from tests import ptdp_context_fns as fns

TOL = {"rtol": 1e-8, "atol": 1e-8}


@functools.cache
def oracle(dp: int) -> dict:
    return context_fns.model_oracle("gpt", dp)


@pytest.mark.parametrize(
    ("mesh", "context", "balanced"),
    [
        ({"pp": 2, "dp": 1, "tp": 1, "cp": 2}, "ring", True),
        ({"pp": 2, "dp": 1, "tp": 1, "cp": 2}, "ring", False),
        ({"pp": 2, "dp": 1, "tp": 1, "cp": 2}, "ulysses", True),
        ({"pp": 1, "dp": 1, "tp": 2, "cp": 2}, "ring", True),
        ({"pp": 2, "dp": 1, "tp": 2, "cp": 2}, "ring", True),
    ],
    ids=[
        "pp2xcp2-ring",
        "pp2xcp2-ring-contiguous",
        "pp2xcp2-ulysses",
        "tp2xcp2-ring",
        "pp2xtp2xcp2-ring-sp",
    ],
)
def test_gpt_with_cp_inside_ptdp_matches_one_process(ranks, mesh, context, balanced):
    want = oracle(mesh["dp"])
    sp = mesh["tp"] > 1 and mesh["pp"] > 1  # the 8-rank case with sequence parallelism
    world = mesh["pp"] * mesh["tp"] * mesh["cp"]
    for res in ranks(world, fns.run, mesh, context, balanced, 2, sp, timeout=240):
        # the pipeline ran this rank's SEQ / cp tokens and the attention talked over cp
        assert res["shapes"] == [(context_fns.BATCH // 2, context_fns.SEQ // 2)], res["shapes"]
        assert res["sent"] > 0  # bytes on this rank's cp group
        torch.testing.assert_close(
            torch.tensor(res["losses"]), torch.tensor(want["losses"]), rtol=1e-10, atol=1e-10
        )
        assert set(res["state"]) == set(want["state"])
        for key, value in want["state"].items():
            torch.testing.assert_close(
                res["state"][key], value, **TOL, msg=lambda m, k=key: f"{k}: {m}"
            )


def test_what_cp_inside_ptdp_does_not_compose_is_refused(ranks):
    mesh = {"pp": 2, "dp": 1, "tp": 1, "cp": 2}
    for text in ranks(4, fns.refused, mesh, zero=1, timeout=120):
        assert "cp=2" in text and "zero=1" in text, text


def test_a_nonfinite_gradient_under_cp_stops_every_rank(ranks):
    for text in ranks(4, fns.nonfinite, 1, timeout=120):
        assert text.startswith("NonFiniteGradientError"), text


@functools.cache
def hf_oracle(dp: int) -> dict:
    return fns.hf_oracle(dp)


@pytest.mark.parametrize(
    ("mesh", "context"),
    [
        ({"pp": 2, "dp": 1, "tp": 1, "cp": 2}, "ring"),
        ({"pp": 2, "dp": 1, "tp": 1, "cp": 2}, "ulysses"),
        ({"pp": 1, "dp": 2, "tp": 1, "cp": 2}, "ring"),
        ({"pp": 2, "dp": 1, "tp": 2, "cp": 2}, "ring"),
    ],
    ids=["pp2xcp2-ring", "pp2xcp2-ulysses", "dp2xcp2-ring", "pp2xtp2xcp2-ring"],
)
def test_hf_llama_with_cp_inside_ptdp_matches_one_process(ranks, mesh, context):
    """Hugging Face's own labels= loss (labels shifted inside, items counted over the batch,
    a quarter of them ignored): PTD-P shifts the labels over the whole sequence, counts the
    items of the global batch and gives each stage the rank's global positions. Losses at
    1e-6: Hugging Face's loss upcasts the logits to float32 (tests/test_hf_ptdp.py)."""
    want = hf_oracle(mesh["dp"])
    world = mesh["pp"] * mesh["dp"] * mesh["tp"] * mesh["cp"]
    for res in ranks(world, fns.hf_run, mesh, context, True, timeout=300):
        assert res["shapes"] == [(context_fns.BATCH // 2, context_fns.SEQ // 2)], res["shapes"]
        assert res["sent"] > 0
        torch.testing.assert_close(
            torch.tensor(res["losses"]), torch.tensor(want["losses"]), rtol=1e-6, atol=1e-6
        )
        assert set(res["state"]) == set(want["state"])
        for key, value in want["state"].items():
            torch.testing.assert_close(
                res["state"][key], value, **TOL, msg=lambda m, k=key: f"{k}: {m}"
            )


def test_what_cp_inside_ptdp_refuses_for_hf_models(ranks):
    for text in ranks(4, fns.hf_refused, "gpt2", timeout=120):
        assert "cp=2" in text and "shifts its labels itself" in text, text
        assert "shifted_loss=" in text, text
    for text in ranks(4, fns.hf_refused, "padding", timeout=120):
        assert "padding attention_mask" in text, text
    for text in ranks(4, fns.hf_refused, "positions", timeout=120):
        assert "drop position_ids" in text, text
