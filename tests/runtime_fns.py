"""Rank functions for tests/test_runtime.py: plait adopting a process group the script
initialized itself, and re-initialization."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import plait
from plait import comm
from plait.comm import progress


def adopt(port: int) -> dict[str, Any]:
    """Leave the pool's group, join one with torch's own init_process_group (a tcp://
    address, no MASTER_* variables), and use plait without plait.init."""
    rank = plait.world().rank
    plait.shutdown()
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    out: dict[str, Any] = {"initialized": plait.is_initialized()}
    t = torch.full((3,), float(rank + 1))
    comm.all_reduce(t)  # no plait.init: adopts torch's process group
    out["sum"] = t.tolist()
    torch.manual_seed(0)
    model = plait.DistributedDataParallel(nn.Linear(3, 1))
    model(torch.full((2, 3), float(rank))).sum().backward()
    out["grad"] = model.module.weight.grad.tolist()  # type: ignore[union-attr]
    out["same_world"] = plait.init() is plait.world()
    try:
        plait.init(timeout=7)
        out["reinit"] = "no error"
    except ValueError as exc:
        out["reinit"] = str(exc)
    out["board"] = progress._address is not None  # the store was found from the group
    plait.shutdown()
    return out
