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


def constructors_take_mesh() -> list[str]:
    """DDP, the naive wrapper, ZeroOptimizer and fully_shard built by hand with mesh= run
    on the mesh's dp group, train like group=, and refuse both names, or a mesh that is
    neither a Mesh nor a group, by name."""
    mesh = plait.Mesh(dp=2)
    dp = mesh.group("dp")
    x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(dp.rank))
    out = []

    def pair():
        torch.manual_seed(0)
        a = torch.nn.Linear(4, 3).double()
        b = torch.nn.Linear(4, 3).double()
        b.load_state_dict(a.state_dict())
        return a, b

    for name, build in (
        ("ddp", lambda m, **k: plait.DistributedDataParallel(m, **k)),
        ("naive", lambda m, **k: plait.NaiveDataParallel(m, **k)),
        ("fsdp", lambda m, **k: plait.fully_shard(m, **k)),
    ):
        a, b = pair()
        wa, wb = build(a, mesh=mesh), build(b, group=dp)
        for w, m in ((wa, a), (wb, b)):
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            w(x).square().sum().backward()
            opt.step()
        if name != "fsdp":
            assert wa.group is dp, name
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            assert torch.equal(p, q), name
        out.append(name)
    a, b = pair()
    za = plait.ZeroOptimizer(a.parameters(), torch.optim.SGD, mesh=mesh, lr=0.1)
    zb = plait.ZeroOptimizer(b.parameters(), torch.optim.SGD, group=dp, lr=0.1)
    assert za.group is dp
    for z, m in ((za, a), (zb, b)):
        m(x).square().sum().backward()
        z.step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    out.append("zero")
    for bad, words in (
        (dict(mesh=mesh, group=plait.comm.world()), "pass mesh= (a Mesh or a group) or group="),
        (dict(mesh="dp"), "mesh= must be a plait.Mesh"),
    ):
        try:
            plait.DistributedDataParallel(torch.nn.Linear(2, 2), **bad)
        except (TypeError, ValueError) as e:
            assert words in str(e) and "DistributedDataParallel" in str(e), e
        else:
            raise AssertionError(f"accepted {bad}")
    out.append("refused")
    return out
