"""A finished job exits 0 whatever the script calls at the end (issue: about 1 in 9 runs
ending with torch.distributed.destroy_process_group() aborted with "terminate called
without an active exception"). ``python -m tests.test_exit 30`` runs 30 jobs per ending."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENDINGS = ("destroy", "shutdown", "both", "neither")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(ending: str) -> list[subprocess.Popen[bytes]]:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=str(ROOT),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.exit_script", ending],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    return procs


def run_jobs(endings: list[str], timeout: float = 240) -> list[tuple[str, int, str]]:
    """Start one 2-rank job per entry of ``endings``, all at once; (ending, exit code,
    output tail) of every rank."""
    started = [(ending, p) for ending in endings for p in _start(ending)]
    results = []
    try:
        for ending, p in started:
            out, _ = p.communicate(timeout=timeout)
            results.append((ending, p.returncode, out.decode(errors="replace")[-800:]))
    finally:
        for _, p in started:  # no orphans, whatever happened
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def test_finished_jobs_exit_zero_however_they_end():
    endings = ["destroy", "destroy", *ENDINGS[1:]]
    results = run_jobs(endings)
    assert len(results) == 2 * len(endings)
    for ending, code, output in results:
        assert code == 0, (ending, output)
        assert "done: " in output, (ending, output)


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    for ending in ENDINGS:
        results = run_jobs([ending] * count, timeout=900)
        bad = [(c, o) for _, c, o in results if c != 0]
        print(f"{ending}: {len(results) - len(bad)}/{len(results)} ranks exited 0")
        for code, output in bad[:3]:
            print(f"  exit {code}: {output[-300:]!r}")
