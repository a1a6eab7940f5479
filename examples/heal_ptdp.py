"""A PTD-P job whose data-parallel replicas heal: ``plait run -n 4 --heal 2
--replica-size 2 examples/heal_ptdp.py --steps 12 --kill-rank 3 --kill-step 4
--rejoin-step 7`` (docs/healing.md).

Two replicas of plait's GPT, each cut into two pipeline stages on a mesh of its own
(``ReplicaTrainer`` builds it from the store and hands it to ``build``). ``--kill-rank``
SIGKILLs that rank in step ``--kill-step`` (its first incarnation only): its replica
leaves whole, the other trains both halves of the global batch, and the launcher starts
the lost replica's two ranks again (``--heal 2``: two replacements), which join at a step
boundary. ``--rejoin-step`` makes the survivors wait there for them.
"""

import argparse
import os
import signal

import torch

from plait.heal import ReplicaLost, ReplicaTrainer
from plait.models import GPT, GPTConfig
from plait.strategies.compose import compose

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--kill-rank", type=int, default=-1)
p.add_argument("--kill-step", type=int, default=-1)
p.add_argument("--rejoin-step", type=int, default=-1, help="wait here for replacements")
args = p.parse_args()

config = GPTConfig(vocab=64, layers=2, heads=4, width=32, seq_len=16)
replacement = os.environ.get("PLAIT_HEAL_JOIN") == "1"


def build(mesh):
    model = GPT(config)  # the config's seed: the same weights on every rank
    return compose(model, torch.optim.Adam(model.parameters(), lr=1e-3), mesh=mesh, microbatches=2)


def fault(step: int, block: int) -> None:
    if not replacement and int(os.environ["RANK"]) == args.kill_rank and step == args.kill_step:
        os.kill(os.getpid(), signal.SIGKILL)


trainer = ReplicaTrainer.from_env(build, replica={"pp": 2}, fault=fault)
try:
    while trainer.steps_done < args.steps:
        if trainer.steps_done == args.rejoin_step and len(trainer.members) < 4:
            trainer.wait_for_replacements(timeout=120)
        g = torch.Generator().manual_seed(trainer.steps_done)  # the global batch of this step
        ids = torch.randint(0, config.vocab, (8, config.seq_len + 1), generator=g)
        loss = trainer.step(ids[:, :-1], ids[:, 1:])
except ReplicaLost as exc:  # a rank of this replica died: this one leaves, a new one comes
    raise SystemExit(f"rank {trainer.rank}: {str(exc)[:120]}...") from None
if trainer.rank == trainer.members[0]:
    print(
        f"steps {trainer.steps_done}, members {list(trainer.members)}, loss {loss.item():.4f}, "
        f"healed {[(h['kind'], h['to']) for h in trainer.heals]}"
    )
trainer.close()
