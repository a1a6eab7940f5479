"""Every ``PLAIT_*`` setting is named when its value is wrong (issue 43 item 6).

A bad value (not a number, negative, zero where invalid, a timeout too short to work) is
refused with a ``ValueError`` naming the variable, the value and the valid range: by
``plait.settings.check`` (which ``plait run`` calls before it starts a rank), and by the
reader of each setting (``plait.init``, the rank's rendezvous, the launcher). A timeout
that is valid but runs out names the setting that bounded the wait. Local calls only,
apart from one process that joins a process group alone.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from plait import settings
from plait.launch import rendezvous

ROOT = Path(__file__).resolve().parent.parent

# (variable, bad value, what the message says the valid values are)
BAD = [
    ("PLAIT_TIMEOUT", "abc", "seconds >= 1"),
    ("PLAIT_TIMEOUT", "0.001", "seconds >= 1"),
    ("PLAIT_TIMEOUT", "-5", "seconds >= 1"),
    ("PLAIT_TIMEOUT", "nan", "seconds >= 1"),
    ("PLAIT_HEARTBEAT_TIMEOUT", "0.2", "seconds >= 1"),
    ("PLAIT_HEARTBEAT_TIMEOUT", "5s", "seconds >= 1"),
    ("PLAIT_CONNECT_TIMEOUT", "abc", "seconds >= 1"),
    ("PLAIT_CONNECT_TIMEOUT", "0.001", "seconds >= 1"),  # was a raw c10d socket error
    ("PLAIT_RENDEZVOUS_TIMEOUT", "abc", "seconds >= 1"),  # was "could not convert ... 'abc'"
    ("PLAIT_RENDEZVOUS_TIMEOUT", "0", "seconds >= 1"),
    ("PLAIT_RENDEZVOUS_TIMEOUT", "inf", "seconds >= 1"),
    ("PLAIT_SHM_SPIN_US", "abc", "microseconds from 0 to 1000000"),  # was a float() error
    ("PLAIT_SHM_SPIN_US", "-1", "microseconds from 0 to 1000000"),
    ("PLAIT_SHM_SPIN_US", "1e9", "microseconds from 0 to 1000000"),
    ("PLAIT_SHM_RING_BYTES", "1000", "a multiple of 4096, from 4096 to 1073741824"),
    ("PLAIT_SHM_RING_BYTES", "-4096", "a multiple of 4096, from 4096 to 1073741824"),
    ("PLAIT_SHM_WINDOW_BYTES", "0", "a multiple of 4096, from 4096 to 1073741824"),
    ("PLAIT_SHM_WINDOW_BYTES", "2MiB", "a multiple of 4096, from 4096 to 1073741824"),
    ("PLAIT_SHM_WINDOW_BYTES", str(2 << 30), "a multiple of 4096, from 4096 to 1073741824"),
    ("PLAIT_RECORDER_SIZE", "-1", "collectives from 0 to 1000000"),
    ("PLAIT_RECORDER_SIZE", "1e3", "collectives from 0 to 1000000"),
    ("PLAIT_NODE_SIZE", "-2", "ranks per node >= 1"),
    ("PLAIT_NODE_SIZE", "1.5", "ranks per node >= 1"),
    ("PLAIT_MAX_NPROC", "abc", "ranks >= 1"),  # was ignored in silence
    ("PLAIT_MAX_NPROC", "0", "ranks >= 1"),
    ("PLAIT_CHECK", "maybe", "1 or 0"),
    ("PLAIT_DEBUG", "2", "1 or 0"),
    ("PLAIT_TRANSPORT", "tcp", "one of auto, shm, gloo"),
]


@pytest.mark.parametrize("name,value,valid", BAD)
def test_a_bad_value_is_refused_naming_variable_value_and_range(name, value, valid):
    with pytest.raises(ValueError) as info:
        settings.check({name: value})
    message = str(info.value)
    assert f"{name}={value!r}: expected" in message and valid in message, message


@pytest.mark.parametrize(
    "number",
    [n for n in vars(settings).values() if isinstance(n, settings.Number)],
    ids=lambda n: n.name,
)
def test_each_numeric_reader_refuses_what_check_refuses(number):
    """The readers (plait.init, the rank's rendezvous, the launcher) go through the same
    parser: unset is the default, a bad value raises naming the variable."""
    assert number.read({}) == number.default
    assert number.read({number.name: " "}) == number.default
    with pytest.raises(ValueError, match=f"^{number.name}='abc': expected"):
        number.read({number.name: "abc"})


def test_good_values_pass_and_unset_is_the_default(tmp_path):
    good = {
        "PLAIT_TIMEOUT": "1",
        "PLAIT_HEARTBEAT_TIMEOUT": "2.5",
        "PLAIT_CONNECT_TIMEOUT": "30",
        "PLAIT_RENDEZVOUS_TIMEOUT": "300",
        "PLAIT_SHM_SPIN_US": "0",
        "PLAIT_SHM_RING_BYTES": "4096",
        "PLAIT_SHM_WINDOW_BYTES": str(1 << 30),
        "PLAIT_RECORDER_SIZE": "0",
        "PLAIT_NODE_SIZE": "0",
        "PLAIT_MAX_NPROC": "64",
        "PLAIT_CHECK": "off",
        "PLAIT_DEBUG": "True",
        "PLAIT_TRANSPORT": " GLOO ",
        "PLAIT_SHM_DIR": str(tmp_path),
        "PLAIT_RECORDER_DIR": str(tmp_path / "new" / "dir"),
        "PLAIT_TUNE_FILE": str(tmp_path / "tune.json"),
    }
    assert set(good) == set(settings.SETTINGS), "a setting without a good value here"
    assert settings.check(good) == []
    assert settings.SHM_SPIN_US.read(good) == 0.0
    assert settings.NODE_SIZE.read(good) is None  # 0: by host
    assert settings.RECORDER_SIZE.read(good) == 0 and settings.TIMEOUT.read({}) == 600.0


def test_paths_that_cannot_serve_are_named(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = {
        "PLAIT_SHM_DIR": (str(tmp_path / "nowhere"), "does not exist"),
        "PLAIT_RECORDER_DIR": (str(a_file), "is not a directory"),
        "PLAIT_TUNE_FILE": (str(tmp_path), "is a directory"),
    }
    for name, (value, why) in cases.items():
        with pytest.raises(ValueError, match=re.escape(f"{name}={value!r} {why}")):
            settings.check({name: value})
    with pytest.raises(ValueError, match="cannot be created"):
        settings.check({"PLAIT_RECORDER_DIR": str(a_file / "below")})


def test_every_bad_setting_is_named_at_once():
    with pytest.raises(ValueError) as info:
        settings.check({"PLAIT_TIMEOUT": "x", "PLAIT_SHM_SPIN_US": "y", "PLAIT_CHECK": "z"})
    lines = str(info.value).splitlines()
    assert len(lines) == 3 and all("expected" in line for line in lines), lines


def test_a_misspelt_setting_is_warned_about_once():
    settings._warned.discard("PLAIT_TIMEOUTS")
    env = {"PLAIT_TIMEOUTS": "30", "PLAIT_HEARTBEAT": "9", "PLAIT_MY_OWN_FLAG": "1"}
    settings._warned.discard("PLAIT_HEARTBEAT")
    warned = settings.check(env)
    assert warned == [
        "PLAIT_HEARTBEAT is not a plait setting (did you mean PLAIT_HEARTBEAT_TIMEOUT?)",
        "PLAIT_TIMEOUTS is not a plait setting (did you mean PLAIT_TIMEOUT?)",
    ]
    assert settings.check(env) == []  # once per process
    assert settings.check({"PLAIT_JOB_ID": "abc", "PLAIT_ERROR_FILE": "x"}) == []


def test_every_plait_variable_read_in_plait_is_a_listed_setting():
    """The audit, kept: every ``PLAIT_*`` name in plait/'s code is a setting of the table
    (parsed and checked) or one that plait run sets for its ranks."""
    known = set(settings.SETTINGS) | set(settings.LAUNCHER_VARIABLES)
    found: dict[str, str] = {}
    for path in (ROOT / "plait").rglob("*.py"):
        for name in re.findall(r"\bPLAIT_[A-Z][A-Z_]*[A-Z]\b", path.read_text()):
            found.setdefault(name, str(path.relative_to(ROOT)))
    unknown = {n: p for n, p in found.items() if n not in known}
    assert not unknown, f"PLAIT_* names read but not in plait.settings: {unknown}"
    assert set(settings.SETTINGS) <= set(found), "a listed setting nobody reads"


def test_plait_run_refuses_a_bad_setting_before_starting_a_rank(monkeypatch, capsys, tmp_path):
    from plait import cli

    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('a rank started')\n")
    monkeypatch.setenv("PLAIT_RENDEZVOUS_TIMEOUT", "abc")
    monkeypatch.setenv("PLAIT_SHM_SPIN_US", "-3")
    start = time.monotonic()
    assert cli.main(["run", "-n", "2", str(script)]) == 2
    err = capsys.readouterr().err
    assert "plait run: PLAIT_RENDEZVOUS_TIMEOUT='abc': expected a finite number of seconds" in err
    assert "plait run: PLAIT_SHM_SPIN_US='-3': expected" in err, err
    assert "a rank started" not in err and time.monotonic() - start < 5


def test_a_short_connect_timeout_that_runs_out_names_the_setting():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]  # nothing listens there once closed
    with pytest.raises(rendezvous.RendezvousError) as info:
        rendezvous.connect("127.0.0.1", free, timeout=1, rank=1, setting="PLAIT_CONNECT_TIMEOUT")
    message = str(info.value)
    assert f"rank 1: no rendezvous store answered at 127.0.0.1:{free} within " in message
    assert "PLAIT_CONNECT_TIMEOUT=1 s" in message and "Traceback" not in message, message


def test_a_rendezvous_timeout_that_runs_out_names_the_setting():
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
    )
    with pytest.raises(rendezvous.RendezvousError) as info:
        rendezvous.preflight(
            store,
            addr="127.0.0.1",
            port=store.port,
            rank=0,
            world_size=2,
            job_id=None,
            timeout=1,
            setting="PLAIT_RENDEZVOUS_TIMEOUT",
        )
    message = str(info.value)
    assert "ranks [1] of WORLD_SIZE=2 never joined" in message, message
    assert "within PLAIT_RENDEZVOUS_TIMEOUT=1 s" in message, message


JOIN_ALONE = """
import plait
try:
    plait.init()
except RuntimeError as exc:
    print("ERROR", exc)
"""


def test_a_collective_timeout_that_runs_out_in_init_names_the_setting(tmp_path):
    """Rank 0 of 2 joins alone with PLAIT_TIMEOUT=1: its wait for rank 1 runs out inside
    torch's rendezvous, and the error names the store and PLAIT_TIMEOUT (it was c10d's
    'wait timeout after 1ms, keys: /default_pg/0//cpu//0/0')."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        RANK="0",
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PLAIT_TIMEOUT="1",
    )
    done = subprocess.run(
        [sys.executable, "-c", JOIN_ALONE],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    out = done.stdout + done.stderr
    assert "ERROR plait.init: rank 0 of 2: joining the process group through the store at " in out
    assert f"127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT) did not complete within " in out, out
    assert "PLAIT_TIMEOUT=1 s" in out and "raise PLAIT_TIMEOUT" in out, out


def test_a_named_tuning_table_that_is_missing_broken_or_a_folder_is_said(
    monkeypatch, tmp_path, caplog
):
    from plait.comm import tuner

    for name in ("_table", "_loaded_from", "_transport"):  # restored after the test
        monkeypatch.setattr(tuner, name, getattr(tuner, name))
    missing = tmp_path / "missing.json"
    monkeypatch.setenv("PLAIT_TUNE_FILE", str(missing))
    with caplog.at_level("WARNING", logger="plait"):
        tuner.load()
    assert f"{missing} (PLAIT_TUNE_FILE) does not exist" in caplog.text, caplog.text
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    monkeypatch.setenv("PLAIT_TUNE_FILE", str(broken))
    with pytest.raises(ValueError, match=re.escape(f"{broken} (PLAIT_TUNE_FILE) is not a tuning")):
        tuner.load()
    monkeypatch.setenv("PLAIT_TUNE_FILE", str(tmp_path))
    with pytest.raises(ValueError, match="PLAIT_TUNE_FILE=.* is a directory"):
        tuner.load()


def test_plait_init_refuses_a_recorder_dir_it_could_not_write(monkeypatch, tmp_path):
    import plait
    from plait import runtime

    a_file = tmp_path / "file"
    a_file.write_text("x")
    monkeypatch.setenv("PLAIT_RECORDER_DIR", str(a_file))
    with pytest.raises(ValueError, match=re.escape(f"PLAIT_RECORDER_DIR={str(a_file)!r} is not a")):
        plait.init()
    assert not runtime.is_initialized()
