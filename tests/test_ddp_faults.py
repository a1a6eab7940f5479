"""DDP and naive DP never train past a failed peer (fault matrix rows 1 and 20, issue 16.1).

A peer that raises before its all-reduce, stops early (uneven data) or is killed must make
the surviving rank's ``backward()`` raise a :class:`plait.comm.CollectiveError` naming that
peer and the collective, long before the group timeout (120 s here), on every path: the
backend's all-reduce, a plait algorithm, each built-in communication hook, a user hook, a
user hook that ignores its future's error (on plait's communication thread, where DDP still
finds it) and NaiveDataParallel. Real processes (``tests/ddp_fault_fns.py``), no pool: the
faulty ranks really die. The suite runs a reduced matrix (every fault, every path but
bf16_hook, which shares fp16_hook's code); ``PLAIT_FULL_FAULTS=1`` runs every pair.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from tests import faultlog
from tests.ddp_fault_fns import TIMEOUT_S

ROOT = Path(__file__).resolve().parents[1]
PATHS = [
    "ddp-native",
    "ddp-ring",
    "ddp-allreduce_hook",
    "ddp-fp16_hook",
    "ddp-bf16_hook",
    "ddp-user_hook",
    "ddp-swallowing_hook",
    "naive",
]
FAULTS = ["raise", "exit", "kill"]
REDUCED = [
    ("ddp-native", "kill"),
    ("ddp-native", "raise"),
    ("ddp-native", "exit"),
    ("ddp-ring", "raise"),
    ("ddp-allreduce_hook", "exit"),
    ("ddp-fp16_hook", "kill"),
    ("ddp-user_hook", "kill"),
    ("ddp-swallowing_hook", "exit"),
    ("naive", "exit"),
]
MATRIX = list(itertools.product(PATHS, FAULTS)) if os.environ.get("PLAIT_FULL_FAULTS") else REDUCED
ROW = {"kill": 1, "raise": 20, "exit": 20}


def run_scenarios(scenarios: list[tuple[str, str]]) -> list[dict]:
    """One survivor (rank 0) and one faulty peer per scenario; the survivor's reports."""
    world = len(scenarios) + 1
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        None,
        True,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
        wait_for_workers=False,
    )
    arg = ",".join(f"{p}:{f}" for p, f in scenarios)
    procs = []
    try:
        for rank in range(world):
            env = dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(store.port),
                OMP_NUM_THREADS="1",
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tests.ddp_fault_fns", arg],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                    stderr=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                    text=True,
                )
            )
        out, err = procs[0].communicate(timeout=4 * TIMEOUT_S)  # generous: 2 shared cores
        assert procs[0].returncode == 0, err[-3000:]
        for p in procs[1:]:
            p.wait(timeout=30)  # every peer is dead or finished by now
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.faults
@pytest.mark.timeout(600)
def test_survivor_backward_names_the_failed_peer():
    reports = run_scenarios(MATRIX)
    assert len(reports) == len(MATRIX)
    problems = []
    for report in reports:
        j, path, fault = report["scenario"], report["path"], report["fault"]
        named = report["error"] is not None and f"Rank {j} had not reached" in report["message"]
        faultlog.record(
            row=ROW[fault],
            fault=f"peer {fault}s before its all-reduce ({path})",
            detected_after_s=report.get("detected_after_s"),
            named_correctly=named,
        )
        if report["error"] is None:
            problems.append(f"{path}/{fault}: the survivor trained on")
            continue
        if not report["collective_error"] or not named or "all_reduce #" not in report["message"]:
            problems.append(f"{path}/{fault}: {report['error']}: {report['message']}")
        elif "Cause: CollectiveTimeout" in report["message"]:  # what the old behaviour gave
            problems.append(f"{path}/{fault}: named by the timeout: {report['message']}")
        elif report["step"] != 2 or report["detected_after_s"] >= TIMEOUT_S:
            # before the pair group's timeout would have fired (0.05-5 s here)
            problems.append(f"{path}/{fault}: step {report['step']}, {report['detected_after_s']}s")
    assert not problems, "\n".join(problems)
