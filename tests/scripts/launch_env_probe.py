"""A rank that reports what it joined as: ``plait.init()`` under whatever launcher started
it, one all-reduce of ``rank + 1``, then ``RESULT <json>`` (the torchrun variables it saw
after init, the world's rank and size, the sum)."""

import json
import os

import torch

import plait
from plait import comm

world = plait.init(timeout=120)
t = torch.tensor([float(world.rank + 1)])
comm.all_reduce(t)
seen = {
    k: os.environ.get(k)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
}
result = {
    "rank": world.rank,
    "size": world.size,
    "sum": t.item(),
    "env": seen,
    "elastic": os.environ.get("TORCHELASTIC_RUN_ID"),
}
print("RESULT " + json.dumps(result), flush=True)
plait.shutdown()
