"""The command line: plait run, plait bench comm, and spawn from a script's __main__."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.faultlog import record

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import plait
    from plait import comm

    world = plait.init()
    t = torch.full((3,), float(world.rank + 1))
    comm.all_reduce(t, algorithm="ring")
    print(f"rank {world.rank} of {world.size}: {t.tolist()}", flush=True)
    if len(sys.argv) > 1 and world.rank == int(sys.argv[1]):
        sys.exit(3)
    plait.shutdown()
    """
)

MAIN_SPAWN = textwrap.dedent(
    """
    import plait

    def square_rank():
        return plait.world().rank ** 2

    if __name__ == "__main__":
        print("results", plait.spawn(square_rank, world_size=3, timeout=60))
    """
)


def _plait(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "plait.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_plait_run_launches_local_ranks(tmp_path: Path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    done = _plait("run", "-n", "3", str(script))
    assert done.returncode == 0, done.stderr
    for rank in range(3):
        assert f"rank {rank} of 3: [6.0, 6.0, 6.0]" in done.stdout


def test_plait_run_reports_the_failing_rank(tmp_path: Path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    done = _plait("run", "-n", "2", "--timeout", "60", str(script), "1")
    assert done.returncode == 3
    assert re.search(r"rank 1 \(pid \d+\) exited with code 3 \(root cause\)", done.stderr)


def test_plait_run_refuses_a_missing_script(tmp_path: Path):
    done = _plait("run", "-n", "2", str(tmp_path / "nope.py"))
    assert done.returncode == 2 and "no such script" in done.stderr


def test_spawn_from_a_script_main(tmp_path: Path):
    script = tmp_path / "main_spawn.py"
    script.write_text(MAIN_SPAWN)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "results [0, 1, 4]" in done.stdout


def test_bench_comm_prints_rows_writes_json_and_a_table(tmp_path: Path):
    out, table = tmp_path / "rows.json", tmp_path / "tune.json"
    done = _plait(
        "bench",
        "comm",
        "-n",
        "2",
        "--collectives",
        "all_reduce,all_gather",
        "--algorithms",
        "ring,native",
        "--min-size",
        "4K",
        "--max-size",
        "16K",
        "--iters",
        "3",
        "--json",
        str(out),
        "--tune",
        "--tune-file",
        str(table),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "busbw(GB/s)" in done.stdout
    rows = json.loads(out.read_text())
    assert {(r["collective"], r["algorithm"], r["bytes"]) for r in rows} == {
        (c, a, b)
        for c in ("all_reduce", "all_gather")
        for a in ("ring", "native")
        for b in (4096, 16384)
    }
    assert all(r["time_us"] > 0 and r["busbw_gbps"] > 0 for r in rows)
    saved = json.loads(table.read_text())
    assert set(saved["table"]) == {"all_reduce", "all_gather"}
    assert all(rows_[-1][0] >= 1 << 62 for per in saved["table"].values() for rows_ in per.values())


# --- out-of-range options are refused before any work (issue 26 items 8, 12, 16) ---------
def _forbid_work(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace whatever would start work (a local job's launcher, torchrun, any process, the
    layout search, the memory and tensor estimates) with a stub that records its name and
    raises; the names of those called come back in the list."""
    import subprocess

    import plait.launch.job as job
    import plait.plan.cli as plan_cli
    from plait.plan import memory, tensor_costs

    called: list[str] = []

    def stub(name: str) -> object:
        def work(*args: object, **kwargs: object) -> None:
            called.append(name)
            raise AssertionError(f"{name} was called: the options were not refused first")

        return work

    for owner, name in [
        (job, "run_job"),
        (job, "run_torchrun"),
        (subprocess, "Popen"),
        (plan_cli, "search"),  # item 12: the search spun at 100% CPU
        (memory, "compare"),
        (tensor_costs, "compare_modes"),
    ]:
        monkeypatch.setattr(owner, name, stub(f"{owner.__name__}.{name}"))
    return called


def _refused(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[int, str, float, list[str]]:
    """Run ``plait <argv>`` in this process with the work forbidden (``_forbid_work``);
    (exit code, stderr, seconds, the work it started)."""
    from plait.cli import main

    called = _forbid_work(monkeypatch)
    start = time.monotonic()
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err, time.monotonic() - start, called


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        # item 8: printed negative byte counts
        (
            [
                "plan",
                "tensor",
                "-n",
                "4",
                "--tokens",
                "1024",
                "--width",
                "-64",
                "--layers",
                "2",
                "--vocab",
                "100",
            ],
            "argument --width: expected a whole number at least 1, got -64",
        ),
        # item 12: spun at 100% CPU
        (["plan", "layouts", "--params", "1e30", "--batch", "8"], "argument --params: '1e30'"),
        (["plan", "layouts", "--layers", "100000", "--batch", "8"], "100000 layers, more than"),
        (["plan", "memory", "--params", "-5", "-n", "4"], "argument --params: '-5' is outside"),
        # item 12: accepted, then tried to start 100000 processes
        (["run", "-n", "100000", "x.py"], "-n 100000 starts 100000 ranks on this machine"),
        (["run", "-n", "0", "x.py"], "argument -n/--nproc: expected a whole number at least 1"),
        # item 16: killed a healthy job as frozen
        (
            ["run", "-n", "2", "--heartbeat-timeout", "0", "x.py"],
            "--heartbeat-timeout='0': expected a finite number of seconds >= 1",
        ),
        (["run", "-n", "2", "--grace", "-1", "x.py"], "argument --grace"),
    ],
)
@pytest.mark.faults
def test_out_of_range_options_are_refused_at_once(argv, named, capsys, monkeypatch):
    # "at once": refused, naming the option, before any work started (no process, no
    # search, no estimate); the seconds are only recorded
    code, err, took, called = _refused(argv, capsys, monkeypatch)
    assert called == [], called
    assert code == 2, err
    assert named in err, err
    record(
        row=26,
        fault=f"#8/#12/#16 plait {' '.join(argv[:-1] if argv[0] == 'run' else argv)}",
        detected_after_s=round(took, 3),
        named_correctly=True,
        note="exit 2 from argparse, naming the option and its range",
    )


def test_heartbeat_timeout_zero_in_the_environment_is_refused(monkeypatch):
    from plait.launch.attempt import heartbeat_timeout_default

    monkeypatch.setenv("PLAIT_HEARTBEAT_TIMEOUT", "0")
    with pytest.raises(ValueError, match="PLAIT_HEARTBEAT_TIMEOUT='0': expected a finite"):
        heartbeat_timeout_default()
    monkeypatch.setenv("PLAIT_HEARTBEAT_TIMEOUT", "2.5")
    assert heartbeat_timeout_default() == 2.5


def test_the_local_rank_limit_can_be_raised(monkeypatch):
    from plait.launch.job import check_nproc

    monkeypatch.setenv("PLAIT_MAX_NPROC", "3")
    check_nproc(3)
    with pytest.raises(ValueError, match=r"more than 3 \(set by PLAIT_MAX_NPROC\)"):
        check_nproc(4)


def test_version_prints_the_package_version(capsys, monkeypatch):
    """``plait --version`` prints ``plait <version>`` from the installed metadata, and from
    ``plait.__version__`` where plait is not installed (a source tree on PYTHONPATH)."""
    from importlib import metadata

    import plait
    from plait import cli

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"plait {metadata.version('plait')}\n"

    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out == f"plait {plait.__version__}\n"
    pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    declared = re.search(r'^version = "([^"]+)"', pyproject, flags=re.M)
    assert declared and declared.group(1) == plait.__version__, "pyproject and __version__ differ"
