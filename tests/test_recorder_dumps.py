"""``plait run`` names the flight-recorder dumps of a failed attempt, where ``plait doctor``
reads them, and leaves no dump folder nobody will read (issue 43 item 6: a failed job left
``plait-recorder-<port>`` folders in TMPDIR, one per attempt, that no report named)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from plait import RankError, RankPool, cli
from tests import groups_fns

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).parent / "scripts"


def test_a_failed_attempts_dumps_are_named_kept_and_read_by_doctor(tmp_path, capsys):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PLAIT_RECORDER_DIR"}
    env.update(TMPDIR=str(tmp), PYTHONPATH=str(ROOT), PLAIT_TIMEOUT="60")
    done = subprocess.run(
        [sys.executable, "-m", "plait.cli", "run", "-n", "2", "--max-restarts", "1"]
        + [str(SCRIPTS / "mismatch_once.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out  # the restarted attempt agreed
    assert "rank 0: attempt 1 done" in out and "rank 1: attempt 1 done" in out, out
    named = re.search(
        r"flight recorder: ranks \[0, 1\] wrote their last collectives into (\S+);", out
    )
    assert named, out
    attempt0 = Path(named.group(1))
    job = attempt0.parent
    assert attempt0.name == "attempt-0" and job.parent == tmp, out
    assert re.fullmatch(r"plait-recorder-[0-9a-f]+", job.name), job
    assert f"`plait doctor {attempt0}`" in out, out
    # the failed attempt's dumps are kept (the report named them), the successful one's
    # folder is gone, and the job's last line says where the kept ones are
    assert sorted(p.name for p in attempt0.iterdir()) == ["rank0.json", "rank1.json"]
    assert [p.name for p in job.iterdir()] == ["attempt-0"]
    assert f"dumps of the failed attempts stay in {job}" in out, out
    assert [p.name for p in tmp.iterdir()] == [job.name], "another folder left in TMPDIR"
    # plait doctor reads the attempt's folder or the job's
    for where in (attempt0, job):
        assert cli.main(["doctor", str(where)]) == 0
        report = capsys.readouterr().out
        assert f"flight recorder {attempt0}: ranks [0, 1]" in report, report
        assert "the ranks disagree" in report and "broadcast" in report, report


def test_a_pool_names_its_dumps_on_failure_and_removes_an_unread_folder(monkeypatch, tmp_path):
    """A RankPool's ranks dump into a folder of the pool's own: a failed run names it in its
    RankError (kept for ``plait doctor``); a pool closed without naming it removes it."""
    monkeypatch.delenv("PLAIT_RECORDER_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    with RankPool(2, timeout=60) as quiet:
        assert quiet.run(groups_fns.nothing) == [0, 1]
        assert quiet.recorder_dir.parent == tmp_path
    assert not quiet.recorder_dir.exists()
    failing = RankPool(2, timeout=60)
    with pytest.raises(RankError) as caught:
        failing.run(groups_fns.mismatched_all_reduce)
    folder = failing.recorder_dir
    assert f"`plait doctor {folder}`" in str(caught.value), caught.value
    assert folder.is_dir() and list(folder.glob("rank*.json")), folder
    assert cli.main(["doctor", str(folder)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]
