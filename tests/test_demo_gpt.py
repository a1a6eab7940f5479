"""``plait demo --model gpt``, shortened: trains on a dp x tp mesh, reports bytes per mesh
dimension, writes the run folder, and matches the dense GPT trained in one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.demo.gpt import FLOAT64_BOUND, run
from plait.demo.options import GPTDemoConfig, GPTDemoOptionError, validate

# float64: Adam's step m / (sqrt(v) + eps) turns a rounding change in a small gradient
# element into a sizeable fraction of lr, so float32 runs differ by 1e-4..1e-3 within a few
# steps (measured here; another CPU rounds differently)
SMALL = {"steps": 6, "evals": 2, "width": 32, "seq_len": 16, "batch_size": 4, "dtype": "float64"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("n", "tp", "sp"), [(2, 2, True), (4, 2, False)])
def test_gpt_demo_trains_reports_and_matches_one_process(tmp_path: Path, n, tp, sp, pool_of):
    config = GPTDemoConfig(world_size=n, tp=tp, sequence_parallel=sp, name="g", **SMALL)
    report = run(config, check=True, out_dir=tmp_path, pool=pool_of(config.world_size))
    assert report.max_param_diff is not None and report.max_param_diff < FLOAT64_BOUND
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


@pytest.mark.timeout(300)
def test_gpt_demo_pipeline_reports_the_bubble_and_matches_one_process(tmp_path: Path, pool_of):
    config = GPTDemoConfig(world_size=2, tp=1, pp=2, schedule="1f1b", name="p", **SMALL)
    report = run(config, check=True, out_dir=tmp_path, pool=pool_of(config.world_size))
    assert report.max_param_diff is not None and report.max_param_diff < FLOAT64_BOUND
    assert set(report.bytes_by_dim) == {"pp"}
    b = report.bubble
    assert b["formula"] == pytest.approx(1 / 5)  # (p-1)/(m+p-1) with p=2, m=4
    assert 0.0 <= b["measured"] < 1.0 and 0.0 <= b["simulated"] < 1.0
    assert report.param_bytes_per_rank[0] < sum(report.param_bytes_per_rank)


@pytest.mark.timeout(300)
def test_gpt_demo_moe_reports_the_load_and_matches_one_process(tmp_path: Path, pool_of):
    config = GPTDemoConfig(world_size=2, tp=1, moe=True, ep=2, name="m", **SMALL)
    report = run(config, check=True, out_dir=tmp_path, pool=pool_of(config.world_size))
    assert report.max_param_diff is not None and report.max_param_diff < FLOAT64_BOUND
    assert len(report.moe) == SMALL["steps"]
    (layer,) = report.moe[-1]
    assert layer == "blocks.1.mlp"
    # every routed choice of the global batch is counted once over the ep group
    st = report.moe[-1][layer]
    assert sum(st["routed_per_expert"]) >= SMALL["batch_size"] * SMALL["seq_len"]
    assert (tmp_path / "m" / "moe_load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(300)
def test_gpt_demo_ptdp_matches_one_process(tmp_path: Path, pool_of):
    """pp 2 x tp 2 through plait.strategies.compose (the held-out evaluation steps too)."""
    config = GPTDemoConfig(world_size=4, tp=2, pp=2, name="c", **SMALL)
    report = run(config, check=True, out_dir=tmp_path, pool=pool_of(config.world_size))
    assert report.max_param_diff is not None and report.max_param_diff < FLOAT64_BOUND
    assert set(report.bytes_by_dim) == {"pp", "tp"}


BAD = [
    (["-n", "4", "--tp", "3"], "--tp must divide -n"),
    (["-n", "2", "--heads", "3", "--width", "30"], "--heads must be divisible by --tp"),
    (["-n", "4", "--tp", "2", "--batch-size", "3"], "multiple of the 2 ranks that each take"),
    (["-n", "2", "--tp", "1", "--sp"], "--sp needs --tp of at least 2"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--strategy", "zero1"], "--strategy: not options of --model gpt"),
    (["--tp", "2"], "--tp: options of --model gpt"),
    (["-n", "4", "--pp", "3"], "--pp 3 x --tp 1 must divide -n 4"),
    (["-n", "4", "--pp", "2", "--batch-size", "12"], "multiple of --microbatches 4 x the 2"),
    (["--pp", "2", "--schedule", "fast"], "--schedule must be one of"),
    (["--pp", "2", "--microbatches", "3", "--batch-size", "16"], "multiple of --microbatches 3"),
    (["--moe", "--ep", "2", "--experts", "3"], "--experts 3 must be a multiple of --ep 2"),
    (["--moe", "--pp", "2"], "--pp and --moe do not compose"),
    (["--ep", "2"], "--ep applies to --moe only"),
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


FITTED = [  # options given -> (defaults they moved, and to what)
    (["--steps", "6"], {"evals": None, "eval_points": 6}),
    (["--steps", "6", "--evals", "3"], {"eval_points": 3}),
    (["-n", "8", "--tp", "8"], {"heads": 8, "width": 64}),
    (["-n", "6", "--tp", "1"], {"batch_size": 18}),
    (["-n", "16", "--pp", "2", "--tp", "1"], {"batch_size": 32}),
    (["-n", "8", "--moe", "--ep", "8"], {"experts": 8}),
    (["-n", "3", "--tp", "3", "--sp"], {"heads": 12, "width": 72, "seq_len": 66}),
]


@pytest.mark.parametrize("args,want", FITTED, ids=[" ".join(a) for a, _ in FITTED])
def test_defaults_fit_the_options_given(monkeypatch, args, want):
    """Issue 26.19: `--steps 6` was refused because the default --evals 10 exceeded it; a
    default moves to fit what the user gave, only given options can contradict."""
    from plait import cli
    from plait.demo import gpt as demo_gpt

    seen = []

    def fake_run(config, *, check, out_dir):
        validate(config)
        seen.append(config)
        return demo_gpt.GPTDemoReport(
            config=config, final_loss=1.0, held_out_loss=1.0, tokens_per_s=1.0,
            train_seconds=1.0, layout="",
        )  # fmt: skip

    monkeypatch.setattr(demo_gpt, "run", fake_run)
    assert cli.main(["demo", "--model", "gpt", *args]) == 0
    (config,) = seen
    assert {k: getattr(config, k) for k in want} == want


def test_explicit_contradictory_options_are_still_refused(capsys):
    from plait import cli

    assert cli.main(["demo", "--model", "gpt", "--steps", "6", "--evals", "10"]) == 2
    assert "--evals must be in 1..6 (--steps), got 10" in capsys.readouterr().err
    assert cli.main(["demo", "--model", "gpt", "-n", "8", "--tp", "8", "--heads", "4"]) == 2
    assert "--heads must be divisible by --tp" in capsys.readouterr().err


def test_a_float32_check_bound_is_measured_against_float64_in_one_process():
    """--check in float32 accepts NOISE_FACTOR times how far the one-process GPT in float32
    lands from the one in float64 (each batch summed whole and in two halves)."""
    from plait.demo.closeness import distance
    from plait.demo.gpt import float32_noise, oracle, oracle_losses
    from plait.demo.layouts import start_model

    config = GPTDemoConfig(**{**SMALL, "steps": 3, "dtype": "float32"})
    noise = float32_noise(config)
    exact, start = oracle(config, dtype="float64"), start_model(config).state_dict()
    assert noise.orders == (1, 2)
    assert noise.distance == max(distance(oracle(config, pieces=p), exact, start) for p in (1, 2))
    assert 0 < noise.distance < 1e-3 and 0 <= noise.loss < 1e-5
    assert oracle_losses(config, dtype="float64") != oracle_losses(config)  # float32 rounds


def test_library_users_get_the_same_refusal():
    with pytest.raises(GPTDemoOptionError, match="--tp must divide -n"):
        validate(GPTDemoConfig(world_size=3, tp=2))


@pytest.mark.timeout(300)
def test_gpt_demo_on_a_2d_grid_matches_one_process(tmp_path: Path, pool_of):
    config = GPTDemoConfig(world_size=4, tp=4, tp_mode="2d", name="d", **SMALL)
    report = run(config, check=True, out_dir=tmp_path, pool=pool_of(config.world_size))
    assert report.max_param_diff is not None and report.max_param_diff < FLOAT64_BOUND
    assert set(report.bytes_by_dim) == {"row", "col"}


def test_a_non_square_2d_grid_is_refused_naming_valid_sizes():
    with pytest.raises(GPTDemoOptionError, match="--tp 8 --tp-mode 2d: .*4 or 9"):
        validate(GPTDemoConfig(world_size=8, tp=8, tp_mode="2d"))


def test_a_failed_check_exits_1(monkeypatch):
    """--check farther from one process than rounding explains is an error, not exit 0."""
    from plait import cli
    from plait.demo import gpt as demo_gpt

    def fake_run(config, *, check, out_dir):
        return demo_gpt.GPTDemoReport(
            config=config,
            final_loss=1.0,
            held_out_loss=1.0,
            tokens_per_s=1.0,
            train_seconds=1.0,
            layout="",
            max_param_diff=0.5,
        )

    monkeypatch.setattr(demo_gpt, "run", fake_run)
    assert cli.main(["demo", "--model", "gpt", "--check"]) == 1
    fake_ok = lambda config, *, check, out_dir: demo_gpt.GPTDemoReport(  # noqa: E731
        config=config,
        final_loss=1.0,
        held_out_loss=1.0,
        tokens_per_s=1.0,
        train_seconds=1.0,
        layout="",
        max_param_diff=1e-10,
    )
    monkeypatch.setattr(demo_gpt, "run", fake_ok)
    assert cli.main(["demo", "--model", "gpt", "--check"]) == 0
