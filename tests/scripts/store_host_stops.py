"""A rank of a 2-rank job rendezvoused by env:// (rank 0 hosts the TCPStore, as under
torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 or plait.init from a plain script).

For each delay in ``argv[1:]`` (seconds), rank 0 prints ``ROUND <i>`` and sleeps that long
before joining a naive all-reduce that rank 1 enters at once; the test stops rank 0 (and
with it the store) meanwhile. Every rank prints one JSON line per round (``ok`` or the
error), and at the end the stalls it logged."""

import json
import os
import sys
import time

import torch

import plait
from plait import comm
from plait.comm import watchdog

world = plait.init()
print(json.dumps({"rank": world.rank, "pid": os.getpid()}), flush=True)
for i, delay in enumerate(float(a) for a in sys.argv[1:]):
    comm.barrier()
    if world.rank == 0:
        print(f"ROUND {i}", flush=True)
        time.sleep(delay)
    t = torch.full((4,), float(world.rank + 1))
    try:
        comm.all_reduce(t, algorithm="naive")
    except comm.CollectiveError as exc:
        out = {"rank": world.rank, "round": i, "error": type(exc).__name__, "at": time.time()}
        out.update(message=str(exc), ranks=getattr(exc, "ranks", None))
        out.update(store_stalls=watchdog.store_stalls(), stalls=watchdog.stalls())
        print(json.dumps(out), flush=True)
        os._exit(1)
    print(json.dumps({"rank": world.rank, "round": i, "ok": t.tolist() == [3.0] * 4}), flush=True)
time.sleep(0.5)
stalls = {"store_stalls": watchdog.store_stalls(), "stalls": watchdog.stalls()}
print(json.dumps({"rank": world.rank, **stalls}), flush=True)
plait.shutdown()
