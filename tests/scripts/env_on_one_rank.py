"""Rank ``argv[1]`` sets environment variable ``argv[2]`` to ``argv[3]`` before
``plait.init``; every rank then all-reduces once and prints the sum."""

import os
import sys

import torch

import plait
from plait import comm

if int(os.environ["RANK"]) == int(sys.argv[1]):
    os.environ[sys.argv[2]] = sys.argv[3]
world = plait.init()
t = torch.ones(4)
comm.all_reduce(t)
print(f"rank {world.rank} sum {t[0].item():g}", flush=True)
plait.shutdown()
