"""plait run --max-restarts: a rank SIGKILLed mid-training, the job restarts every rank
from the last checkpoint, and ends bitwise where an uninterrupted run and a run restarted
by hand from the same checkpoint end, and not where a cold start ends (tinker #127's 3-way
method). Also: the restart budget is enforced."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.faultlog import record

SCRIPT = Path(__file__).parent / "scripts" / "elastic_train.py"
ROOT = Path(__file__).parent.parent


full_matrix = pytest.mark.skipif(
    not os.environ.get("PLAIT_FULL_FAULTS"),
    reason="full fault matrix only: benchmarks/faults.py (or PLAIT_FULL_FAULTS=1)",
)


def train(
    tmp: Path, name: str, *extra: str, restarts: int = 0, launcher: tuple[str, ...] = ()
) -> tuple[dict, str, float]:
    """Run the training script under plait run; its final parameters, stderr, seconds."""
    ckpt = tmp / name
    ckpt.mkdir(exist_ok=True)
    out = tmp / f"{name}.pt"
    start = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait.cli",
            "run",
            "-n",
            "2",
            "--max-restarts",
            str(restarts),
            "--grace",
            "2",
            *launcher,
            str(SCRIPT),
            "--ckpt-dir",
            str(ckpt),
            "--out",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
    )
    took = time.monotonic() - start
    assert done.returncode == 0, done.stderr
    return torch.load(out, weights_only=True), done.stderr + done.stdout, took


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.faults
def test_restarted_job_equals_uninterrupted_and_by_hand_not_cold(tmp_path: Path) -> None:
    # rank 1 is SIGKILLed at step 6 (attempt 0) and step 9 (attempt 1): two restarts
    restarted, log, took = train(tmp_path, "elastic", "--kill", "1:6,9", restarts=2)
    assert "restart 1 of 2" in log and "restart 2 of 2" in log, log
    assert "rank 1 (pid" in log and "was killed by SIGKILL (root cause)" in log, log
    assert "attempt 1: starting at step 4" in log and "attempt 2: starting at step 8" in log
    uninterrupted, _, plain = train(tmp_path, "plain")
    hand = tmp_path / "hand"
    hand.mkdir()
    shutil.copy(tmp_path / "elastic" / "step-0008.pt", hand / "step-0008.pt")
    by_hand, log_hand, _ = train(tmp_path, "hand")
    assert "attempt 0: starting at step 8" in log_hand
    cold, _, _ = train(tmp_path, "cold", "--cold-from", "8")
    assert equal(restarted, uninterrupted)
    assert equal(restarted, by_hand)
    assert not equal(restarted, cold)
    for row, fault in (
        (1, "kill -9 of rank 1 at step 6, --max-restarts 2"),
        (13, "elastic restart: params+momentum vs uninterrupted/by hand/cold"),
        (22, "repeated kills (2) within the restart budget"),
    ):
        record(
            row=row,
            fault=fault,
            detected_after_s=None,
            named_correctly=True,
            recovered_after_s=round(took - plain, 2),
            state_equal=True,
            note="recovered_after_s: extra wall time of the restarted job over the "
            "uninterrupted one (2 restarts)",
        )


@full_matrix
@pytest.mark.faults
def test_restart_budget_is_enforced(tmp_path: Path) -> None:
    script = tmp_path / "always_fails.py"
    script.write_text(
        "import os, sys\n"
        "print('attempt', os.environ['PLAIT_RESTART_COUNT'], os.environ["
        "'TORCHELASTIC_RESTART_COUNT'], flush=True)\n"
        "sys.exit(3 if os.environ['RANK'] == '1' else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "plait.cli", "run", "-n", "2", "--max-restarts", "1", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout.count("attempt 0 0") == 2 and done.stdout.count("attempt 1 1") == 2
    assert "attempt 2" not in done.stdout
    assert "restart 1 of 1" in done.stderr and "no restarts left (1 used)" in done.stderr
    record(
        row=22,
        fault="failure on every attempt, --max-restarts 1",
        detected_after_s=None,
        named_correctly=True,
        recovered_after_s=None,
        state_equal=None,
        note="budget enforced: 2 attempts, then exit code 3",
    )


@full_matrix
@pytest.mark.faults
def test_restart_through_torchrun_equals_uninterrupted(tmp_path: Path) -> None:
    """plait run --master-addr hands over to torchrun with --max-restarts; the restarted
    run ends where the uninterrupted one does. torchrun's static rendezvous keeps one store
    for every attempt (TORCH_DISABLE_SHARE_RDZV_TCP_STORE does not change that): rank 0
    rendezvousing late on the restart (as on a loaded machine) made rank 1 read the failed
    attempt's gloo address ("connectFullMesh ... Connection refused"). plait.init now
    rendezvouses each attempt under its own prefix (plait/attempt-<n>)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    via = ("--master-addr", "127.0.0.1", "--master-port", str(port))
    restarted, log, took = train(
        tmp_path, "tr", "--kill", "1:6", "--late-rank0", "2", restarts=1, launcher=via
    )
    assert "attempt 1: starting at step 4" in log, log
    uninterrupted, _, plain = train(tmp_path, "plain")
    assert equal(restarted, uninterrupted)
    record(
        row=1,
        fault="kill -9 of rank 1 at step 6 under torchrun --max-restarts 1",
        detected_after_s=None,
        named_correctly=None,
        recovered_after_s=round(took - plain, 2),
        state_equal=True,
        note="plait run hands over to torchrun (static rendezvous, one store for every "
        "attempt); rank 0 rendezvouses 2 s late on the restart; per-attempt key prefix",
    )


SHRINK = Path(__file__).parent / "scripts" / "elastic_shrink.py"


def shrink_train(
    tmp: Path, name: str, nproc: int, *extra: str, elastic: tuple[str, ...] = ()
) -> tuple[dict, str, float]:
    """elastic_shrink.py under plait run -n ``nproc`` (ZeRO-1, plait.checkpoint)."""
    out = tmp / f"{name}.pt"
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "plait.cli", "run", "-n", str(nproc), "--grace", "2", *elastic]
        + [str(SHRINK), "--ckpt-dir", str(tmp / name), "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
    )
    took = time.monotonic() - start
    assert done.returncode == 0, done.stderr
    return torch.load(out, weights_only=True), done.stderr + done.stdout, took


@full_matrix
@pytest.mark.faults
def test_elastic_shrink_equals_a_restart_by_hand_at_the_smaller_size(tmp_path: Path) -> None:
    """plait run -n 3 --min-nproc 2 --max-restarts 1: rank 1 SIGKILLed at step 6, the job
    restarts with 2 ranks from the step-4 checkpoint (ZeRO-1: Adam's moments resharded from
    3 to 2 ranks; the sampler continues the global position). Its final parameters equal
    those of a 2-rank run started by hand from the same checkpoint, and differ from a cold
    start at step 4 at 2 ranks."""
    elastic = ("--min-nproc", "2", "--max-restarts", "1")
    shrunk, log, took = shrink_train(tmp_path, "elastic", 3, "--kill", "1:6", elastic=elastic)
    assert "rank 1 (pid" in log and "was killed by SIGKILL (root cause)" in log, log
    assert "restarting with 2 ranks, one fewer (restart 1 of 1, WORLD_SIZE=2" in log, log
    assert "attempt 0: world size 3, starting at step 0" in log, log
    assert "attempt 1: world size 2, starting at step 4" in log, log
    hand = tmp_path / "hand"
    shutil.copytree(tmp_path / "elastic" / "step-4", hand / "step-4")
    by_hand, log_hand, _ = shrink_train(tmp_path, "hand", 2, "--resume-step", "4")
    assert "attempt 0: world size 2, starting at step 4" in log_hand, log_hand
    cold, _, _ = shrink_train(tmp_path, "cold", 2, "--cold-from", "4")
    assert equal(shrunk, by_hand)
    assert not equal(shrunk, cold)
    record(
        row=11,
        fault="kill -9 of rank 1 of 3 at step 6, --min-nproc 2: restart at 2 ranks (ZeRO-1)",
        detected_after_s=None,
        named_correctly=True,
        recovered_after_s=None,
        state_equal=True,
        note=f"shrunk job == restarted by hand at 2 ranks != cold start; whole job {took:.0f}s",
    )


@full_matrix
@pytest.mark.faults
def test_elastic_never_goes_below_min_nproc(tmp_path: Path) -> None:
    script = tmp_path / "rank1_fails.py"
    script.write_text(
        "import os, sys\n"
        "print('attempt', os.environ['PLAIT_RESTART_COUNT'], 'world', "
        "os.environ['WORLD_SIZE'], flush=True)\n"
        "sys.exit(3 if os.environ['RANK'] == '1' else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "plait.cli", "run", "-n", "3", "--min-nproc", "2"]
        + ["--max-restarts", "5", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout.count("attempt 0 world 3") == 3, done.stdout
    assert done.stdout.count("attempt 1 world 2") == 2, done.stdout
    assert "attempt 2" not in done.stdout, done.stdout
    assert "1 rank(s) would be left, fewer than --min-nproc 2; not restarting" in done.stderr


def test_elastic_configuration_is_refused_up_front() -> None:
    from plait.cli import main
    from plait.launch.job import check_elastic

    check_elastic(nproc=4, min_nproc=2, max_restarts=1)
    check_elastic(nproc=4, min_nproc=None, max_restarts=0)
    check_elastic(nproc=4, min_nproc=4, max_restarts=0)  # fixed size: no restarts needed
    with pytest.raises(ValueError, match=r"--min-nproc\) must be between 1 and nproc \(-n 4\)"):
        check_elastic(nproc=4, min_nproc=5, max_restarts=1)
    with pytest.raises(ValueError, match=r"must be between 1"):
        check_elastic(nproc=4, min_nproc=0, max_restarts=1)
    with pytest.raises(ValueError, match=r"add --max-restarts k"):
        check_elastic(nproc=4, min_nproc=2, max_restarts=0)
    script = str(SHRINK)
    assert main(["run", "-n", "2", "--min-nproc", "3", "--max-restarts", "1", script]) == 2
    assert main(["run", "-n", "2", "--min-nproc", "1", script]) == 2
    multinode = ["run", "-n", "2", "--nnodes", "2", "--min-nproc", "1", "--max-restarts", "1"]
    assert main([*multinode, script]) == 2


def test_keys_of_a_torchrun_attempt_have_their_own_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's agent store outlives an attempt: plait's keys and the default group's
    rendezvous go under plait/attempt-<n>; plait run's fresh store per attempt: plain."""
    from plait.comm.progress import attempt_namespace

    monkeypatch.delenv("PLAIT_FRESH_STORE", raising=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert attempt_namespace() == "plait/attempt-2"
    monkeypatch.setenv("PLAIT_FRESH_STORE", "1")
    assert attempt_namespace() == ""
    monkeypatch.delenv("PLAIT_FRESH_STORE")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert attempt_namespace() == ""
