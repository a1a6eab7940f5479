"""Healing under more faults (fresh processes each; in the slow set, tests/conftest.py):
a kill at several steps and ranks, a rank that raises, one that freezes past the
heartbeat, a second death while healing, a replacement that dies on arrival, and the
tolerance without reproducible mode."""

from __future__ import annotations

import numpy as np
import pytest

from plait.demo.heal import HealConfig, max_diff, reference, run


def _run(tmp_path, **kw):
    c = HealConfig(**kw)
    report = run(c, str(tmp_path), deadline=90)
    return report, max_diff(report, reference(c))


@pytest.mark.parametrize("slot,step,index", [(0, 0, 0), (3, 1, 7), (1, 4, 3), (2, 2, 4)])
def test_kill_any_rank_at_any_step_then_rejoin_bitwise(tmp_path, slot, step, index):
    report, diff = _run(
        tmp_path,
        faults=[[slot, step, index, "kill"]],
        rejoin=True,
        rejoin_step=step + 1,
        steps=step + 3,
    )
    assert len(report.finals) == 4 and f"slot{slot}-join" in report.finals
    assert diff == 0.0


def test_a_rank_that_raises_is_dropped_at_once(tmp_path):
    report, diff = _run(tmp_path, faults=[[0, 1, 0, "raise"]], rejoin=False, steps=4)
    assert sorted(report.finals) == ["slot1", "slot2", "slot3"]
    assert report.codes[0] == [1]
    assert diff == 0.0


def test_a_frozen_rank_is_dropped_after_the_heartbeat(tmp_path):
    report, diff = _run(
        tmp_path, faults=[[3, 2, 6, "stop"]], rejoin=False, steps=4, heartbeat_timeout=2.0
    )
    assert sorted(report.finals) == ["slot0", "slot1", "slot2"]
    (heal,) = report.records[0]["heals"]
    assert heal["to"] == [0, 1, 2]
    # Quiet, the frozen rank is named by its stale heartbeat (PeerUnresponsive, ~2 s). With
    # another job loading both cores it was found by the collective's 60 s timeout instead
    # (3 runs in 3, not yet explained; docs/status.md): healed and bitwise either way.
    assert "PeerUnresponsive" in heal["cause"] or "CollectiveTimeout" in heal["cause"], heal
    assert diff == 0.0


def test_a_second_rank_dies_while_the_first_heals(tmp_path):
    report, diff = _run(
        tmp_path, faults=[[1, 3, 2, "kill"], [3, 3, -1, "kill"]], rejoin=False, steps=5
    )
    assert sorted(report.finals) == ["slot0", "slot2"]
    assert [h["to"] for h in report.records[0]["heals"]] == [[0, 2]]
    assert diff == 0.0


def test_a_replacement_that_dies_on_arrival_is_dropped(tmp_path):
    report, diff = _run(
        tmp_path,
        faults=[[2, 3, 5, "kill"]],
        rejoin_faults=[[2, -1, -2, "kill"]],
        rejoin=True,
        rejoin_step=4,
        steps=6,
    )
    assert sorted(report.finals) == ["slot0", "slot1", "slot3"]
    assert report.codes[2] == [-9, -9]
    grow = report.records[0]["heals"][-1]
    assert grow["kind"] == "grow" and grow["to"] == [0, 1, 3]  # it never trained
    assert diff == 0.0


def test_without_reproducible_mode_the_run_is_within_the_tolerance(tmp_path):
    """Not bitwise: each member adds its blocks' gradients in arrival order, then a ring
    all-reduce over the live members. float64, 6 Adam steps: within 1e-12."""
    report, diff = _run(
        tmp_path, faults=[[2, 3, 5, "kill"]], rejoin=False, steps=6, reproducible=False
    )
    assert len(report.finals) == 3
    assert diff < 1e-12
    finals = list(report.finals.values())
    assert all(np.array_equal(f, finals[0]) for f in finals)  # members agree exactly


def test_the_demo_command_heals_bitwise():
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait.cli",
            "demo",
            "-n",
            "4",
            "--reproducible",
            "--check",
            "--kill-rank",
            "2",
            "--kill-step",
            "3",
            "--batch-size",
            "256",
            "--microbatch-size",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "plait demo: healed; 4 ranks finished at size [4]" in proc.stdout
    assert "max diff 0 (bitwise)" in proc.stdout


def test_the_demo_refuses_a_strategy_it_does_not_heal_by_name():
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait.cli",
            "demo",
            "--strategy",
            "ps",
            "--kill-rank",
            "1",
            "--kill-step",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--strategy ps" in proc.stderr and "ps is not healed" in proc.stderr


def test_plait_heal_run_replaces_a_killed_rank(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait.heal.run",
            "-n",
            "4",
            "--replacements",
            "1",
            "examples/heal_train.py",
            "--steps",
            "3000",
            "--kill-rank",
            "2",
            "--kill-step",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 2 exited with -9; the others heal" in proc.stderr
    assert "members [0, 1, 2, 3]" in proc.stdout


@pytest.mark.parametrize(
    "zero,slot,step,index", [(1, 0, 0, 0), (1, 3, 1, 7), (2, 1, 4, 3), (2, 2, 2, 4)]
)
def test_zero_kill_any_rank_at_any_step_then_rejoin_bitwise(tmp_path, zero, slot, step, index):
    """Sharded optimizer state: the dead slot's chunk comes from its mirror, the survivors
    re-shard, the replacement receives its chunks from the holders."""
    report, diff = _run(
        tmp_path,
        faults=[[slot, step, index, "kill"]],
        rejoin=True,
        rejoin_step=step + 1,
        steps=step + 3,
        zero=zero,
    )
    assert len(report.finals) == 4 and f"slot{slot}-join" in report.finals
    assert diff == 0.0


def test_zero_two_non_adjacent_deaths_while_healing_bitwise(tmp_path):
    report, diff = _run(
        tmp_path, faults=[[1, 3, 2, "kill"], [3, 3, -1, "kill"]], rejoin=False, steps=5, zero=2
    )
    assert sorted(report.finals) == ["slot0", "slot2"]
    assert diff == 0.0


def test_zero_two_ring_neighbours_dying_at_once_fail_loudly(tmp_path):
    """Slots 1 and 2 die in the same step: chunk 2's owner and its mirror are both gone,
    so the state is lost and the survivors stop, naming the chunk (no silent wrong run)."""
    c = HealConfig(faults=[[1, 2, 2, "kill"], [2, 2, 4, "kill"]], rejoin=False, steps=4, zero=1)
    report = run(c, str(tmp_path), deadline=90)
    assert not report.finals  # no survivor finished: StateLost, naming chunk 2
    assert report.codes[0] == [1] and report.codes[3] == [1]


def test_the_demo_command_heals_bitwise_under_zero1():
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait.cli",
            "demo",
            "-n",
            "4",
            "--reproducible",
            "--check",
            "--strategy",
            "zero1",
            "--kill-rank",
            "2",
            "--kill-step",
            "3",
            "--batch-size",
            "256",
            "--microbatch-size",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "plait demo: healed; 4 ranks finished at size [4]" in proc.stdout
    assert "max diff 0 (bitwise)" in proc.stdout


def test_plait_run_heal_replaces_a_killed_rank(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait.cli",
            "run",
            "-n",
            "4",
            "--heal",
            "1",
            "examples/heal_train.py",
            "--steps",
            "3000",
            "--kill-rank",
            "2",
            "--kill-step",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 2 exited with -9; the others heal" in proc.stderr
    assert "members [0, 1, 2, 3]" in proc.stdout


@pytest.mark.parametrize("slot", [1, 3])
def test_zero_a_rank_killed_between_stepping_and_gathering_bitwise(tmp_path, slot):
    """Killed after stepping its chunks, before sending them: the survivors that had
    stepped too return to the step before (restore their copy) and redo it."""
    report, diff = _run(
        tmp_path, faults=[[slot, 2, -3, "kill"]], rejoin=True, rejoin_step=3, steps=5, zero=1
    )
    assert len(report.finals) == 4 and f"slot{slot}-join" in report.finals
    assert diff == 0.0


def test_zero_without_reproducible_mode_is_within_the_tolerance(tmp_path):
    report, diff = _run(
        tmp_path,
        faults=[[2, 3, 5, "kill"]],
        rejoin=True,
        rejoin_step=4,
        steps=6,
        reproducible=False,
        zero=2,
    )
    assert len(report.finals) == 4
    assert diff < 1e-12
    finals = list(report.finals.values())
    assert all(np.array_equal(f, finals[0]) for f in finals)  # members agree exactly


def test_plait_run_heal_on_two_machines_replaces_a_killed_rank(tmp_path):
    """Two launchers (``--nnodes 2``, on this host's loopback): node 0 hosts the store and
    waits for node 1 before closing it; a rank of node 1 is killed, node 1's launcher
    starts its replacement, the job ends at full size and both launchers exit 0."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    script = ["examples/heal_train.py", "--steps", "40", "--kill-rank", "3"]
    script += ["--kill-step", "5", "--rejoin-step", "15"]
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "plait.cli", "run", "-n", "2", "--heal", "1", *common]
            + ["--node-rank", str(node), *script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    outs = [p.communicate(timeout=300) for p in launchers]
    text = "\n".join(o + e for o, e in outs)
    assert [p.returncode for p in launchers] == [0, 0], text
    assert "ranks 2..3 of 4 on this machine (node 1 of 2)" in outs[1][1]
    assert "rank 3 exited with -9; the others heal" in outs[1][1]
    assert "starting a replacement for rank 3" in outs[1][1]
    assert "members [0, 1, 2, 3]" in outs[0][0]  # rank 0 prints, on node 0
