"""plait.DataParallel (one process, replicas in threads) against one process on the global
batch and against DDP: the batch-mean argument of its docstring, checked."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import plait
from tests import ddp_fns


def _grads_one_process() -> list[torch.Tensor]:
    model = ddp_fns.make_model()
    x, y = ddp_fns.batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def _grads_data_parallel(replicas: int) -> list[torch.Tensor]:
    model = ddp_fns.make_model()
    dp = plait.DataParallel(model, replicas=replicas)
    assert dp.module is model
    x, y = ddp_fns.batch(0)
    out = dp(x)
    assert out.shape == y.shape
    nn.functional.mse_loss(out, y).backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize("replicas", [3, 5])  # 5 does not divide the batch of 24
def test_data_parallel_gradients_equal_one_process(replicas):
    want = _grads_one_process()
    for a, b in zip(_grads_data_parallel(replicas), want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_data_parallel_ddp_and_one_process_give_the_same_gradients(ranks):
    want = _grads_one_process()
    dp = _grads_data_parallel(3)
    for ddp in ranks(3, ddp_fns.one_backward_grads, "ddp"):
        for a, b, c in zip(ddp, dp, want, strict=True):
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_data_parallel_trains_like_the_oracle():
    want = ddp_fns.oracle(4, "adam")
    model = ddp_fns.make_model()
    dp = plait.DataParallel(model, replicas=4)
    ddp_fns.train_one_process(dp, ddp_fns.make_optimizer(model, "adam"), 4)
    for a, b in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-6)


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, *, scale: float, bias: torch.Tensor) -> dict:
        if torch.isnan(x).any():
            raise ValueError("a NaN in this replica's inputs")
        h = self.fc(x) * scale + bias
        return {"h": h, "pair": (h.sum(1), x)}


def test_data_parallel_scatters_keywords_and_gathers_structures():
    torch.manual_seed(0)
    model = TwoHeads()
    dp = plait.DataParallel(model, replicas=3)
    x, bias = torch.randn(7, 4), torch.randn(7, 3)
    got = dp(x, scale=2.0, bias=bias)
    want = model(x, scale=2.0, bias=bias)
    torch.testing.assert_close(got["h"], want["h"])
    torch.testing.assert_close(got["pair"][0], want["pair"][0])
    assert torch.equal(got["pair"][1], x)
    x[6, 0] = float("nan")  # in the last replica's piece
    with pytest.raises(RuntimeError, match="replica 2 .*a NaN in this replica"):
        dp(x, scale=1.0, bias=bias)


def test_data_parallel_refuses_bad_devices():
    model = ddp_fns.make_model()
    with pytest.raises(ValueError, match="replicas must be a positive integer"):
        plait.DataParallel(model, replicas=0)
    with pytest.raises(ValueError, match="not both"):
        plait.DataParallel(model, device_ids=["cpu"], replicas=2)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="move the module there first"):
            plait.DataParallel(model, device_ids=[0])


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA device")
def test_data_parallel_on_cuda_equals_one_process():
    want = _grads_one_process()
    model = ddp_fns.make_model().cuda()
    ids = list(range(torch.cuda.device_count())) * 2  # two replicas per GPU
    dp = plait.DataParallel(model, device_ids=ids)
    x, y = ddp_fns.batch(0)
    nn.functional.mse_loss(dp(x.cuda()), y.cuda()).backward()
    for p, b in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad.cpu(), b, rtol=1e-4, atol=1e-5)  # type: ignore[union-attr]
