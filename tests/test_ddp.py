"""DDP and naive DP against the single-process oracle, PyTorch's DDP, and each other.

Tolerance: ranks average shard gradients (sum, then divide) where the oracle averages over
the global batch in one reduction, so float32 results differ by rounding only: after 5
steps we allow 2e-5 absolute + 2e-4 relative (observed differences are ~1e-7). World 1 runs
no communication and must be bitwise equal.
"""

from __future__ import annotations

import pytest
import torch

import plait
from tests import ddp_fns

STEPS = 5
TOL = {"rtol": 2e-4, "atol": 2e-5}


def _close(got: list[torch.Tensor], want: list[torch.Tensor], **tol: float) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **(tol or TOL))


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("strategy", ["ddp", "naive"])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_matches_single_process_oracle(ranks, world, strategy, opt):
    want = ddp_fns.oracle(STEPS, opt)
    results = ranks(world, ddp_fns.train, strategy, STEPS, opt)
    for got in results:
        if world == 1:
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        else:
            _close(got, want)
    for got in results[1:]:  # replicas stay bitwise identical
        assert all(torch.equal(a, b) for a, b in zip(got, results[0], strict=True))


@pytest.mark.parametrize(
    "options",
    [
        {"bucket_mb": 0.0005},  # one parameter per bucket, re-ordered after step 1
        {"gradient_as_bucket_view": True},
        {"gradient_as_bucket_view": True, "bucket_mb": 0.0005},
        {"broadcast_buffers": False},
    ],
)
def test_ddp_options_match_oracle(ranks, options):
    want = ddp_fns.oracle(STEPS, "adam")
    for got in ranks(2, ddp_fns.train, "ddp", STEPS, "adam", options):
        _close(got, want)


@pytest.mark.parametrize(
    "algorithm", ["ring", "tree", "halving_doubling", "naive", "hierarchical", "native"]
)
def test_every_algorithm_trains_the_same(ranks, algorithm):
    want = ddp_fns.oracle(STEPS, "sgd")
    for got in ranks(3, ddp_fns.train, "ddp", STEPS, "sgd", {"algorithm": algorithm}):
        _close(got, want)


def test_matches_torch_ddp(ranks):
    ours = ranks(2, ddp_fns.train, "ddp", STEPS, "adam", None, None, False)
    theirs = ranks(2, ddp_fns.train_torch_ddp, STEPS, "adam")
    for a, b in zip(ours, theirs, strict=True):
        _close(a, b)


@pytest.mark.parametrize("hook,tol", [("fp16_compress_hook", 2e-3), ("bf16_compress_hook", 2e-2)])
def test_compression_hooks_stay_close(ranks, hook, tol):
    want = ddp_fns.oracle(STEPS, "sgd")
    for got in ranks(2, ddp_fns.train, "ddp", STEPS, "sgd", None, hook):
        _close(got, want, rtol=tol, atol=tol)


def test_no_sync_accumulation_equals_one_big_batch(ranks):
    for accumulated, together in ranks(2, ddp_fns.no_sync_vs_one_batch):
        _close(accumulated, together, rtol=1e-5, atol=1e-6)


def test_unused_parameter_is_named_without_the_flag(ranks):
    for message in ranks(2, ddp_fns.unused_parameter, False):
        assert isinstance(message, str)
        assert "'extra.weight'" in message and "find_unused_parameters=True" in message


def test_unused_parameter_with_the_flag_trains(ranks):
    results = ranks(2, ddp_fns.unused_parameter, True)
    model = ddp_fns.make_model(unused_branch=True)
    ddp_fns.train_one_process(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
    want = [p.detach() for p in model.parameters()]
    for got in results:
        _close(got, want)


def test_buffers_follow_rank_0(ranks):
    synced = ranks(3, ddp_fns.buffers_after, True)
    assert len(set(synced)) == 1
    unsynced = ranks(3, ddp_fns.buffers_after, False)
    assert len(set(unsynced)) == 3


def test_prepare_refuses_unknown_strategies_and_options():
    model = ddp_fns.make_model()
    with pytest.raises(ValueError, match="unknown strategy 'zero9'"):
        plait.prepare(model, None, strategy="zero9")
    with pytest.raises(TypeError, match="'none' takes no options"):
        plait.prepare(model, None, strategy="none", bucket_mb=1)
    wrapped, opt = plait.prepare(model, None, strategy="none")
    assert wrapped is model and opt is None


def test_buckets_close_after_their_limit_and_start_small():
    from plait.strategies.data_parallel.buckets import build_buckets

    mib = 1 << 20
    params = [
        ("w3", torch.nn.Parameter(torch.zeros(mib // 4))),  # 1 MiB
        ("b3", torch.nn.Parameter(torch.zeros(10))),
        ("w2", torch.nn.Parameter(torch.zeros(mib // 2))),  # 2 MiB
        ("b2", torch.nn.Parameter(torch.zeros(10))),
        ("w1", torch.nn.Parameter(torch.zeros(mib))),  # 4 MiB
        ("h", torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))),
    ]
    buckets = build_buckets(params, bucket_bytes=3 * mib, first_bucket_bytes=mib)
    assert [b.names for b in buckets] == [["w3"], ["b3", "w2", "b2", "w1"], ["h"]]
    assert [b.buffer.dtype for b in buckets] == [torch.float32, torch.float32, torch.float64]
    assert buckets[1].slot(1).shape == (mib // 2,)


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_prepare_zero_matches_oracle(ranks, strategy):
    want = ddp_fns.oracle(STEPS, "adam")
    for got in ranks(2, ddp_fns.train, strategy, STEPS, "adam"):
        _close(got, want)


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_prepare_fully_sharded_matches_oracle(ranks, strategy):
    want = ddp_fns.oracle(STEPS, "adam")
    for got in ranks(2, ddp_fns.train_full, strategy, STEPS, "adam"):
        assert got.keys() == ddp_fns.make_model().state_dict().keys()
        names = [n for n, _ in ddp_fns.make_model().named_parameters()]
        _close([got[n] for n in names], want)
