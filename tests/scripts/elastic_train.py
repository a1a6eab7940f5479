"""Deterministic data-parallel training that checkpoints and resumes (the 3-way test).

Every rank computes gradients on its slice of a seeded global batch, sums them with a ring
all-reduce and steps SGD with momentum (optimizer state matters: a weights-only resume
would differ). Every ``--every`` steps rank 0 writes the full state (model, optimizer,
next step) to ``<ckpt-dir>/step-<k>.pt`` atomically, then all ranks pass a barrier. On
start the script resumes from the highest step file there; ``--cold-from S`` instead
starts fresh (new model, new optimizer) at step S. ``--kill R:S[,S2...]``: on restart
attempt a (``PLAIT_RESTART_COUNT``, or
``TORCHELASTIC_RESTART_COUNT`` under torchrun) rank R SIGKILLs itself at step S_a.
``--late-rank0 T``: on a restart, rank 0 waits T s before it rendezvouses (the others then
read the store first: a store kept from the failed attempt hands them its stale keys).
Rank 0 writes the final parameters to ``--out``.
"""

import argparse
import os
import signal
import time
from pathlib import Path

import torch

import plait
from plait import comm

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt-dir", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--every", type=int, default=4)
parser.add_argument("--kill", default=None, help="RANK:STEP[,STEP...] (one per attempt)")
parser.add_argument("--cold-from", type=int, default=None)
parser.add_argument(
    "--late-rank0", type=float, default=0.0, help="seconds rank 0 waits before init on restarts"
)
args = parser.parse_args()

attempt = int(
    os.environ.get("PLAIT_RESTART_COUNT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
)
if attempt > 0 and os.environ.get("RANK") == "0":
    time.sleep(args.late_rank0)  # as a loaded machine may: the others rendezvous first
world = plait.init()
kill_rank, kill_steps = -1, []
if args.kill:
    r, steps = args.kill.split(":")
    kill_rank, kill_steps = int(r), [int(s) for s in steps.split(",")]
kill_at = kill_steps[attempt] if world.rank == kill_rank and attempt < len(kill_steps) else -1

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
ckpt = Path(args.ckpt_dir)
start = 0
if args.cold_from is not None:
    start = args.cold_from
else:
    saved = sorted(ckpt.glob("step-*.pt"))
    if saved:
        state = torch.load(saved[-1], weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
if world.rank == 0:
    print(f"attempt {attempt}: starting at step {start}", flush=True)

per_rank = 8
for step in range(start, args.steps):
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(per_rank * world.size, 8, generator=g)
    y = torch.sin(x.sum(1, keepdim=True))
    mine = slice(world.rank * per_rank, (world.rank + 1) * per_rank)
    loss = ((model(x[mine]) - y[mine]) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        assert p.grad is not None
        comm.all_reduce(p.grad, algorithm="ring")
        p.grad /= world.size
    opt.step()
    if (step + 1) % args.every == 0:
        if world.rank == 0:
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}
            tmp = ckpt / f".step-{step + 1:04d}.tmp"
            torch.save(state, tmp)
            os.replace(tmp, ckpt / f"step-{step + 1:04d}.pt")
        comm.barrier()
if world.rank == 0:
    torch.save(model.state_dict(), args.out)
plait.shutdown()
