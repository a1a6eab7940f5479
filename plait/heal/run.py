"""``python -m plait.heal.run -n 4 [--replacements K] [--replica-size P] script.py args``:
a healing job on this machine.

Hosts the rendezvous store (it must outlive every rank) and starts ``n`` ranks, each
``python script.py args`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` set (the script builds :meth:`plait.heal.HealingTrainer.from_env`).
Unlike ``plait run``, a rank that dies does not stop the others: they heal. With
``--replacements K`` (default 0) a rank that exits non-zero is started again, at most K
times in all, with ``PLAIT_HEAL_JOIN=1``: it joins at the next step boundary. The job's
exit code is 0 when a rank trained to the end (exit 0: the others healed around the
ones that died), 1 otherwise; ranks still running when it stops get SIGTERM, then
SIGKILL. ``--replica-size P``: the ranks form model-parallel replicas of ``P``
(:class:`~plait.heal.replicas.ReplicaTrainer`): when one dies the others of its replica
leave too (they exit non-zero) and each is started again, so the replica comes back whole
(count ``P`` replacements per lost replica).

A replacement by hand (another terminal, the job's store address printed at start)::

    PLAIT_HEAL_JOIN=1 RANK=2 WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=<port> \\
        python script.py args
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from plait.heal.launch import start_store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plait.heal.run")
    parser.add_argument("-n", "--nproc", type=int, required=True)
    parser.add_argument("--replacements", type=int, default=0)
    parser.add_argument("--replica-size", type=int, default=1)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    a = parser.parse_args(argv)
    size = a.replica_size
    replicas = a.nproc // size if size >= 1 and a.nproc % size == 0 else 0
    if replicas < 1 or replicas & (replicas - 1):
        print(
            f"plait.heal.run: -n {a.nproc} in replicas of {size}: the number of replicas must "
            f"be a whole power of two (the tree's blocks)",
            file=sys.stderr,
        )
        return 2
    store, address = start_store()
    host, port = address.rsplit(":", 1)
    print(f"plait.heal.run: {a.nproc} ranks, store at {address}", file=sys.stderr, flush=True)

    def start(slot: int, join: bool) -> subprocess.Popen[bytes]:
        env = dict(
            os.environ,
            RANK=str(slot),
            WORLD_SIZE=str(a.nproc),
            MASTER_ADDR=host,
            MASTER_PORT=port,
            PLAIT_HEAL_JOIN="1" if join else "0",
        )
        return subprocess.Popen([sys.executable, a.script, *a.args], env=env)

    procs = {s: start(s, False) for s in range(a.nproc)}
    left = a.replacements
    codes: dict[int, int] = {}
    try:
        while procs:
            for s, p in list(procs.items()):
                code = p.poll()
                if code is None:
                    continue
                del procs[s]
                codes[s] = code
                if code != 0:
                    print(
                        f"plait.heal.run: rank {s} exited with {code}; the others heal",
                        file=sys.stderr,
                        flush=True,
                    )
                    if left > 0:
                        left -= 1
                        print(
                            f"plait.heal.run: starting a replacement for rank {s}",
                            file=sys.stderr,
                            flush=True,
                        )
                        procs[s] = start(s, True)
            time.sleep(0.1)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        del store
    return 0 if 0 in codes.values() else 1  # some rank trained to the end


if __name__ == "__main__":
    raise SystemExit(main())
