"""A finished 2-rank job that ends in one of four ways (argv[1]): torch's
destroy_process_group(), plait.shutdown(), both, or neither. It must exit 0 every time.
Run by tests/test_exit.py with the torchrun environment set."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import plait
from plait import comm

if __name__ == "__main__":
    plait.init()
    t = torch.ones(1000)
    for _ in range(3):
        comm.all_reduce(t)
    comm.all_reduce(t, async_op=True).wait()
    comm.all_reduce(t, algorithm="native", async_op=True).wait()
    ending = sys.argv[1]
    if ending == "destroy":
        dist.destroy_process_group()
    elif ending == "shutdown":
        plait.shutdown()
    elif ending == "both":
        plait.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
    print(f"rank {dist.get_rank() if dist.is_initialized() else '-'} done: {t[0].item()}")
