"""DDP and naive DP: PyTorch's DDP attributes and arguments, unused parameters as PyTorch
treats them, non-finite gradients, the wrap-time model check, loss scaling and clipping."""

from __future__ import annotations

import time

import pytest
import torch

from tests import ddp_fns, faultlog

TOL = {"rtol": 2e-4, "atol": 2e-5}


def _close(got: list[torch.Tensor], want: list[torch.Tensor], **tol: float) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **(tol or TOL))


def test_require_backward_grad_sync_false_issues_no_all_reduce(ranks):
    want = ddp_fns.accumulation_oracle()
    for calls, got in ranks(2, ddp_fns.no_grad_sync_attribute):
        # micro-steps alternate: no all-reduce, then the synchronized one (one bucket)
        assert calls[0::2] == [0, 0] and all(c >= 1 for c in calls[1::2]), calls
        _close(got, want)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_unused_parameters_match_torch_ddp(ranks, opt):
    for theirs, ours, grad_none in ranks(2, ddp_fns.unused_vs_torch_ddp, opt):
        assert grad_none == [True, True]  # unused on every rank: .grad stays None
        _close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_pytorch_arguments(ranks):
    (out, _) = ranks(2, ddp_fns.pytorch_arguments)
    assert (
        "CUDA device" in out["{'device_ids': [0]}"]
        and "leave both None" in out["{'device_ids': [0]}"]
    )
    assert "CUDA device" in out["{'output_device': 0}"]
    assert out["group"] == "world" and out["module"] == "True"
    assert "plait.comm.Group" in out["bad group"]


@pytest.mark.parametrize("strategy", ["ddp", "naive"])
def test_reordered_model_is_refused_naming_rank_and_parameter(ranks, strategy):
    for message in ranks(2, ddp_fns.reordered_model, strategy):
        assert message != "accepted"
        assert "rank 1" in message and "fc2.weight" in message and "fc1.weight" in message


@pytest.mark.faults
@pytest.mark.parametrize("strategy", ["ddp", "naive"])
def test_nonfinite_gradient_raises_on_every_rank_naming_the_rank(ranks, strategy):
    t0 = time.perf_counter()
    results = ranks(2, ddp_fns.nonfinite, "raise", 1, None, strategy)
    for r in results:
        assert r["culprits"] == [(1, "fc1.weight")], r
        assert "rank 1 in parameter 'fc1.weight'" in r["error"]
        assert r["skipped"] == [False]  # the first step trained; the second raised
    faultlog.record(
        row=7,
        fault=f"NaN gradient on rank 1 ({strategy}, check_finite='raise')",
        detected_after_s=max(r["after_s"] for r in results),
        named_correctly=True,
        state_equal=None,
        test_s=time.perf_counter() - t0,
    )


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_nonfinite_flags_kept_on_the_device_name_the_same_rank_and_parameter(ranks, policy):
    """The device backends' check (no host read before a bucket's launch), run on the
    CPU: same decision, same culprit, same replicas as the host read's."""
    options = {"gradient_as_bucket_view": True, "bucket_mb": 0.0005}
    results = ranks(2, ddp_fns.nonfinite, policy, 1, options, "ddp", True)
    for r in results:
        if policy == "raise":
            assert r["culprits"] == [(1, "fc1.weight")], r
            assert r["skipped"] == [False]
        else:
            assert r["skipped"] == [False, True, False], r
            assert "rank 1 in parameter 'fc1.weight'" in r["warning"]
    if policy == "skip":
        for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.faults
@pytest.mark.parametrize(
    "strategy,options",
    [
        ("ddp", {}),
        ("ddp", {"gradient_as_bucket_view": True, "bucket_mb": 0.0005}),
        ("naive", {}),
    ],
)
def test_nonfinite_gradient_skips_the_step_on_every_rank(ranks, strategy, options):
    results = ranks(2, ddp_fns.nonfinite, "skip", 0, options, strategy)
    for r in results:
        assert r["skipped"] == [False, True, False], r  # step 1 left the parameters as they were
        assert r["skipped_steps"] == 1
        assert "rank 0 in parameter 'fc1.weight'" in r["warning"]
        assert all(torch.isfinite(p).all() for p in r["params"])
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)  # replicas stay bitwise identical
    faultlog.record(
        row=7,
        fault=f"NaN gradient on rank 0 ({strategy}, check_finite='skip')",
        detected_after_s=max(r["after_s"] for r in results),  # within that backward
        named_correctly=all("rank 0 in parameter" in r["warning"] for r in results),
        state_equal=all(r["skipped"][1] for r in results),
    )


@pytest.mark.parametrize("strategy", ["ddp", "naive"])
def test_grad_scaler_matches_oracle_and_skips_on_every_rank(ranks, strategy):
    per = ddp_fns.GLOBAL_BATCH // 2
    want = ddp_fns.grad_scaler_oracle(inf_at=per)  # rank 1's first sample
    results = ranks(2, ddp_fns.grad_scaler, strategy, 1)
    for got in results:
        assert got["scales"] == want["scales"]
        assert got["scales"][2] == got["scales"][1] / 2  # step 2 skipped: scale backed off
        _close(got["params"], want["params"])
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("strategy", ["ddp", "naive"])
def test_clip_grad_norm_equals_torch_on_the_oracle(ranks, strategy):
    model = ddp_fns.make_model()
    x, y = ddp_fns.batch(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    want_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    want = [p.grad for p in model.parameters()]
    for norm, grads in ranks(2, ddp_fns.clip_norm, strategy, 0.05):
        torch.testing.assert_close(norm, want_norm, **TOL)
        _close(grads, want)


def test_naive_records_its_all_reduces_in_the_tracer(ranks):
    for spans in ranks(2, ddp_fns.naive_traced):
        names = [n for n, stream, _ in spans if stream == "comm"]
        assert names == [
            "all_reduce used flags",
            "all_reduce fc1.weight",
            "all_reduce fc1.bias",
            "all_reduce fc2.weight",
            "all_reduce fc2.bias",
        ]
        assert dict((n, b) for n, _, b in spans)["all_reduce fc1.weight"] == 16 * 8 * 4
