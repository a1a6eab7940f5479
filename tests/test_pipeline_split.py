"""The split backward (zero-bubble ``I`` + ``W``) against the fused one, in one process.

Float64; the split path's parameter gradients equal the fused path's to 1e-12 relative
(the same kernels for the norms and the embedding; a linear's ``dW`` is one matmul
instead of autograd's, summing in another order). Gradients accumulate over two
micro-batches, as the runtime's do.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from plait.models import GPT, GPTConfig
from plait.models.gpt import loss, pipeline_plan
from plait.strategies.pipeline import Stage, layers_of
from plait.strategies.pipeline.deferred import Deferred, SplitBackward

F64 = torch.float64


class Scale(nn.Module):
    """A parameter-holding module plait has no rule for."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, n, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class Checkpointed(nn.Module):
    """A linear run under (non-reentrant) activation checkpointing."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.inner = nn.Linear(n, n, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)  # type: ignore[no-any-return]


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _compare(module: nn.Module, run, batches) -> tuple[SplitBackward, set[str]]:
    """Fused and split backward over ``batches``; returns the splitter and the parameters
    that had a gradient right after the first I (those computed with the input gradient)."""
    module.zero_grad(set_to_none=True)
    for b in batches:
        run(b).backward()
    fused = _grads(module)
    module.zero_grad(set_to_none=True)
    splitter = SplitBackward(module)
    after_i: set[str] = set()
    for k, b in enumerate(batches):
        kept = Deferred()
        with splitter.deferring(kept):
            y = run(b)
        with splitter.deferring(kept):
            y.backward()
        if k == 0:
            after_i = set(_grads(module))
        kept.apply()
    split = _grads(module)
    assert set(split) == set(fused)
    assert not any(g.requires_grad for g in split.values())  # W records no graph
    for n, want in fused.items():
        scale = want.abs().max().clamp_min(1e-300)
        assert float((split[n] - want).abs().max() / scale) < 1e-12, n
    return splitter, after_i


@pytest.mark.parametrize("tied", [False, True])
def test_gpt_stage_split_equals_fused(tied):
    gpt = GPT(GPTConfig(vocab=11, layers=2, width=16, heads=2, seq_len=8, tied=tied, dtype=F64))
    stage = Stage(layers_of(gpt, pipeline_plan(gpt)), 0)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 11, (3, 9), generator=g) for _ in range(2)]
    splitter, after_i = _compare(stage, lambda b: loss(stage(b[:, :-1]), b[:, 1:]), batches)
    # every parameter waits for W; a tied weight gets both the embedding's and the head's part
    assert after_i == set()
    assert splitter.report.counts() == {"Embedding": 2, "LayerNorm": 5, "Linear": 9}
    assert splitter.report.fused == ()


def test_other_layers_split_or_fall_back_by_name():
    model = nn.Sequential(
        nn.Embedding(10, 6, padding_idx=0, dtype=F64),
        nn.Linear(6, 6, dtype=F64),
        nn.RMSNorm(6, dtype=F64),
        Scale(6),
        nn.LayerNorm(6, bias=False, dtype=F64),
        Checkpointed(6),
        nn.Linear(6, 3, bias=False, dtype=F64),
    )
    frozen = nn.Linear(3, 3, dtype=F64)
    frozen.weight.requires_grad_(False)  # its bias alone trains: fused, decided per call
    model.append(frozen)
    hooked = nn.Linear(3, 3, dtype=F64)
    hooked.weight.register_hook(lambda g: 2 * g)  # as sequence parallelism's sum: kept in I
    model.append(hooked)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 10, (4, 5), generator=g) for _ in range(2)]
    batches[0][0, :2] = 0  # the padding row gets no gradient either way
    splitter, after_i = _compare(model, lambda b: model(b).pow(2).sum(), batches)
    assert after_i == {"3.w", "7.bias", "8.weight", "8.bias"}
    assert dict(splitter.report.fused) == {
        "3": "Scale: plait has no split rule for it",
        "8": "its parameters have gradient hooks",
    }
    assert "3 (Scale: plait has no split rule for it)" in splitter.report.describe()
    assert splitter.report.counts() == {"Embedding": 1, "Linear": 4, "RMSNorm": 1, "LayerNorm": 1}


def test_refusals_are_named():
    sparse = nn.Embedding(4, 2, sparse=True)
    patched = nn.Linear(2, 2)
    patched.forward = lambda x: x  # type: ignore[method-assign]

    class MyLinear(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    report = SplitBackward(nn.ModuleDict({"e": sparse, "p": patched, "m": MyLinear(2, 2)})).report
    assert dict(report.fused) == {
        "e": "sparse gradients",
        "p": "its forward is replaced on the instance",
        "m": "MyLinear has its own forward",
    }


def test_outside_deferring_nothing_changes():
    lin = nn.Linear(4, 4, dtype=F64)
    splitter = SplitBackward(lin)
    with splitter.deferring(Deferred()):
        assert "forward" in lin.__dict__
    assert "forward" not in lin.__dict__
    lin(torch.ones(1, 4, dtype=F64)).sum().backward()  # the ordinary forward and backward
    assert lin.weight.grad is not None
