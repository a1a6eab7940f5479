"""Rank ``argv[1]`` sets environment variable ``argv[2]`` to ``argv[3]`` before
``plait.init``; every rank then all-reduces once and prints the sum. A rank whose
``plait.init`` raises first prints ``rank R: plait.init raised after S s`` (counted from
the call: interpreter start-up and imports apart)."""

import os
import sys
import time

import torch

import plait
from plait import comm

if int(os.environ["RANK"]) == int(sys.argv[1]):
    os.environ[sys.argv[2]] = sys.argv[3]
start = time.monotonic()
try:
    world = plait.init()
except Exception:
    took = time.monotonic() - start
    print(f"rank {os.environ['RANK']}: plait.init raised after {took:.2f}s", flush=True)
    raise
t = torch.ones(4)
comm.all_reduce(t)
print(f"rank {world.rank} sum {t[0].item():g}", flush=True)
plait.shutdown()
