"""ZeRO-1/2 as a drop-in: clipping, param groups, loss scaling, wrap check, tracing.

Each against the single-process oracle (the plain optimizer on the global batch, in this
process), at the tolerance of test_zero.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from tests import ddp_fns, zero_fns

TOL = {"rtol": 2e-4, "atol": 2e-5}
MAX_NORM = 0.05  # below every step's gradient norm: every step clips


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def _clipped_oracle(norm_type: float, steps: int) -> tuple[list[torch.Tensor], list[float]]:
    model = ddp_fns.make_model()
    optimizer = ddp_fns.make_optimizer(model, "sgd")
    norms = []
    for step in range(steps):
        x, y = ddp_fns.batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)))
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], norms


# --- 1. gradient clipping ----------------------------------------------------------------
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world", [1, 2])
def test_clip_grad_norm_matches_single_process(ranks, world, stage, norm_type):
    want, want_norms = _clipped_oracle(norm_type, 3)
    assert min(want_norms) > MAX_NORM  # every step clipped
    for got in ranks(world, zero_fns.clipped, stage, norm_type, 3, MAX_NORM):
        _close(got["params"], want)
        assert got["norms"] == pytest.approx(want_norms, rel=2e-5)
        # torch's own clip, a gradient norm for logging and printing the gradient all
        # refuse the guard, naming the call to use instead
        for what, message in got["refused"].items():
            assert "optimizer.clip_grad_norm_(max_norm, norm_type)" in message, what
            assert f"ZeRO stage {stage}" in message
        assert "'fc1.weight'" in got["refused"]["grad_norm"]


# --- 2. param groups, any torch optimizer --------------------------------------------------
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world", [2, 4])  # at 4, ranks 0-2 hold none of the no-decay group
def test_adamw_two_groups_and_lambda_lr_match_oracle(ranks, world, stage):
    want = zero_fns.train_grouped(None, "adamw", 0, 5, scheduled=True)
    for got in ranks(world, zero_fns.train_grouped, stage, "adamw", 0, 5, scheduled=True):
        _close(got["params"], want["params"])
        assert got["lrs"] == want["lrs"]  # the schedule reached both groups
        assert got["lrs"][0] == [0.01, 0.02] and got["lrs"][-1] == pytest.approx([0.003, 0.006])
        assert got["state"]["param_groups"] == want["state"]["param_groups"]
        assert got["state"]["state"].keys() == want["state"]["state"].keys()
        for i, entry in got["state"]["state"].items():
            assert list(entry) == list(want["state"]["state"][i])
            for key, value in entry.items():
                torch.testing.assert_close(value, want["state"]["state"][i][key], **TOL)


@pytest.mark.parametrize("opt", ["sgd", "adam", "rmsprop", "adagrad"])
def test_other_torch_optimizers_with_groups_match_oracle(ranks, opt):
    want = zero_fns.train_grouped(None, opt, 0, 3)
    for got in ranks(2, zero_fns.train_grouped, 2, opt, 0, 3):
        _close(got["params"], want["params"])


@pytest.mark.parametrize("stage", [1, 2])
def test_buckets_follow_the_model_not_the_groups(ranks, stage):
    # flat space in group order: fc1.weight 0, fc2.weight 1 (decay), fc1.bias 2, fc2.bias 3;
    # backward produces fc2's gradients first, so the first bucket holds them (a bucket's
    # blocks are then cut from parameters apart in the flat space)
    want = zero_fns.train_grouped(None, "adamw", 0, 3)
    options = {"bucket_mb": 0.0002, "algorithm": "ring"}  # buckets close at 209 bytes
    for got in ranks(2, zero_fns.train_grouped, stage, "adamw", 0, 3, options=options):
        # rank 1 owns flat [106, 212): its blocks are fc2.weight + fc2.bias, then
        # fc1.weight[106:128] + fc1.bias, neither contiguous in the flat space
        assert got["buckets"] == [[1, 3], [0, 2]]
        _close(got["params"], want["params"])


def test_grouped_state_round_trips_through_the_plain_optimizer(ranks):
    want = zero_fns.train_grouped(None, "adamw", 0, 5, scheduled=True)["params"]
    # zero (world 2) -> plain AdamW with two groups
    saved = ranks(2, zero_fns.train_grouped, 1, "adamw", 0, 3, scheduled=True)[0]
    plain = zero_fns.train_grouped(
        None, "adamw", 3, 5, params=saved["params"], state=saved["state"]
    )
    _close(plain["params"], want)
    # plain -> zero (world 2), both stages
    oracle3 = zero_fns.train_grouped(None, "adamw", 0, 3, scheduled=True)
    for stage in (1, 2):
        for got in ranks(
            2,
            zero_fns.train_grouped,
            stage,
            "adamw",
            3,
            5,
            params=oracle3["params"],
            state=copy.deepcopy(oracle3["state"]),
        ):
            _close(got["params"], want)


@pytest.mark.parametrize("stage", [1, 2])
def test_frozen_parameters_keep_the_plain_optimizer_ids(ranks, stage):
    want = zero_fns.frozen_first_layer(None, 3)
    assert sorted(want["state"]["state"]) == [2, 3]  # fc1's ids 0, 1 have no state
    for got in ranks(2, zero_fns.frozen_first_layer, stage, 3):
        _close(got["params"], want["params"])
        assert got["state"]["param_groups"] == want["state"]["param_groups"]
        assert sorted(got["state"]["state"]) == [2, 3]
        for i in (2, 3):
            for key, value in got["state"]["state"][i].items():
                torch.testing.assert_close(value, want["state"]["state"][i][key], **TOL)


# --- 3. loss scaling -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["torch", "plait"])
@pytest.mark.parametrize("stage", [1, 2])
def test_loss_scaler_skips_on_every_rank_and_halves(ranks, stage, kind):
    # the oracle: steps 0 and 2 (step 1 overflowed on rank 1 and is skipped everywhere)
    model = ddp_fns.make_model()
    optimizer = ddp_fns.make_optimizer(model, "sgd")
    for step in (0, 2):
        x, y = ddp_fns.batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    want = [p.detach() for p in model.parameters()]
    for got in ranks(2, zero_fns.scaled, stage, kind, 3):
        assert got["unchanged"] == [False, True, False]
        assert got["scales"] == [256.0, 128.0, 128.0]
        _close(got["params"], want)


@pytest.mark.parametrize("stage", [1, 2])
def test_grad_scaler_unscale_then_clip_then_step(ranks, stage):
    model = ddp_fns.make_model()
    optimizer = ddp_fns.make_optimizer(model, "sgd")
    for step in (0, 2):  # step 1 overflows on rank 1 and is skipped everywhere
        x, y = ddp_fns.batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
    want = [p.detach() for p in model.parameters()]
    for got in ranks(2, zero_fns.scaled, stage, "torch", 3, MAX_NORM):
        assert got["unchanged"] == [False, True, False]
        assert got["scales"] == [256.0, 128.0, 128.0]
        _close(got["params"], want)


# --- 4. wrap-time check ---------------------------------------------------------------------
@pytest.mark.parametrize("stage", [1, 2])
def test_a_rank_that_built_another_model_is_refused(ranks, stage):
    for message in ranks(2, zero_fns.built_differently, stage):
        assert "ZeroOptimizer" in message
        assert "rank 1 differs from rank 0 at parameter #0" in message
        assert "fc1.weight" in message and "fc2.weight" in message


# --- 5. tracing -----------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [1, 2])
def test_tracer_records_reduce_scatters_and_all_gathers(ranks, stage):
    for spans in ranks(2, zero_fns.traced, stage):
        assert ("backward", "compute") in spans  # from the first parameter gradient
        comm = [name for name, stream in spans if stream == "comm"]
        assert comm == [
            "reduce_scatter bucket 0",
            "reduce_scatter bucket 1",
            "all_gather bucket 0",
            "all_gather bucket 1",
        ]


# --- ordinary uses of gradients ---------------------------------------------------------------
@pytest.mark.parametrize("clear", ["optimizer_none", "optimizer_zero", "model_none", "model_zero"])
@pytest.mark.parametrize("stage", [1, 2])
def test_accumulation_with_every_way_of_clearing(ranks, stage, clear):
    want = ddp_fns.oracle(3, "adam")
    for got in ranks(2, zero_fns.accumulate_with, stage, 3, clear):
        _close(got, want)


@pytest.mark.parametrize("stage", [1, 2])
def test_zeroing_one_gradient_zeroes_its_averaged_gradient(ranks, stage):
    want = zero_fns.zero_one_gradient(None, 3)
    for got in ranks(2, zero_fns.zero_one_gradient, stage, 3):
        _close(got, want)
