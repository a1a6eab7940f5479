"""Rank functions for tests/test_pipeline_finite.py: the pipeline's non-finite check with
its flags on the device (as on NCCL) against the host path, on gloo."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import plait
from plait.strategies.data_parallel.grad_sync import NonFiniteGradientError

BATCH, WIDTH = 8, 6


class Scale(nn.Module):
    """Multiplies by a buffer: set it to inf and a finite input gives an inf output."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("by", torch.ones((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.by


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(WIDTH, WIDTH), Scale()]
    return nn.Sequential(*layers).double()


def nonfinite(where: str, policy: str, on_device: bool) -> dict[str, Any]:
    """Two steps of a 4-stage-layer pipeline on pp=world (1f1b, 4 micro-batches); on the
    second, the last rank plants inf in a forward (``where="forward"``: its second
    ``Scale`` multiplies by inf from micro-batch 0 on) or only in a gradient
    (``"gradient"``: a hook puts inf into its first Linear's weight gradient). Returns
    the message, the culprits, and whether the step was skipped alike."""
    world = plait.world()
    model = _model()
    pipe, opt = plait.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="pipeline",
        mesh=plait.Mesh(pp=world.size), schedule="1f1b", microbatches=4,
        loss_fn=nn.MSELoss(), check_finite=policy,
    )  # fmt: skip
    assert opt is not None
    default = pipe.flags_on_device
    pipe.flags_on_device = on_device
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64)
    y = torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64)
    pipe.step(x, y)
    opt.step()
    opt.zero_grad()
    out: dict[str, Any] = {"default": default, "error": None, "culprits": None}
    last = world.rank == world.size - 1
    stage = next(iter(pipe.stages.values()))
    hook = None
    if last and where == "forward":
        scale = [m for m in stage.modules() if isinstance(m, Scale)][1]
        scale.by.fill_(float("inf"))
    if last and where == "gradient":
        weight = next(p for n, p in stage.named_parameters() if n.endswith("weight"))
        hook = weight.register_hook(lambda grad: grad.index_fill(0, torch.tensor([1]), torch.inf))
    try:
        pipe.step(x, y)
    except NonFiniteGradientError as exc:
        out["error"], out["culprits"] = str(exc), exc.culprits
    out["message"] = pipe.last_nonfinite
    out["skipped"] = pipe.skipped_steps
    out["grads_none"] = all(p.grad is None for p in pipe.parameters())
    if hook is not None:
        hook.remove()
    return out
