"""``plait demo --model gpt``, shortened: trains on a dp x tp mesh, reports bytes per mesh
dimension, writes the run folder, and matches the dense GPT trained in one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.demo_gpt import GPTDemoConfig, GPTDemoOptionError, run, validate

SMALL = {"steps": 6, "evals": 2, "width": 32, "seq_len": 16, "batch_size": 4}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("n", "tp", "sp"), [(2, 2, True), (4, 2, False)])
def test_gpt_demo_trains_reports_and_matches_one_process(tmp_path: Path, n, tp, sp):
    config = GPTDemoConfig(world_size=n, tp=tp, sequence_parallel=sp, name="g", **SMALL)
    report = run(config, check=True, out_dir=tmp_path)
    # float32, 6 Adam steps: the ranks sum partial products in another order than the dense
    # matmuls, so parameters agree to rounding (Adam's first steps are ~lr * sign(g))
    assert report.max_param_diff is not None and report.max_param_diff < 1e-4
    saved = json.loads((tmp_path / "g" / "report.json").read_text())
    assert [h["step"] for h in saved["history"]] == [3, 6]
    assert saved["history"][-1]["loss"] < saved["history"][0]["loss"] + 0.5
    dims = set(saved["bytes_by_dim"])
    assert dims == ({"tp", "dp"} if n // tp > 1 else {"tp"})
    kinds = {c.split("/")[0] for c in saved["bytes_by_dim"]["tp"]}
    # sequence parallelism turns the tp all-reduces into all-gathers and reduce-scatters
    assert kinds == ({"all_gather", "reduce_scatter", "all_reduce"} if sp else {"all_reduce"})
    assert all(v > 0 for row in saved["bytes_by_dim"].values() for v in row.values())
    assert report.text.startswith("The assert statement") and len(report.text) > 200
    per_rank = saved["param_bytes_per_rank"]
    assert len(per_rank) == n and max(per_rank) < 0.6 * sum(per_rank) / n * tp
    trace = json.loads((tmp_path / "g" / "trace.json").read_text())["traceEvents"]
    assert {"forward", "backward", "optimizer step"} <= {e["name"] for e in trace}
    assert (tmp_path / "g" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


BAD = [
    (["-n", "4", "--tp", "3"], "--tp must divide -n"),
    (["-n", "2", "--heads", "3", "--width", "30"], "--heads must be divisible by --tp"),
    (["-n", "4", "--tp", "2", "--batch-size", "3"], "must be a multiple of the 2 data-parallel"),
    (["-n", "2", "--tp", "1", "--sp"], "--sp needs --tp of at least 2"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--strategy", "zero1"], "--strategy: not options of --model gpt"),
    (["--tp", "2"], "--tp: options of --model gpt"),
]


@pytest.mark.parametrize("args,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_gpt_option_prints_one_line_and_exits_2(capsys, args, needle):
    from plait import cli

    model = [] if args == ["--tp", "2"] else ["--model", "gpt"]
    assert cli.main(["demo", *model, *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("plait demo: "), err
    assert needle in lines[0]


def test_library_users_get_the_same_refusal():
    with pytest.raises(GPTDemoOptionError, match="--tp must divide -n"):
        validate(GPTDemoConfig(world_size=3, tp=2))
