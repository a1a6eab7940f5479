"""A rank for launcher tests: records its pid, then waits (no process group).

Options: ``--beat`` writes ``plait/heartbeat/<rank>`` into the launcher's store every 0.2 s
from the main thread (so a SIGSTOPped rank stops beating); ``--ignore-term R`` makes rank R
ignore SIGTERM (the launcher must SIGKILL it); ``--may-exit R`` makes rank R set
``plait/launch/may_exit/R`` and exit with code 5; ``--exit-after S``: the others exit 0
after S seconds (from restart attempt ``--from-attempt`` on; earlier attempts wait).
Attempt a > 0 writes its pid files under ``<pid-dir>/a<a>/``.
"""

import argparse
import datetime
import os
import signal
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--pid-dir", required=True)
parser.add_argument("--beat", action="store_true")
parser.add_argument("--ignore-term", type=int, default=-1)
parser.add_argument("--may-exit", type=int, default=-1)
parser.add_argument("--exit-after", type=float, default=600.0)
parser.add_argument("--from-attempt", type=int, default=0, help="--exit-after from attempt")
args = parser.parse_args()
rank = int(os.environ["RANK"])
attempt = int(os.environ.get("PLAIT_RESTART_COUNT", "0"))
if attempt < args.from_attempt:
    args.exit_after = 600.0
if attempt:  # later attempts record their pids apart: a<attempt>-<rank>
    os.makedirs(os.path.join(args.pid_dir, f"a{attempt}"), exist_ok=True)
    args.pid_dir = os.path.join(args.pid_dir, f"a{attempt}")
if rank == args.ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
store = None
if args.beat or args.may_exit >= 0:
    import torch.distributed as dist

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        None,
        False,
        timeout=datetime.timedelta(seconds=30),
    )
if store is not None and args.beat:
    store.set(f"plait/heartbeat/{rank}", repr(time.time()))
tmp = os.path.join(args.pid_dir, f".{rank}.tmp")
with open(tmp, "w") as f:
    f.write(str(os.getpid()))
os.replace(tmp, os.path.join(args.pid_dir, str(rank)))
if rank == args.may_exit:
    assert store is not None
    store.set(f"plait/launch/may_exit/{rank}", "1")
    sys.exit(5)
end = time.time() + args.exit_after
while time.time() < end:
    if store is not None and args.beat:
        store.set(f"plait/heartbeat/{rank}", repr(time.time()))
    time.sleep(0.2)
print(f"rank {rank} done", flush=True)
