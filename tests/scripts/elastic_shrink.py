"""Elastic training that survives a lost rank: ZeRO-1 (Adam's moments sharded over the
ranks), a resumable sampler, plait.checkpoint (the 3-way test at another world size).

Every rank draws ``LOCAL_BATCH`` samples per step from a ``DistributedSampler`` over a
seeded data set; every ``--every`` steps the job saves a checkpoint (model, optimizer,
sampler) with :func:`plait.checkpoint.save`. On start it resumes with
:func:`plait.checkpoint.load` (``--resume-step S``: that step instead of the latest) at
whatever world size it now has: the optimizer state is resharded and the sampler continues
the global position. ``--cold-from S``: a fresh model and optimizer at step S instead.
``--kill R:S[,S2...]``: on restart attempt a (``PLAIT_RESTART_COUNT``) rank R SIGKILLs
itself at step S_a. Rank 0 writes the final parameters to ``--out`` and prints
``attempt <a>: world size <W>, starting at step <s>``.
"""

import argparse
import os
import signal

import torch
from torch import nn

import plait
from plait import checkpoint
from plait.data.sampler import DistributedSampler

LOCAL_BATCH = 4
N_SAMPLES = 512

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt-dir", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--every", type=int, default=4)
parser.add_argument("--kill", default=None, help="RANK:STEP[,STEP...] (one per attempt)")
parser.add_argument("--cold-from", type=int, default=None)
parser.add_argument("--resume-step", type=int, default=None)
parser.add_argument("--strategy", default="zero1")
args = parser.parse_args()

world = plait.init()
attempt = int(os.environ.get("PLAIT_RESTART_COUNT", "0"))
kill_rank, kill_steps = -1, []
if args.kill:
    r, steps = args.kill.split(":")
    kill_rank, kill_steps = int(r), [int(s) for s in steps.split(",")]
kill_at = kill_steps[attempt] if world.rank == kill_rank and attempt < len(kill_steps) else -1

torch.manual_seed(0)
raw = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
model, optimizer = plait.prepare(
    raw, torch.optim.Adam(raw.parameters(), lr=0.01), strategy=args.strategy
)
sampler = DistributedSampler(range(N_SAMPLES), shuffle=True, seed=3)
g = torch.Generator().manual_seed(1)
x = torch.randn(N_SAMPLES, 8, generator=g)
y = torch.sin(x.sum(1, keepdim=True))

start = 0
if args.cold_from is not None:
    start = args.cold_from
else:
    try:
        step = "latest" if args.resume_step is None else args.resume_step
        start = checkpoint.load(
            args.ckpt_dir, model=model, optimizer=optimizer, sampler=sampler, step=step
        ).step
    except FileNotFoundError:  # nothing committed yet
        start = 0
if world.rank == 0:
    print(f"attempt {attempt}: world size {world.size}, starting at step {start}", flush=True)

batches = iter(sampler)
for step in range(start, args.steps):
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    idx = [next(batches) for _ in range(LOCAL_BATCH)]
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
    optimizer.step()
    if (step + 1) % args.every == 0:
        checkpoint.save(
            args.ckpt_dir, step=step + 1, model=model, optimizer=optimizer, sampler=sampler
        )
final = {k: v.clone() for k, v in checkpoint.full_state_dict(model).items()}
if world.rank == 0:
    torch.save(final, args.out)
plait.shutdown()
