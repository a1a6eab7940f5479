"""Processes for the DDP fault tests: one survivor, one faulty peer per scenario.

Run by tests/test_ddp_faults.py as ``python -m tests.ddp_fault_fns SCENARIOS`` with the
torchrun variables set, one process per rank (no pool: the faulty ranks really die). Rank
0 is the survivor; rank j >= 1 is the peer of scenario j, and every scenario runs on its
own pair group ``[0, j]``, one after the other, so one survivor serves them all. The peer
trains ``FAULT_STEP`` steps with the survivor, then, at the start of the next step (before
its all-reduce), it

- ``raise``: raises an exception that nothing catches (the interpreter exits with 1);
- ``exit``: returns from its training loop and ends normally, as a rank with fewer
  batches does (uneven data);
- ``kill``: dies at once with ``os._exit`` (as after SIGKILL: no cleanup at all).

It writes the time of its fault to the rendezvous store first. The survivor prints one
JSON line per scenario: the exception its ``backward()`` raised, and how long after the
fault.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import plait
from plait import comm
from plait.strategies.data_parallel import hooks as comm_hooks

FAULT_STEP = 2
STEPS = 4
TIMEOUT_S = 120.0  # peers wait at their wrap while the survivor serves earlier scenarios


def user_hook(state: Any, bucket: comm_hooks.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A user's hook written as the docs ask: its callback reads the parent's value."""
    buf = bucket.buffer()
    buf.div_(bucket.group.size)
    handle = comm.all_reduce(buf, "sum", group=bucket.group, algorithm="ring", async_op=True)
    assert handle is not None

    def done(fut: torch.futures.Future[Any]) -> torch.Tensor:
        fut.value()
        return buf

    return handle.get_future().then(done)


def swallowing_hook(
    state: Any, bucket: comm_hooks.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A careless user's hook: its callback never reads the parent's value."""
    buf = bucket.buffer()
    buf.div_(bucket.group.size)
    handle = comm.all_reduce(buf, "sum", group=bucket.group, algorithm="ring", async_op=True)
    assert handle is not None
    return handle.get_future().then(lambda _: buf)


HOOKS = {
    "allreduce_hook": comm_hooks.allreduce_hook,
    "fp16_hook": comm_hooks.fp16_compress_hook,
    "bf16_hook": comm_hooks.bf16_compress_hook,
    "user_hook": user_hook,
    "swallowing_hook": swallowing_hook,
}


def wrap(path: str, model: nn.Module, group: comm.Group) -> nn.Module:
    """``path``: ``ddp-<algorithm>``, ``ddp-<hook>`` or ``naive``."""
    if path == "naive":
        return plait.NaiveDataParallel(model, group=group)
    what = path.removeprefix("ddp-")
    if what in HOOKS:
        ddp = plait.DistributedDataParallel(model, group=group, bucket_mb=0.001)
        ddp.register_comm_hook(None, HOOKS[what])
        return ddp
    return plait.DistributedDataParallel(model, group=group, algorithm=what, bucket_mb=0.001)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def step(wrapped: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
    opt.zero_grad()
    nn.functional.mse_loss(wrapped(x), y).backward()
    opt.step()


def survivor(store: Any, scenarios: list[tuple[str, str]], pairs: list[Any]) -> None:
    for j, ((path, fault), group) in enumerate(zip(scenarios, pairs, strict=True), start=1):
        net = model()
        wrapped = wrap(path, net, group)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        result: dict[str, Any] = {"scenario": j, "path": path, "fault": fault, "error": None}
        for i in range(STEPS):
            try:
                step(wrapped, opt, i)
            except Exception as exc:
                now = time.time()
                fault_at = float(store.get(f"fault/{j}").decode())
                result.update(
                    error=type(exc).__name__,
                    collective_error=isinstance(exc, comm.CollectiveError),
                    message=str(exc),
                    step=i,
                    detected_after_s=now - fault_at,
                )
                break
        print(json.dumps(result), flush=True)


def peer(store: Any, j: int, path: str, fault: str, group: Any) -> None:
    net = model()
    wrapped = wrap(path, net, group)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for i in range(STEPS):
        if i == FAULT_STEP:
            store.set(f"fault/{j}", repr(time.time()))
            if fault == "raise":
                raise RuntimeError(f"injected failure on rank {j} before its all-reduce")
            if fault == "kill":
                os._exit(9)
            return  # "exit": this rank ran out of data
        step(wrapped, opt, i)


def main() -> None:
    scenarios = [tuple(s.split(":")) for s in sys.argv[1].split(",")]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    plait.init(store=store, timeout=TIMEOUT_S)
    torch.set_num_threads(1)
    pairs = [comm.new_group([0, j], name=f"pair{j}") for j in range(1, world)]
    if rank == 0:
        survivor(store, scenarios, pairs)  # type: ignore[arg-type]
        sys.stdout.flush()
        os._exit(0)  # the world group has dead members: skip the teardown
    path, fault = scenarios[rank - 1]
    peer(store, rank, path, fault, pairs[rank - 1])
    # "exit" (uneven data) ends here, normally, without waiting for the survivor


if __name__ == "__main__":
    main()
