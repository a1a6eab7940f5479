"""The main job, shortened: trains, reports, traces, plots, and matches the oracle."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from plait.demo.digits import (
    FLOAT64_BOUND,
    NOISE_FACTOR,
    STRATEGIES,
    TRAIN_SAMPLES,
    DemoConfig,
    DemoOptionError,
    DemoReport,
    check_passed,
    comm_traced,
    float32_noise,
    global_batches,
    load_digits,
    oracle,
    push_lr,
    run,
    summarize,
    train_rank,
    validate,
)


def test_demo_trains_reports_and_matches_one_process_bitwise(tmp_path: Path):
    # --reproducible: float32, and no tolerance: epochs of SGD with momentum amplify any
    # rounding difference (to 9e-2 after 3 for one process summed in another order), so
    # only the fixed summation tree makes the run equal one process
    config = DemoConfig(world_size=2, epochs=2, name="t", reproducible=True)
    report = run(config, check=True, out_dir=tmp_path)
    folder = tmp_path / "t"
    saved = json.loads((folder / "report.json").read_text())
    assert saved["config"]["world_size"] == 2 and len(saved["history"]) == 2
    assert saved["history"][-1]["loss"] < saved["history"][0]["loss"]
    assert report.test_accuracy > 0.5
    assert report.max_param_diff == 0.0 and report.check_bound == 0.0 and check_passed(report)
    assert 0.0 <= report.hidden_fraction <= 1.0 and 0.0 <= report.comm_share <= 1.0
    trace = json.loads((folder / "trace.json").read_text())["traceEvents"]
    names = {e["name"] for e in trace if e["ph"] == "X"}
    assert {"forward", "backward", "optimizer", "all_reduce bucket 0"} <= names
    assert {e["pid"] for e in trace if e["ph"] == "X"} == {0, 1}
    assert (folder / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reproducible_refuses_layouts_and_strategies_by_option():
    with pytest.raises(DemoOptionError, match="--reproducible supports .* got 'ps'"):
        validate(DemoConfig(world_size=3, strategy="ps", reproducible=True))
    with pytest.raises(DemoOptionError, match="--reproducible: .*W=3.*set --batch-size"):
        validate(DemoConfig(world_size=3, reproducible=True))
    with pytest.raises(DemoOptionError, match="M=B/m=6"):
        validate(DemoConfig(world_size=2, batch_size=48, reproducible=True))
    validate(DemoConfig(world_size=8, reproducible=True))  # 64 / 8 = 8 micro-batches


def test_a_float32_check_is_judged_against_float64_in_one_process():
    """In float32 --check accepts NOISE_FACTOR times how far float32 in one process lands
    from float64 (summed in the ranks' pieces and whole); 3 steps are too few for rounding
    to grow."""
    config = DemoConfig(world_size=2, epochs=1, batch_size=479)
    noise = float32_noise(config, oracle(replace(config, dtype="float64")))
    assert 0 < noise < 1e-5

    def report(distance: float) -> DemoReport:
        return DemoReport(
            config=config, test_accuracy=1.0, samples_per_s=1.0, train_seconds=1.0,
            comm_share=None, hidden_fraction=None, comm_seconds_per_rank=None,
            param_distance=distance, check_bound=NOISE_FACTOR * noise,
        )  # fmt: skip

    assert check_passed(report(NOISE_FACTOR * noise)) and not check_passed(report(11 * noise))


def test_demo_under_fsdp_traces_gathers_and_reductions(tmp_path: Path):
    config = DemoConfig(world_size=2, epochs=1, name="f", strategy="fsdp", reproducible=True)
    report = run(config, check=True, out_dir=tmp_path)
    assert report.max_param_diff == 0.0  # bitwise: the tree continues on the shards
    trace = json.loads((tmp_path / "f" / "trace.json").read_text())["traceEvents"]
    names = {e["name"] for e in trace if e["ph"] == "X"}
    assert {"forward", "backward", "all_gather DigitsCNN", "reduce_scatter DigitsCNN"} <= names
    assert report.comm_seconds_per_rank > 0


def test_demo_under_a_parameter_server_reports_servers_and_workers(tmp_path: Path):
    config = DemoConfig(
        world_size=3, epochs=1, name="p", strategy="ps", evals_per_epoch=2, dtype="float64"
    )
    report = run(config, check=True, out_dir=tmp_path)
    assert report.max_param_diff is not None and report.max_param_diff < FLOAT64_BOUND
    (server,) = report.ps["servers"]
    assert server["updates"] == report.history[-1]["updates"] > 0
    assert server["staleness"] == {0: 2 * server["updates"]}
    assert [w["rank"] for w in report.ps["workers"]] == [1, 2]
    assert len(report.history) == 2  # a mid-epoch point and the epoch's end
    trace = json.loads((tmp_path / "p" / "trace.json").read_text())["traceEvents"]
    names = {e["name"] for e in trace if e["ph"] == "X"}
    assert {"push + pull", "apply update"} <= names


def test_demo_ps_with_a_straggler_in_ssp_mode_waits_within_the_bound(tmp_path: Path):
    config = DemoConfig(
        world_size=3,
        epochs=1,
        name="s",
        strategy="ps",
        ps_mode="ssp",
        staleness=1,
        slow_worker=(2, 3.0),
    )
    report = run(config, out_dir=tmp_path)
    (server,) = report.ps["servers"]
    assert server["max_clock_gap"] <= 1 and server["ssp_waits"] > 0
    slow = report.ps["workers"][1]
    assert slow["rank"] == 2 and slow["injected_s"] > 0


# --- options, uneven batches, progress output, the communication line ----------------------
# (helpers: plait.demo.digits.validate runs before any rank starts; train_rank runs on kept pools)

BAD_OPTIONS = [
    (["--epochs", "0"], "--epochs must be at least 1"),
    (["--epochs", "-1"], "--epochs must be at least 1"),
    (["--batch-size", "0"], "--batch-size (the global batch) must be in 4..1437"),
    (["--batch-size", "1438"], "--batch-size (the global batch) must be in 4..1437"),
    (["--strategy", "ps", "--servers", "4", "-n", "4"], "--servers must be in 1..3"),
    (["--strategy", "ps", "--servers", "0"], "--servers must be in 1..3"),
    (["--strategy", "ps", "-n", "1"], "--strategy ps needs -n of at least 2"),
    (["-n", "0"], "-n/--nproc must be at least 1"),
    (["-n", "-3"], "-n/--nproc must be at least 1"),
    (["--strategy", "none", "-n", "2"], "--strategy none trains in one process"),
    (["--lr", "-0.1"], "--lr must be a finite number > 0"),
    (["--lr", "0"], "--lr must be a finite number > 0"),
    (["--lr", "inf"], "--lr must be a finite number > 0"),
    (["--evals-per-epoch", "0"], "--evals-per-epoch must be in 1..22"),
    (["--evals-per-epoch", "23"], "--evals-per-epoch must be in 1..22"),
    (["--bucket-mb", "0"], "--bucket-mb must be a finite number > 0"),
    (["--algorithm", "fastest"], "--algorithm must be one of auto, ring"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--name", "../elsewhere"], "--name must be a plain folder name"),
    (["--strategy", "ps", "--slow-worker", "3"], "--slow-worker must be RANK:FACTOR"),
    (["--strategy", "ps", "--slow-worker", "a:b"], "--slow-worker must be RANK:FACTOR"),
    (["--strategy", "ps", "--slow-worker", "0:3"], "RANK must be a worker rank, 1..3"),
    (["--strategy", "ps", "--slow-worker", "2:0.5"], "FACTOR must be a finite number >= 1"),
    (["--strategy", "ps", "--ps-mode", "ssp", "--staleness", "-1"], "needs --staleness S"),
    (["--strategy", "ps", "--staleness", "2"], "--staleness applies to --ps-mode ssp only"),
    (["--strategy", "ps", "--backup-workers", "3"], "--backup-workers must be in 0..2"),
    (
        ["--strategy", "ps", "--ps-mode", "async", "--backup-workers", "1"],
        "--backup-workers applies to --ps-mode sync only",
    ),
    (["--servers", "2"], "--servers applies to --strategy ps only, not ddp"),
    (["--strategy", "ps", "--max-staleness", "3"], "--max-staleness applies to --ps-mode async"),
    (
        ["--strategy", "ps", "--ps-mode", "async", "--max-staleness", "-1"],
        "--max-staleness must be an integer >= 0",
    ),
    (["--max-staleness", "3"], "--max-staleness applies to --strategy ps only"),
    (["--ps-mode", "async", "--strategy", "zero1"], "--ps-mode applies to --strategy ps only"),
]


@pytest.mark.parametrize("args,needle", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_a_bad_option_prints_one_line_naming_it_and_exits_2(capsys, args, needle):
    from plait import cli

    assert cli.main(["demo", *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing started: no banner, no rank output
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("plait demo: "), err
    assert needle in lines[0]


def test_validation_raises_the_same_error_for_library_users(tmp_path: Path):
    with pytest.raises(DemoOptionError, match="--epochs must be at least 1, got 0"):
        run(DemoConfig(epochs=0), out_dir=tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_is_valid_with_default_options(strategy):
    from plait import cli

    parser_args = cli.argparse.Namespace(
        nproc=None, strategy=strategy, epochs=10, batch_size=64, lr=0.05, algorithm="auto",
        bucket_mb=25.0, seed=0, name=None, ps_mode="sync", servers=1, staleness=None,
        backup_workers=0, slow_worker=None, evals_per_epoch=1, dtype="float32",
        max_staleness=None, reproducible=False, microbatch_size=None,
    )  # fmt: skip
    validate(cli._demo_config(parser_args, None))
    if strategy == "ps":  # the README's ps invocations, with their defaults
        for mode in ("sync", "async", "ssp"):
            parser_args.ps_mode = mode
            validate(cli._demo_config(parser_args, 2 if mode == "ssp" else None))


def test_an_asynchronous_push_steps_with_its_share_of_the_learning_rate():
    """Issue 26.18: --lr is per global batch; async/ssp apply each worker's push (a 1/W
    share of it) as an update of its own, so a push steps with lr / W (the server divides a
    stale one further by its staleness, tests/test_ps.py)."""
    assert push_lr(DemoConfig(strategy="ps", ps_mode="sync")) == 0.05
    assert push_lr(DemoConfig(strategy="ps", ps_mode="async")) == pytest.approx(0.05 / 3)
    assert push_lr(DemoConfig(strategy="ps", ps_mode="ssp", staleness=2, servers=2)) == 0.025
    assert push_lr(DemoConfig(strategy="ddp")) == 0.05


def test_the_training_set_size_used_for_validation_is_the_real_one():
    x, _, _, _ = load_digits(0)
    assert len(x) == TRAIN_SAMPLES


def test_global_batches_cover_the_epoch_once_and_drop_only_the_remainder():
    config = DemoConfig(batch_size=100)
    batches = global_batches(config, 3)
    assert [len(b) for b in batches] == [100] * 14
    seen = [i for b in batches for i in b]
    assert len(set(seen)) == 1400 and set(seen) <= set(range(TRAIN_SAMPLES))
    assert global_batches(config, 3) == batches != global_batches(config, 4)


# Uneven global batches (479 over 2 or 3 trainers), one epoch of 3 steps; every strategy
# against the one-process oracle, and its communication either traced or said not to be.
UNEVEN = [
    ("ddp", 2, {}),
    ("naive", 2, {}),
    ("zero1", 2, {}),
    ("zero2", 2, {}),
    ("zero3", 2, {}),
    ("fsdp", 2, {}),
    ("ps", 3, {}),
    ("ps", 3, {"ps_mode": "async"}),
]


@pytest.mark.parametrize("strategy,world,extra", UNEVEN, ids=[f"{s}-{w}-{e}" for s, w, e in UNEVEN])
def test_uneven_batches_match_one_process_and_communication_is_traced_or_said_not_to_be(
    ranks, tmp_path, capsys, strategy, world, extra
):
    config = DemoConfig(
        world_size=world, strategy=strategy, epochs=1, batch_size=479, name="u", **extra
    )
    validate(config)
    assert config.batch_size % config.trainers  # the batch does not divide evenly
    results = ranks(world, train_rank, config, timeout=300)
    report = summarize(config, results, check=True, run_dir=tmp_path / "u")
    out = capsys.readouterr().out
    assert "\r" not in out
    if extra.get("ps_mode") == "async":  # --check compares synchronous training only
        assert report.max_param_diff is None
    else:
        assert report.max_param_diff is not None and report.max_param_diff < 1e-4
    if strategy == "ps":  # async: every worker's push is an update
        async_ = extra.get("ps_mode") == "async"
        assert report.ps["servers"][0]["updates"] == 3 * (config.trainers if async_ else 1)
    else:
        assert report.history[-1]["updates"] == 3
    line = next(s for s in out.splitlines() if s.startswith("communication share"))
    saved = json.loads((tmp_path / "u" / "report.json").read_text())
    if report.comm_share is None:
        assert "not traced" in line and saved["comm_share"] is None
        assert not comm_traced([s for r in results for s in r["spans"]])
    else:
        assert report.comm_seconds_per_rank > 0 and "%" in line
        assert "0.0%" not in line or report.comm_share > 0


def test_a_piped_ps_demo_with_default_options_runs_and_writes_no_carriage_return(tmp_path):
    """Issue 16: `plait demo --strategy ps` with its defaults (4 ranks: 1 server, 3 workers,
    global batch 64: uneven) trains, matches one process (float64: exact on any CPU), and
    its log is plain lines."""
    proc = subprocess.run(
        [sys.executable, "-m", "plait.cli", "demo", "--strategy", "ps", "--epochs", "1",
         "--check", "--dtype", "float64", "--out", str(tmp_path), "--name", "p"],
        capture_output=True, text=True, timeout=400, cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\r" not in proc.stdout and "\r" not in proc.stderr
    assert "epoch 1/1  loss" in proc.stdout
    assert "(ok: bound 1.0e-09)" in proc.stdout and "Traceback" not in proc.stderr
    assert (tmp_path / "p" / "report.json").exists()
