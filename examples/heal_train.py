"""A data-parallel job that heals: ``python -m plait.heal.run -n 4 --replacements 1
examples/heal_train.py --steps 12 --kill-rank 2 --kill-step 5 --rejoin-step 8``
(docs/healing.md).

Every rank builds the same model from the same seed and reads the global batch of step
``trainer.steps_done`` (the data cursor a replacement receives). ``--kill-rank`` SIGKILLs
that rank in step ``--kill-step`` (its first incarnation only) to show the healing;
``--rejoin-step`` makes the survivors wait there for the replacement (a short run would
otherwise end before a fresh process has imported torch).
"""

import argparse
import os
import signal

import torch
from torch import nn

from plait.heal import HealingTrainer

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--kill-rank", type=int, default=-1)
p.add_argument("--kill-step", type=int, default=-1)
p.add_argument("--rejoin-step", type=int, default=-1, help="wait here for replacements")
p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="3: FSDP")
args = p.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
replacement = os.environ.get("PLAIT_HEAL_JOIN") == "1"


def fault(step: int, index: int) -> None:
    if not replacement and int(os.environ["RANK"]) == args.kill_rank and step == args.kill_step:
        os.kill(os.getpid(), signal.SIGKILL)


trainer = HealingTrainer.from_env(
    model,
    torch.optim.Adam(model.parameters(), lr=1e-2),
    loss_fn=nn.functional.cross_entropy,
    microbatch_size=8,
    fault=fault,
    zero=args.zero,
)
while trainer.steps_done < args.steps:
    if trainer.steps_done == args.rejoin_step and len(trainer.members) < trainer.world:
        trainer.wait_for_replacements(timeout=120)
    g = torch.Generator().manual_seed(trainer.steps_done)  # the global batch of this step
    x, y = torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)
    loss = trainer.step(x, y)
if trainer.slot == trainer.members[0]:
    print(
        f"steps {trainer.steps_done}, members {list(trainer.members)}, loss {loss.item():.4f}, "
        f"healed {[(h['kind'], h['to']) for h in trainer.heals]}"
    )
trainer.close()
