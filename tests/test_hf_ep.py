"""Expert parallelism on Hugging Face MoE models handed over whole (tests/hf_ep_fns.py):
Mixtral, Qwen2-MoE (shared expert, weights not renormalised) and Qwen3-MoE (renormalised)
under ``plait.prepare(strategy="ep")`` with ``Mesh(ep=2)`` and ``Mesh(ep=2, dp=2)`` equal the
one-process oracle on the global batch: float64, 3 AdamW steps with two parameter groups, 2
accumulation micro-steps, the model's load-balancing loss on, global-norm clipping active.

Tolerance 1e-8: experts see their rows in other batch shapes and gradients add in another
order, so results agree to rounding (the router softmax and the load-balancing loss run in
float32 inside the model, in both runs).
"""

from __future__ import annotations

import pytest
import torch

from tests import hf_ep_fns as fns

pytest.importorskip("transformers")

TOL = 1e-8


def _check(results: list[dict], want: dict) -> None:
    w = len(results)
    for res in results:
        assert res["groups"][0] > 0 and res["groups"][1] > 0
        assert res["weight_decay"] == [0.1, 0.0]  # per-group hyper-parameters kept
        # clipping was active, and every rank got the one-process (global) norm
        assert all(n > fns.MAX_NORM for n in want["norms"])
        torch.testing.assert_close(res["norms"], want["norms"], rtol=TOL, atol=0)
        p, r = res["ep"], res["ep_rank"]
        for key, value in res["state"].items():
            full = want["state"][key].detach()
            if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                local = full.shape[0] // p
                assert value.shape[0] == local  # this rank keeps E/p experts
                full = full[r * local : (r + 1) * local]
            torch.testing.assert_close(
                value, full, rtol=TOL, atol=TOL, msg=lambda m, k=key: f"{k}: {m}"
            )
    # each rank's loss is its own tokens' cross-entropy + the global load-balancing loss;
    # the model computes both in float32 (its loss upcasts the logits), hence float32's
    # rounding here, while the parameters above agree to 1e-8
    mean = [sum(res["losses"][s] for res in results) / w for s in range(fns.STEPS)]
    torch.testing.assert_close(mean, want["losses"], rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("family", "world", "dp"),
    [("mixtral", 2, 1), ("mixtral", 4, 2), ("qwen2_moe", 2, 1), ("qwen3_moe", 4, 2)],
)
def test_hf_moe_under_ep_matches_one_process(ranks, family, world, dp):
    want = fns.oracle(family, world)
    _check(ranks(world, fns.run_ep, family, dp, timeout=240), want)


def test_hf_gradient_checkpointing_under_ep_matches_one_process(ranks):
    want = fns.oracle("mixtral", 2)
    _check(ranks(2, fns.run_ep, "mixtral", 1, True, timeout=240), want)


def test_refusals_name_what_to_change(ranks):
    for out in ranks(2, fns.refusals, timeout=120):
        assert "num_experts=3, not divisible by the expert-parallel size ep=2" in out["odd"]
        assert "attention_mask= is not supported while the auxiliary loss is on" in out["masked"]
        assert "no known MoE plan" in out["no_plan"]
