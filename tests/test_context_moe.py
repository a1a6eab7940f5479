"""Hugging Face MoE models under context parallelism (``plait.prepare(strategy="cp")``) with
their load-balancing loss on, against one process on the whole sequences: Mixtral cp2 ring,
Qwen2-MoE (shared expert) cp2 Ulysses, Mixtral cp2 x dp2, Qwen3-MoE cp2 x tp2 with sequence
parallelism; and the refusals.

Each run: float64, 3 AdamW steps; the loss trained is ``mean CE + coef * aux`` in float64
(tests/context_moe_fns.py), ``aux`` read from the router logits the model recorded (under
cp: gathered over the ranks by plait). Compared: that total within 1e-10 every step, the
auxiliary loss alone, the model's own float32 loss within 1e-6, the router weight's gradient
of the first step within 1e-10, every parameter after the steps within 1e-8.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from tests import context_moe_fns as fns  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@functools.cache
def oracle(family: str, dp: int) -> dict:
    return fns.oracle(family, dp)


def _same(results: list[dict], want: dict) -> None:
    for rank, res in enumerate(results):
        for got, ref in zip(res["losses"], want["losses"], strict=True):
            assert abs(got - ref) < 1e-10, (rank, res["losses"], want["losses"])
        for got, ref in zip(res["aux"], want["aux"], strict=True):
            assert abs(got - ref) < 1e-10, (rank, res["aux"], want["aux"])
        for got, ref in zip(res["hf"], want["hf"], strict=True):
            assert abs(got - ref) < 1e-6, (rank, res["hf"], want["hf"])
        assert res["grads"], "no gradient compared"
        for name, g in res["grads"].items():
            assert float((g - want["grads"][name]).abs().max()) < 1e-10, (rank, name)
        assert set(res["state"]) == set(want["state"])
        for name, value in want["state"].items():
            torch.testing.assert_close(res["state"][name], value, rtol=0, atol=1e-8)


@pytest.mark.parametrize(
    ("family", "context", "dp", "tp", "sp"),
    [
        ("mixtral", "ring", 1, 1, False),
        ("qwen2_moe", "ulysses", 1, 1, False),
        ("mixtral", "ring", 2, 1, False),
        ("qwen3_moe", "ring", 1, 2, True),  # logits gathered over tp x cp, scaled 1/tp
    ],
    ids=["mixtral-cp2-ring", "qwen2_moe-cp2-ulysses", "mixtral-cp2xdp2", "qwen3_moe-cp2xtp2-sp"],
)
def test_moe_with_load_balancing_loss_matches_one_process(ranks, family, context, dp, tp, sp):
    want = oracle(family, dp)
    router = fns.ROUTER[family]
    assert float(want["grads"][router].abs().max()) > 1e-3  # the aux loss moves the router
    world = 2 * dp * tp
    results = ranks(world, fns.train, family, context, dp, tp, sp, timeout=240)
    _same(results, want)
    assert all(router in res["grads"] for res in results)


def test_the_per_rank_load_balancing_loss_is_not_the_batch_one():
    """Why plait gathers: the model's auxiliary loss on each cp rank's tokens (its chunks of
    every sequence, cp=2), averaged, is another number than on the whole batch, so cp
    without the gathering would train on it."""
    from plait.strategies.context import positions

    model = fns.build("mixtral")
    ids, _ = fns.tokens(0, fns.BATCH)
    pos = torch.arange(fns.SEQ).unsqueeze(0).expand(fns.BATCH, -1)
    with torch.no_grad():
        whole = model(input_ids=ids, position_ids=pos).router_logits

    def rank_rows(x: torch.Tensor, r: int) -> torch.Tensor:  # cp rank r's chunks, every row
        mine = positions(fns.SEQ, 2, r, balanced=True)
        return x.reshape(fns.BATCH, fns.SEQ, -1)[:, mine].reshape(-1, x.shape[-1])

    per_rank = [fns.aux64(tuple(rank_rows(x, r) for x in whole)) for r in range(2)]
    assert abs(float(sum(per_rank)) / 2 - float(fns.aux64(whole))) > 1e-3


def test_refusals_name_what_to_change(ranks):
    for got in ranks(2, fns.refusals, timeout=180):
        assert "'blocks.1.mlp' is plait's MoE layer" in got["own_moe"]
        assert "strategy 'ep'" in got["own_moe"]
        assert "dimensions ['ep']" in got["ep_mesh"]
        assert "router_aux_loss_coef" in got["no_plan"] and "moe_plan=" in got["no_plan"]
        assert "labels= without shift_labels=" in got["labels_alone"]
        assert "context parallelism on MixtralForCausalLM: attention_mask=" in got["mask_with_aux"]
