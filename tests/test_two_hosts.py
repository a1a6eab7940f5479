"""Two hosts on one machine: a job across two network namespaces the test creates.

Each namespace gets one end of a veth pair, addressed 10.77.0.1/24 and 10.77.0.2/24 (the
only addresses used, and only inside these namespaces, which the test deletes). Two
launchers, one per "host", start 2 ranks each: torchrun's multi-node c10d rendezvous, and
``plait run --nnodes 2`` (which hands over to torchrun's static rendezvous). Every rank
must see the ranks grouped by host (LOCAL_WORLD_SIZE blocks = the namespaces' addresses)
and get the right hierarchical all-reduce. Then the link is cut (``ip link set ... down``)
and both sides must fail by the heartbeat timeout, not the collective timeout, naming the
other side:
host A, which holds the store, names host B's rank by its stale heartbeat; host B, whose
store reads now block, names host A's address and ranks (the store watch of
``plait/comm/progress.py``). Needs root (skipped otherwise).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.faultlog import record

SCRIPT = Path(__file__).parent / "scripts" / "two_hosts.py"
ROOT = Path(__file__).parent.parent
ADDR = {"a": "10.77.0.1", "b": "10.77.0.2"}
TAG = f"{os.getpid() % 100000}"
pytestmark = pytest.mark.skipif(
    not os.environ.get("PLAIT_FULL_FAULTS"),
    reason="two-host tests run with the full fault matrix: benchmarks/faults.py "
    "(or PLAIT_FULL_FAULTS=1)",
)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextmanager
def two_namespaces() -> Iterator[dict[str, tuple[str, str]]]:
    """{"a": (namespace, veth), "b": (...)}; deleted on exit whatever happened."""
    if os.geteuid() != 0:
        pytest.skip("two-host test needs root (ip netns add)")
    ns = {k: (f"plait{TAG}{k}", f"pv{TAG}{k}") for k in ("a", "b")}
    created: list[str] = []
    try:
        for name, _ in ns.values():
            try:
                ip("netns", "add", name)
            except (subprocess.CalledProcessError, FileNotFoundError) as exc:
                pytest.skip(f"cannot create network namespaces here: {exc}")
            created.append(name)
        ip("link", "add", ns["a"][1], "type", "veth", "peer", "name", ns["b"][1])
        for k, (name, veth) in ns.items():
            ip("link", "set", veth, "netns", name)
            ip("-n", name, "addr", "add", f"{ADDR[k]}/24", "dev", veth)
            ip("-n", name, "link", "set", veth, "up")
            ip("-n", name, "link", "set", "lo", "up")
        yield ns
    finally:
        for name in created:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


class Node:
    """One launcher in one namespace; output in a file."""

    def __init__(self, tmp: Path, ns: str, veth: str, cmd: list[str], env: dict[str, str]):
        self.log = tmp / f"{ns}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, *cmd],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, GLOO_SOCKET_IFNAME=veth, **env),
                cwd=ROOT,
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def results(self) -> list[dict]:
        return [json.loads(m) for m in re.findall(r"^RESULT (.*)$", self.text(), re.M)]


def wait_for(cond, timeout: float, nodes: list[Node]) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.2)
    logs = "\n".join(f"--- {n.log.name}\n{n.text()[-3000:]}" for n in nodes)
    raise AssertionError(f"timed out after {timeout}s\n{logs}")


def stop(nodes: list[Node]) -> None:
    """SIGKILL (by pid) every rank the nodes reported and every launcher."""
    for n in nodes:
        for r in n.results():
            try:
                os.kill(int(r["pid"]), signal.SIGKILL)
            except ProcessLookupError:
                pass
        if n.proc.poll() is None:
            n.proc.kill()
        n.proc.wait(30)


def check_grouping(nodes: list[Node]) -> None:
    results = sorted((r for n in nodes for r in n.results()), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    hosts = results[0]["hosts"]
    assert hosts in (
        [ADDR["a"], ADDR["a"], ADDR["b"], ADDR["b"]],
        [ADDR["b"], ADDR["b"], ADDR["a"], ADDR["a"]],
    ), hosts
    for r in results:
        assert r["hosts"] == hosts and r["local_world_size"] == 2 and r["sum_ok"], r
    # hierarchical node of global rank g is g // LOCAL_WORLD_SIZE: the same blocks as hosts
    assert [g // 2 for g in range(4)] == [hosts.index(h) // 2 for h in hosts]


CUT_OFF = f"cut off from the other host(s) (host {ADDR['a']}: ranks 0, 1)"
HEARTBEAT_TIMEOUT_S = 5.0
# the collective timeout: a cut link named by the heartbeat comes before it (the old
# behaviour waited it out)
COLLECTIVE_TIMEOUT_S = 20.0
ENV = {
    "PLAIT_TIMEOUT": f"{COLLECTIVE_TIMEOUT_S:g}",
    "PLAIT_HEARTBEAT_TIMEOUT": f"{HEARTBEAT_TIMEOUT_S:g}",
    "OMP_NUM_THREADS": "1",
}


def test_torchrun_c10d_across_two_namespaces(tmp_path: Path) -> None:
    with two_namespaces() as ns:
        nodes = []
        try:
            for k, (name, veth) in ns.items():
                cmd = [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes=2",
                    "--nproc-per-node=2",
                    "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={ADDR['a']}:29400",
                    f"--rdzv-id=plait{TAG}",
                    f"--rdzv-conf=is_host={1 if k == 'a' else 0}",
                    f"--local-addr={ADDR[k]}",
                    str(SCRIPT),
                    "0",
                ]
                nodes.append(Node(tmp_path, name, veth, cmd, ENV))
            wait_for(lambda: all(n.proc.poll() is not None for n in nodes), 300, nodes)
            assert [n.proc.returncode for n in nodes] == [0, 0], [n.text() for n in nodes]
            check_grouping(nodes)
        finally:
            stop(nodes)


@pytest.mark.faults
def test_plait_run_two_nodes_and_a_cut_link(tmp_path: Path) -> None:
    with two_namespaces() as ns:
        nodes = []
        try:
            for rank, (k, (name, veth)) in enumerate(ns.items()):
                cmd = [
                    sys.executable,
                    "-m",
                    "plait.cli",
                    "run",
                    "-n",
                    "2",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(rank),
                    "--master-addr",
                    ADDR["a"],
                    "--master-port",
                    "29500",
                    "--local-addr",
                    ADDR[k],
                    str(SCRIPT),
                    "120",
                ]
                nodes.append(Node(tmp_path, name, veth, cmd, ENV))
            wait_for(lambda: sum(len(n.results()) for n in nodes) == 4, 300, nodes)
            check_grouping(nodes)
            time.sleep(1.0)
            cut = time.time()
            ip("-n", ns["b"][0], "link", "set", ns["b"][1], "down")
            both = lambda: all(n.text().count("\nFAILED ") >= 2 for n in nodes)  # noqa: E731
            wait_for(both, 120, nodes)
            found = {}
            for k, n in zip(ns, nodes, strict=True):
                lines = re.findall(r"^FAILED ([\d.]+) (rank \d+: .*)$", n.text(), re.M)
                found[k] = [(float(t) - cut, msg) for t, msg in lines]
            # host A (holds the store) names host B's rank by its stale heartbeat; host B
            # (cut off from the store) names host A's address and ranks
            named = {
                "a": all(any(f"on rank {r} (host" in msg for r in (2, 3)) for _, msg in found["a"]),
                "b": all(f"{CUT_OFF}: no heartbeat" in msg for _, msg in found["b"]),
            }
            detected = {k: max(t for t, _ in f) for k, f in found.items()}
            record(
                row=17,
                fault="link between two netns hosts cut (ip link set down)",
                detected_after_s=round(max(detected.values()), 2),
                named_correctly=all(named.values()),
                note=f"host A after {detected['a']:.1f}s (names host B's rank: {named['a']}), "
                f"host B after {detected['b']:.1f}s (names host A's address and ranks: "
                f"{named['b']}); PLAIT_HEARTBEAT_TIMEOUT={HEARTBEAT_TIMEOUT_S:g}, "
                f"PLAIT_TIMEOUT={COLLECTIVE_TIMEOUT_S:g}",
            )
            assert named["a"], found["a"]
            assert named["b"], found["b"]
            # by the heartbeat (about HEARTBEAT_TIMEOUT_S + 0.5 s beat period: recorded),
            # so before the collective timeout would have fired
            assert all(t < COLLECTIVE_TIMEOUT_S for t in detected.values()), found
        finally:
            stop(nodes)
