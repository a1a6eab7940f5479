"""A rank of the two-host job: which address it reaches the other namespace from, a
hierarchical all-reduce, then all-reduces until the link is cut (``argv[1]`` = seconds to
keep going). Prints ``RESULT <json>`` once and ``FAILED <time> <error>`` if a collective
fails."""

import json
import os
import socket
import sys
import time

import torch

import plait
from plait import comm

world = plait.init()
probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
probe.connect(("10.77.0.1", 9))  # UDP connect: picks the local address, sends nothing
my_ip = probe.getsockname()[0]
probe.close()
codes = torch.tensor([int(my_ip.rsplit(".", 1)[1])], dtype=torch.int64)
gathered = torch.empty(world.size, dtype=torch.int64)
comm.all_gather(gathered, codes)
t = torch.arange(8, dtype=torch.float64) * (world.rank + 1)
comm.all_reduce(t, algorithm="hierarchical")
expected = torch.arange(8, dtype=torch.float64) * (world.size * (world.size + 1) // 2)
result = {
    "rank": world.rank,
    "pid": os.getpid(),
    "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
    "hosts": [f"10.77.0.{c}" for c in gathered.tolist()],
    "sum_ok": torch.equal(t, expected),
}
print("RESULT " + json.dumps(result), flush=True)
end = time.time() + float(sys.argv[1])
x = torch.ones(1000)
try:
    while time.time() < end:
        comm.all_reduce(x, algorithm="ring")
        x.fill_(1.0)
        time.sleep(0.05)
except Exception as exc:
    print(
        f"FAILED {time.time():.3f} rank {world.rank}: {type(exc).__name__}: "
        f"{str(exc).splitlines()[0][:300]}",
        flush=True,
    )
    sys.stdout.flush()
    os._exit(1)
plait.shutdown()
