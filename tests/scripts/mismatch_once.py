"""Attempt 0: rank 0 all-reduces while rank 1 broadcasts, a mismatch both ranks name (each
dumps its flight recorder, then raises); the restarted attempt agrees and ends well."""

import os

import torch

import plait
from plait import comm

world = plait.init()
t = torch.ones(4)
comm.all_reduce(t)  # one collective the ranks agree on: the dumps hold it too
attempt = os.environ["PLAIT_RESTART_COUNT"]
if attempt == "0":
    if world.rank == 0:
        comm.all_reduce(t)
    else:
        comm.broadcast(t, 0)
print(f"rank {world.rank}: attempt {attempt} done", flush=True)
plait.shutdown()
