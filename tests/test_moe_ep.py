"""Expert parallelism: the MoE layer at ep 1, 2 and 4 equals the one-process MoE on the global
batch (same draws, drops, combine weights, outputs and gradients, uneven loads), routing is
proven with a round-robin gate, the all-to-all bytes equal theory, and the MoE GPT under
EP (+ data parallel) equals the oracle after several Adam steps.

Tolerance: float64; experts see their rows in another batch shape and the gradient
averages sum in another order, so results agree to rounding; we allow 1e-10.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests import moe_fns as fns

TOL = 1e-10


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("case", ["top2_random", "top1", "sampling", "dropless"])
def test_layer_matches_one_process(ranks, world, case):
    results = ranks(world, fns.layer_vs_oracle, case, 2, timeout=120)
    local = fns.E // world
    for r, res in enumerate(results):
        assert res["y"] < TOL and res["xgrad"] < TOL and res["grads"] < TOL, res
        held = {n.split(".")[1] for n in res["names"] if n.startswith("experts.")}
        assert held == {str(e) for e in range(r * local, (r + 1) * local)}
        for got, want in res["kept"] + res["routed"]:
            assert got == want  # the same tokens kept and dropped, expert by expert
    routed = results[0]["routed"][0][1]
    kept = results[0]["kept"][0][1]
    assert max(routed) > min(routed)  # uneven loads
    if case == "dropless":
        assert kept == routed
    else:
        assert sum(kept) < sum(routed)  # something was dropped


@pytest.mark.parametrize("world", [2, 4])
def test_round_robin_gate_proves_routing(ranks, world):
    local = fns.E // world
    p = math.exp(30.0) / (math.exp(30.0) + fns.E - 1)  # the round-robin gate's probability
    for r, res in enumerate(ranks(world, fns.round_robin, timeout=60)):
        assert res["held"] == [str(e) for e in range(r * local, (r + 1) * local)]
        owner = torch.tensor([(s % fns.E) // local + 1.0 for s in range(fns.SEQ)])
        want = (p * owner).to(torch.float64).expand(2, fns.SEQ)
        torch.testing.assert_close(res["y"], want, rtol=1e-12, atol=1e-12)
        assert res["kept"] == [2 * world * fns.SEQ // fns.E] * fns.E


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_bytes_equal_theory(ranks, world):
    results = ranks(world, fns.bytes_per_step, "top2_random", timeout=60)
    for res in results:
        assert res["calls"] == 4  # dispatch + combine forward, their reverses backward
        assert res["sent"] == res["theory"] > 0, res
    assert sum(r["n_out"] for r in results) == sum(r["n_in"] for r in results)


@pytest.mark.parametrize(("world", "dp"), [(2, 1), (4, 2)])
def test_moe_gpt_under_ep_matches_oracle(ranks, world, dp):
    want, want_loads = fns.gpt_oracle(world * fns.PER_RANK)
    results = ranks(world, fns.gpt_ep, dp, timeout=180)
    for res in results:
        got = res["state"]
        assert set(got) <= set(want)
        dense = [k for k in want if ".experts." not in k]
        assert all(k in got for k in dense)
        for key, value in got.items():
            torch.testing.assert_close(
                value, want[key], rtol=TOL, atol=TOL, msg=lambda m, k=key: f"{k}: {m}"
            )
    # loads are counted over an ep group, which sees 1/dp of the batch: the dp replicas
    # (ranks 0, ep, 2 ep, ...: Mesh puts ep innermost) add up to the oracle's
    ep = world // dp
    summed = [
        [sum(results[d * ep]["loads"][s][e] for d in range(dp)) for e in range(4)]
        for s in range(fns.STEPS)
    ]
    assert summed == want_loads


@pytest.mark.parametrize(("world", "dp"), [(2, 1), (4, 2)])
def test_moe_gpt_under_ep_accumulates_as_one_process(ranks, world, dp):
    """2 accumulation micro-steps (each loss / 2), two AdamW groups, global-norm clipping
    active: equal to one process accumulating over the same micro-batches."""
    want, want_norms = fns.gpt_acc_oracle(world)
    assert all(n > fns.MAX_NORM for n in want_norms)  # clipping was active
    for res in ranks(world, fns.gpt_ep_acc, dp, timeout=180):
        torch.testing.assert_close(res["norms"], want_norms, rtol=TOL, atol=0)
        for key, value in res["state"].items():
            torch.testing.assert_close(
                value, want[key], rtol=TOL, atol=TOL, msg=lambda m, k=key: f"{k}: {m}"
            )


def test_refusals_name_what_to_change(ranks):
    for out in ranks(2, fns.refusals, timeout=60):
        assert "num_experts=3, not divisible by the expert-parallel size ep=2" in out["ratio"]
        assert "has no plait.moe.MoE layer" in out["no_moe"]
        assert "composes with 'dp' only" in out["tp"]


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_nonfinite_gradient_is_named_on_every_rank(ranks, policy):
    for out in ranks(2, fns.nonfinite, policy, timeout=120):
        if policy == "raise":
            assert out["error"] is not None
            assert "rank 1 in parameter 'blocks.1.ln1.weight'" in out["error"]
        else:
            assert out["error"] is None and out["unchanged"]


@pytest.mark.parametrize("world", [2, 4])
def test_gather_rows_uneven(ranks, world):
    for out in ranks(world, fns.gather_uneven, timeout=60):
        assert out == {"equal": True, "grad": True}


def test_different_models_are_refused_at_wrap(ranks):
    for out in ranks(2, fns.structure_mismatch, timeout=60):
        assert (
            out.startswith("expert_parallel: the ranks of group")
            and "rank 1 differs from rank 0" in out
        ), out
