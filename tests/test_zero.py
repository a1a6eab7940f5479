"""ZeRO stages 1 and 2 against the single-process oracle, and their bookkeeping.

Tolerance: as in test_ddp.py. Ranks average shard gradients with a reduce-scatter (sum,
then divide) where the oracle averages over the global batch in one reduction, so float32
results differ by rounding only: after 5 steps we allow 2e-5 absolute + 2e-4 relative.
World 1 communicates nothing and must be bitwise equal to the plain optimizer, also after
a state-dict round trip.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from plait.strategies.zero import (
    Piece,
    ZeroOptimizer,
    describe_partition,
    partition,
    reduction_buckets,
    shard_bounds,
)
from tests import ddp_fns, zero_fns

STEPS = 5
TOL = {"rtol": 2e-4, "atol": 2e-5}
NUMEL = sum(p.numel() for p in ddp_fns.make_model().parameters())  # 212


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def _equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _plain(params: list[torch.Tensor], state: dict | None, opt: str, first: int, last: int):
    """One process, the global batch, from given parameters and optimizer state."""
    model = ddp_fns.make_model()
    with torch.no_grad():
        for p, s in zip(model.parameters(), params, strict=True):
            p.copy_(s)
    optimizer = ddp_fns.make_optimizer(model, opt)
    if state is not None:
        optimizer.load_state_dict(copy.deepcopy(state))  # it keeps (and updates) the tensors
    for step in range(first, last):
        x, y = ddp_fns.batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


# --- the partition, without processes -----------------------------------------------------
def test_partition_example_and_description():
    parts = partition([6, 3], 2)
    assert parts == [[Piece(0, 0, 5)], [Piece(0, 5, 6), Piece(1, 0, 3)]]
    assert (
        describe_partition(parts)
        == "rank 0: 5 elements  p0[0:5]\nrank 1: 4 elements  p0[5:6] p1[0:3]"
    )


@pytest.mark.parametrize("numels", [[212], [128, 16, 64, 4], [1, 1, 1], [100, 0, 7], [3]])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_partition_covers_every_element_once_and_balances(numels, world):
    parts = partition(numels, world)
    sizes = [sum(p.stop - p.start for p in pieces) for pieces in parts]
    assert max(sizes) - min(sizes) <= 1
    assert [hi - lo for lo, hi in shard_bounds(sum(numels), world)] == sizes
    owned = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for pieces in parts:
        for p in pieces:
            assert 0 <= p.start < p.stop <= numels[p.param]
            owned[p.param][p.start : p.stop] += 1
    assert all(bool((o == 1).all()) for o in owned)
    # ranks' pieces are in flat order: rank r's last element precedes rank r+1's first
    flat = [(p.param, p.start) for pieces in parts for p in pieces]
    assert flat == sorted(flat)


def test_a_large_tensor_is_split_across_ranks():
    parts = partition([1000, 10], 4)
    assert [len(p) for p in parts] == [1, 1, 1, 2]
    assert parts[0] == [Piece(0, 0, 253)] and parts[3] == [Piece(0, 758, 1000), Piece(1, 0, 10)]


def test_reduction_buckets_run_backwards_in_whole_parameters():
    # 4-byte elements; limits: first bucket 100 bytes, then 400
    buckets = reduction_buckets([50, 10, 20, 30, 5], 4, 400, first_bucket_bytes=100)
    assert buckets == [[3, 4], [0, 1, 2]]
    assert reduction_buckets([1, 2, 3], 4, 4) == [[2], [1], [0]]
    # in the model's order (param groups reorder the flat space): reverse model order
    assert reduction_buckets([1, 2, 3, 4], 4, 12, order=[0, 2, 1, 3]) == [[3], [1, 2], [0]]


def test_mixed_dtypes_and_bad_arguments_are_refused():
    a = nn.Parameter(torch.zeros(3))
    b = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="one dtype"):
        ZeroOptimizer([a, b], torch.optim.Adam)
    with pytest.raises(ValueError, match="stage must be 1 or 2"):
        ZeroOptimizer([a], torch.optim.Adam, stage=3)
    with pytest.raises(TypeError, match="one dtype"):  # also across param groups
        ZeroOptimizer([{"params": [a]}, {"params": [b], "lr": 0.1}], torch.optim.Adam)
    with pytest.raises(ValueError, match="Adafactor combines elements across a parameter"):
        ZeroOptimizer([a], torch.optim.Adafactor)
    with pytest.raises(ValueError, match="LBFGS combines elements"):
        ZeroOptimizer([a], torch.optim.LBFGS)
    with pytest.raises(ValueError, match="no trainable parameters"):
        ZeroOptimizer([nn.Parameter(torch.zeros(2), requires_grad=False)], torch.optim.Adam)


# --- training against the oracle ---------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_matches_single_process_oracle(ranks, world, stage, opt):
    want = ddp_fns.oracle(STEPS, opt)
    results = ranks(world, zero_fns.train, stage, STEPS, opt)
    for got in results:
        if world == 1:
            assert _equal(got, want)
        else:
            _close(got, want)
    for got in results[1:]:  # replicas stay bitwise identical
        assert _equal(got, results[0])


@pytest.mark.parametrize("stage", [1, 2])
def test_small_buckets_and_ring_match_oracle(ranks, stage):
    want = ddp_fns.oracle(STEPS, "adam")
    options = {"bucket_mb": 0.0001, "algorithm": "ring"}
    for got in ranks(4, zero_fns.train, stage, STEPS, "adam", options):
        _close(got, want)


@pytest.mark.parametrize("stage", [1, 2])
def test_gradient_accumulation_and_zero_grad(ranks, stage):
    want = ddp_fns.oracle(3, "adam")
    for got in ranks(2, zero_fns.accumulate, stage, 3):
        _close(got, want)


# --- memory ------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_shards_balance_and_optimizer_state_is_one_nth(ranks, world, stage):
    infos = ranks(world, zero_fns.shard_sizes, stage, "adam")
    shards = [info["shard"] for info in infos]
    assert sum(shards) == NUMEL and max(shards) - min(shards) <= 1
    for info in infos:
        assert info["state_numel"] == 2 * info["shard"]  # exp_avg, exp_avg_sq of the shard
        breakdown = info["breakdown"]
        assert breakdown["params"] == NUMEL
        # m, v and step; the fp32 shard itself is released between steps (it duplicates
        # 1/n of the fp32 parameters and is re-read from them before the next step)
        assert breakdown["optimizer_state"] == 2 * info["shard"] + 1
        # stage 1: the full gradients stay (the user's .grad), its gradient shard is
        # released after the step; stage 2: only the gradient shard
        assert breakdown["grads"] == (NUMEL if stage == 1 else info["shard"])


@pytest.mark.parametrize("world", [1, 2, 4])
def test_stage2_keeps_no_full_gradient(ranks, world):
    x, y = ddp_fns.batch(0)
    model = ddp_fns.make_model()
    nn.functional.mse_loss(model(x), y).backward()
    full = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    for info in ranks(world, zero_fns.stage2_gradients):
        lo, hi = info[2]["lo_hi"]
        assert all(info[2]["placeholders"])  # one-element placeholders, not gradients
        assert all(info[2]["guarded"]) and all(info[1]["guarded"])
        assert info[2]["grad_numel"] == hi - lo
        torch.testing.assert_close(info[2]["shard_grad"], full[lo:hi], **TOL)
        # stage 1 reduces in step(): after backward the full gradients are all there
        assert info[1]["shard_grad"] is None
        assert not any(info[1]["placeholders"])
        assert info[1]["grad_numel"] == NUMEL
        assert info[1]["after_zero_grad"] and info[2]["after_zero_grad"]


@pytest.mark.parametrize("stage", [1, 2])
def test_bytes_sent_match_the_contract(ranks, stage):
    infos = ranks(4, zero_fns.bytes_per_step, stage)
    sizes = [hi - lo for lo, hi in infos[0]["bounds"]]
    for rank, info in enumerate(infos):
        assert info["buckets"] == 2
        # ring: a rank sends every block of a bucket but its own (reduce-scatter) or but
        # its right neighbour's (all-gather); summed over buckets, S minus one shard
        assert info["reduce_scatter"] == 4 * (NUMEL - sizes[rank])
        assert info["all_gather"] == 4 * (NUMEL - sizes[(rank + 1) % 4])


# --- state dicts -------------------------------------------------------------------------
@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_consolidated_state_dict_matches_plain_optimizer_format(ranks, opt):
    model = ddp_fns.make_model()
    plain = ddp_fns.make_optimizer(model, opt)
    for step in range(3):
        x, y = ddp_fns.batch(step)
        plain.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        plain.step()
    want = plain.state_dict()
    for world in (1, 2):
        saved = ranks(world, zero_fns.save, 2, 3, opt)
        for s in saved[1:]:
            assert s["state"]["param_groups"] == saved[0]["state"]["param_groups"]
        got = saved[0]["state"]
        assert got["param_groups"] == want["param_groups"]
        assert got["state"].keys() == want["state"].keys()
        for i, entry in got["state"].items():
            assert list(entry) == list(want["state"][i])
            for key, value in entry.items():
                assert value.shape == want["state"][i][key].shape
                if world == 1:
                    assert torch.equal(value, want["state"][i][key])
                else:
                    torch.testing.assert_close(value, want["state"][i][key], **TOL)


@pytest.mark.parametrize("stage", [1, 2])
def test_consolidated_state_round_trips_across_world_sizes(ranks, stage):
    want = ddp_fns.oracle(STEPS, "adam")
    # world 1: bitwise into a plain Adam
    saved = ranks(1, zero_fns.save, stage, 2, "adam")[0]
    assert _equal(_plain(saved["params"], saved["state"], "adam", 2, STEPS), want)
    # world 2 -> worlds 1, 2, 4 and into a plain Adam
    saved = ranks(2, zero_fns.save, stage, 2, "adam")[0]
    _close(_plain(saved["params"], saved["state"], "adam", 2, STEPS), want)
    for world in (1, 2, 4):
        for got in ranks(
            world, zero_fns.resume, stage, saved["params"], saved["state"], "adam", 2, STEPS
        ):
            _close(got, want)


def test_plain_optimizer_state_loads_into_zero(ranks):
    want = ddp_fns.oracle(STEPS, "sgd")
    model = ddp_fns.make_model()
    plain = ddp_fns.make_optimizer(model, "sgd")
    for step in range(2):
        x, y = ddp_fns.batch(step)
        plain.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        plain.step()
    params = [p.detach().clone() for p in model.parameters()]
    for got in ranks(2, zero_fns.resume, 2, params, plain.state_dict(), "sgd", 2, STEPS):
        _close(got, want)


@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_state_dict_round_trips(ranks, stage):
    for info in ranks(2, zero_fns.sharded_round_trip, stage):
        assert _equal(info["resumed"], info["straight"])
        assert info["lr"] == 0.01
        assert "consolidated" in info["refused"]


def test_lr_scheduler_drives_the_local_optimizer(ranks):
    model = ddp_fns.make_model()
    plain = ddp_fns.make_optimizer(model, "adam")
    scheduler = torch.optim.lr_scheduler.StepLR(plain, step_size=2, gamma=0.1)
    for step in range(STEPS):
        x, y = ddp_fns.batch(step)
        plain.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        plain.step()
        scheduler.step()
    want = [p.detach() for p in model.parameters()]
    assert _equal(ranks(1, zero_fns.with_scheduler, 1, STEPS)[0], want)
    for got in ranks(2, zero_fns.with_scheduler, 2, STEPS):
        _close(got, want)
    assert not _equal(want, ddp_fns.oracle(STEPS, "adam"))


def test_prepare_zero_refuses_unknown_options():
    from plait.strategies.zero import prepare_zero

    model = ddp_fns.make_model()
    with pytest.raises(TypeError, match=r"'zero2' does not take \['bucket_size'\]"):
        prepare_zero(model, ddp_fns.make_optimizer(model, "adam"), stage=2, bucket_size=1)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("options", [{}, {"bucket_mb": 0.00001, "algorithm": "ring"}])
def test_uneven_shards_match_plain_adam(ranks, stage, options):
    want = zero_fns.train_odd(None, STEPS, {})["params"]
    results = ranks(4, zero_fns.train_odd, stage, STEPS, options)
    assert [r["shard"] for r in results] == [6, 6, 5, 5]
    for r in results:
        _close(r["params"], want)
