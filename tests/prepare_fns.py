"""Rank functions for tests/test_prepare_vocabulary.py."""

from __future__ import annotations

import warnings

import torch

import plait


def prepare_ddp_with_mesh() -> str:
    """DDP prepared with mesh=Mesh(dp=2) and PyTorch's bucket_cap_mb trains in step with
    group= (the deprecated spelling, which warns)."""
    mesh = plait.Mesh(dp=2)
    torch.manual_seed(0)
    a = torch.nn.Linear(4, 3).double()
    b = torch.nn.Linear(4, 3).double()
    b.load_state_dict(a.state_dict())
    ddp_a, opt_a = plait.prepare(
        a, torch.optim.SGD(a.parameters(), lr=0.1), strategy="ddp", mesh=mesh, bucket_cap_mb=1.0
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp_b, opt_b = plait.prepare(
            b, torch.optim.SGD(b.parameters(), lr=0.1), strategy="ddp", group=mesh.group("dp")
        )
    assert any("group= is deprecated; use mesh=" in str(w.message) for w in caught)
    x = torch.randn(
        6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(mesh.rank("dp"))
    )
    for model, opt in ((ddp_a, opt_a), (ddp_b, opt_b)):
        model(x).square().sum().backward()
        assert opt is not None
        opt.step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    assert ddp_a.group is mesh.group("dp")  # type: ignore[union-attr]
    return "dp ok"
