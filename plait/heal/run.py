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
from typing import Any

from plait.heal.launch import connect_store, start_store

NODE_BEAT_S = 1.0  # each launcher beats its node's key this often
NODE_GONE_S = 30.0  # node 0 stops waiting for a launcher silent this long (its machine died)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plait.heal.run")
    parser.add_argument("-n", "--nproc", type=int, required=True, help="ranks on this machine")
    parser.add_argument("--replacements", type=int, default=0, help="on this machine")
    parser.add_argument("--replica-size", type=int, default=1)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=0)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    a = parser.parse_args(argv)
    world = a.nproc * a.nnodes
    size = a.replica_size
    replicas = world // size if size >= 1 and world % size == 0 else 0
    bad = []
    if replicas < 1 or replicas & (replicas - 1):
        bad.append(
            f"{world} ranks in replicas of {size}: the number of replicas must be a whole "
            f"power of two (the tree's blocks)"
        )
    if a.nnodes > 1 and size > 1 and a.nproc % size:
        bad.append(
            f"-n {a.nproc} per machine in replicas of {size}: a replica must not straddle "
            f"two machines here (give each machine whole replicas)"
        )
    if not 0 <= a.node_rank < a.nnodes:
        bad.append(f"--node-rank {a.node_rank}: must be in 0..{a.nnodes - 1}")
    if a.nnodes > 1 and not a.master_port:
        bad.append("--nnodes > 1 needs --master-port (where node 0 hosts the store)")
    if bad:
        print("plait.heal.run: " + "; ".join(bad), file=sys.stderr)
        return 2
    if a.node_rank == 0:
        store, address = start_store(a.master_addr, a.master_port)
    else:
        store, address = (
            connect_store(a.master_addr, a.master_port),
            (f"{a.master_addr}:{a.master_port}"),
        )
    host, port = address.rsplit(":", 1)
    first = a.node_rank * a.nproc
    print(
        f"plait.heal.run: ranks {first}..{first + a.nproc - 1} of {world} on this machine "
        f"(node {a.node_rank} of {a.nnodes}), store at {address}",
        file=sys.stderr,
        flush=True,
    )

    def start(slot: int, join: bool) -> subprocess.Popen[bytes]:
        env = dict(
            os.environ,
            RANK=str(slot),
            LOCAL_RANK=str(slot - first),
            WORLD_SIZE=str(world),
            MASTER_ADDR=host,
            MASTER_PORT=port,
            PLAIT_HEAL_JOIN="1" if join else "0",
        )
        return subprocess.Popen([sys.executable, a.script, *a.args], env=env)

    procs = {s: start(s, False) for s in range(first, first + a.nproc)}
    left = a.replacements
    codes: dict[int, int] = {}
    beat = time.monotonic()
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
            if a.nnodes > 1 and time.monotonic() - beat > NODE_BEAT_S:
                beat = time.monotonic()
                _beat_node(store, a.node_rank)
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
    ok = 0 in codes.values()  # some rank of this machine trained to the end
    if a.nnodes > 1:
        ok = _finish_nodes(store, a.node_rank, a.nnodes, ok)
    del store
    return 0 if ok else 1


def _beat_node(store: Any, node: int) -> None:
    try:
        store.set(f"plait/heal/node/{node}/beat", repr(time.time()))
    except Exception:  # node 0's store gone: this machine's ranks find out themselves
        pass


def _finish_nodes(store: Any, node: int, nnodes: int, ok: bool) -> bool:
    """Say this machine is done; node 0 keeps the store alive until every other machine's
    launcher said so (or went silent for :data:`NODE_GONE_S`: its machine died) and
    returns whether any machine's ranks trained to the end."""
    try:
        store.set(f"plait/heal/node/{node}/done", "0" if ok else "1")
    except Exception:
        return ok
    if node != 0:
        return ok
    done: dict[int, str] = {0: "0" if ok else "1"}
    while len(done) < nnodes:
        for n in range(1, nnodes):
            if n in done:
                continue
            if store.check([f"plait/heal/node/{n}/done"]):
                done[n] = store.get(f"plait/heal/node/{n}/done").decode()
                continue
            key = f"plait/heal/node/{n}/beat"
            last = float(store.get(key).decode()) if store.check([key]) else 0.0
            if last and time.time() - last > NODE_GONE_S:
                print(
                    f"plait.heal.run: the launcher of node {n} went silent for "
                    f"{NODE_GONE_S:.0f} s (its machine died?); not waiting for it",
                    file=sys.stderr,
                    flush=True,
                )
                done[n] = "1"
        time.sleep(0.2)
    return "0" in done.values()


if __name__ == "__main__":
    raise SystemExit(main())
