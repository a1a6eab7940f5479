"""Under ``plait run -n 4``: an asynchronous parameter-server job (rank 0 serves, ranks
1-3 train 6 steps) whose worker ``argv[1]`` dies (os._exit) before its step 2. The
server checks that it named exactly that worker as failed and applied every other push;
the job must end with exit code 0."""

import os
import sys
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.* importable

import plait  # noqa: E402
from plait.strategies.ps import ps_of  # noqa: E402
from tests.ddp_fns import batch, make_model, make_optimizer, shard  # noqa: E402

STEPS = 6
dying = int(sys.argv[1])
world = plait.init()
model = make_model()
wrapped, optimizer = plait.prepare(model, make_optimizer(model, "sgd"), strategy="ps", mode="async")
if optimizer is None:  # the server: prepare served until every worker finished or failed
    stats = ps_of(wrapped).stats()
    print(f"server: {stats.updates} updates, failed {stats.failed_workers}", flush=True)
    assert list(stats.failed_workers) == [dying], stats.failed_workers
    assert stats.updates == STEPS * 2 + 2, stats.updates
else:
    w, n = world.rank - 1, world.size - 1
    for step in range(STEPS):
        if world.rank == dying and step == 2:
            os._exit(17)
        x, y = batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(wrapped(shard(x, w, n)), shard(y, w, n)).backward()
        optimizer.step()
    optimizer.finish()
    print(f"worker {world.rank}: {STEPS} steps", flush=True)
plait.shutdown()
