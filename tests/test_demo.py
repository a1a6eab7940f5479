"""The main job, shortened: trains, reports, traces, plots, and matches the oracle."""

from __future__ import annotations

import json
from pathlib import Path

from plait.demo import DemoConfig, run


def test_demo_trains_reports_and_matches_one_process(tmp_path: Path):
    config = DemoConfig(world_size=2, epochs=3, name="t")
    report = run(config, check=True, out_dir=tmp_path)
    folder = tmp_path / "t"
    saved = json.loads((folder / "report.json").read_text())
    assert saved["config"]["world_size"] == 2 and len(saved["history"]) == 3
    assert saved["history"][-1]["loss"] < saved["history"][0]["loss"]
    assert report.test_accuracy > 0.5
    assert report.max_param_diff is not None and report.max_param_diff < 1e-4
    assert 0.0 <= report.hidden_fraction <= 1.0 and 0.0 <= report.comm_share <= 1.0
    trace = json.loads((folder / "trace.json").read_text())["traceEvents"]
    names = {e["name"] for e in trace if e["ph"] == "X"}
    assert {"forward", "backward", "optimizer", "all_reduce bucket 0"} <= names
    assert {e["pid"] for e in trace if e["ph"] == "X"} == {0, 1}
    assert (folder / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_under_fsdp_traces_gathers_and_reductions(tmp_path: Path):
    config = DemoConfig(world_size=2, epochs=1, name="f", strategy="fsdp")
    report = run(config, check=True, out_dir=tmp_path)
    assert report.max_param_diff is not None and report.max_param_diff < 1e-4
    trace = json.loads((tmp_path / "f" / "trace.json").read_text())["traceEvents"]
    names = {e["name"] for e in trace if e["ph"] == "X"}
    assert {"forward", "backward", "all_gather DigitsCNN", "reduce_scatter DigitsCNN"} <= names
    assert report.comm_seconds_per_rank > 0


def test_demo_under_a_parameter_server_reports_servers_and_workers(tmp_path: Path):
    config = DemoConfig(world_size=3, epochs=1, name="p", strategy="ps", evals_per_epoch=2)
    report = run(config, check=True, out_dir=tmp_path)
    assert report.max_param_diff is not None and report.max_param_diff < 1e-4
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
