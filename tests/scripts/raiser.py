"""Rank ``argv[1]`` raises after one all-reduce; the others then fail in the next one."""

import sys
import time

import torch

import plait
from plait import comm

bad = int(sys.argv[1])
world = plait.init()
t = torch.ones(4)
comm.all_reduce(t, algorithm="ring")
if world.rank == bad:
    raise ValueError(f"deliberate failure on rank {bad}")
time.sleep(0.2)
for _ in range(50):  # the failed rank never comes: these raise (connection closed/timeout)
    comm.all_reduce(t, algorithm="ring")
plait.shutdown()
