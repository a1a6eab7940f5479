"""``plait demo --model gpt --cp N [--context ring|ulysses]``: the GPT trained with context
parallelism through the command line matches one process (parameters and every step's
loss, float64), and the attention bytes counted on cp equal the formula on every rank."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from plait.demo import context
from plait.demo.gpt import GPTDemoReport, check_passed
from plait.demo.options import GPTDemoConfig

ROOT = Path(__file__).parent.parent
SMALL = ["--steps", "4", "--evals", "2", "--width", "32", "--seq-len", "16", "--batch-size", "4"]


def _demo(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "plait.cli", "demo", "--model", "gpt", *args, *SMALL,
         "--dtype", "float64", "--check", "--out", str(tmp_path), "--name", "r"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc, json.loads((tmp_path / "r" / "report.json").read_text())


def _loss_diff(stdout: str) -> float:
    match = re.search(r"largest per-step loss difference to one process: (\S+)", stdout)
    assert match, stdout
    return float(match.group(1))


@pytest.mark.parametrize(
    ("args", "kinds", "dims"),
    [
        (["--cp", "2"], {"cp_kv", "cp_kv_bwd", "cp_dkv", "all_reduce"}, {"cp"}),
        (["--cp", "2", "--context", "ulysses"], {"all_to_all", "all_reduce"}, {"cp"}),
        (["-n", "4", "--cp", "2"], {"cp_kv", "cp_kv_bwd", "cp_dkv"}, {"cp", "dp+cp"}),
        (
            ["-n", "4", "--cp", "2", "--tp", "2", "--sp"],
            {"cp_kv", "cp_kv_bwd", "cp_dkv", "all_reduce"},
            {"cp", "tp"},
        ),  # fmt: skip
    ],
    ids=["ring", "ulysses", "ring-dp2", "ring-tp2-sp"],
)
def test_cp_demo_matches_one_process_and_counts_the_formulas_bytes(tmp_path, args, kinds, dims):
    proc, saved = _demo(tmp_path, *args)
    out = proc.stdout
    assert "(ok: bound 1.0e-08)" in out and saved["max_param_diff"] < 1e-8
    # every step's loss (the mean over the cp x dp ranks' tokens) is one process's
    assert _loss_diff(out) < 1e-10 and saved["max_loss_diff"] < 1e-10
    assert len(saved["losses"]) == 4
    assert set(saved["bytes_by_dim"]) == dims
    assert {k.split("/")[0] for k in saved["bytes_by_dim"]["cp"]} == kinds
    cp = saved["cp_bytes"]
    assert cp["agree"] and all(c == cp["formula"] for c in cp["counted"])
    assert len(cp["counted"]) == (4 if "-n" in args else 2)
    assert all(v > 0 for v in cp["formula"].values())
    assert "agree on every rank" in out and "gradients on " in out
    if "dp+cp" in dims:  # the gradient average runs on the flattened cp x dp group
        assert {k.split("/")[0] for k in saved["bytes_by_dim"]["dp+cp"]} == {"all_reduce"}


def test_the_formula_counts_ring_and_ulysses_bytes_per_pass():
    """By hand: width 32 / 4 heads = head dim 8, 4 rows x 4 heads x 8 tokens x 8 x 8 bytes =
    8192 bytes of q per rank and layer (held-out: 16 rows, 32768)."""
    c = GPTDemoConfig(
        world_size=2, tp=1, cp=2, steps=4, evals=2, width=32, seq_len=16, batch_size=4,
        dtype="float64",
    )  # fmt: skip
    q, q_held = 8192, 32768
    ring = context.attention_formula(c, held_out_rows=16)
    assert ring == {
        "cp_kv": 2 * 2 * (4 * q + 2 * q_held),  # 2 layers x K, V; 4 steps and 2 evaluations
        "cp_kv_bwd": 2 * 2 * 4 * q,
        "cp_dkv": 2 * 2 * 4 * q,
    }
    uly = context.attention_formula(replace(c, context="ulysses"), held_out_rows=16)
    assert uly == {"all_to_all": 2 * (4 * (4 * q + 2 * q_held) + 4 * 4 * q) // 2}


def test_counted_bytes_that_differ_from_the_formula_fail_the_demo(monkeypatch, capsys):
    c = GPTDemoConfig(world_size=2, tp=1, cp=2, steps=4, evals=2, seq_len=16, batch_size=4)
    want = context.attention_formula(c, held_out_rows=16)
    good = {"cp": {f"{k}/p2p": v for k, v in want.items()}}
    bad = {"cp": {**good["cp"], "cp_dkv/p2p": want["cp_dkv"] - 8}}
    assert context.check(c, [good, good], held_out_rows=16)["agree"]
    verdict = context.check(c, [good, bad], held_out_rows=16)
    assert not verdict["agree"] and verdict["counted"][1]["cp_dkv"] == want["cp_dkv"] - 8
    lines = context.report_lines(c, verdict, good)
    assert "DISAGREE" in lines[0]

    from plait import cli
    from plait.demo import gpt as demo_gpt

    def fake_run(config, *, check, out_dir):
        return GPTDemoReport(
            config=config, final_loss=1.0, held_out_loss=1.0, tokens_per_s=1.0,
            train_seconds=1.0, layout="", cp_bytes=verdict,
        )  # fmt: skip

    monkeypatch.setattr(demo_gpt, "run", fake_run)
    assert cli.main(["demo", "--model", "gpt", "--cp", "2"]) == 1
    assert not check_passed(fake_run(c, check=False, out_dir=None))


BAD = [
    (["--context", "ulysses"], "--context ulysses applies to context parallelism: add --cp 2"),
    (["--cp", "2", "--seq-len", "18"], "--seq-len 18 must be divisible by 2 x --cp = 4"),
    (["--cp", "3", "-n", "4"], "--cp 3 x --tp 1 must divide -n 4"),
    (["--cp", "0"], "--cp must be at least 1"),
    (
        ["--cp", "2", "--context", "ulysses", "--heads", "3", "--width", "30"],
        "--context ulysses splits the heads over cp: --heads 3 must be divisible by --cp 2",
    ),
    (["--cp", "2", "--pp", "2", "-n", "4"], "--cp does not compose with --pp"),
    (["--cp", "2", "--moe"], "--cp does not compose with --moe"),
    (["--cp", "2", "-n", "4", "--tp", "2", "--sp", "--seq-len", "12"], "(3) must split over"),
    (["--cp", "2", "-n", "8", "--tp", "4", "--tp-mode", "2d"], "drop --tp-mode 2d"),
    (["--cp", "2", "-n", "4", "--batch-size", "3"], "(-n 4 / --tp 1 / --pp 1 / --cp 2)"),
]


@pytest.mark.parametrize("args,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_cp_option_prints_one_line_and_exits_2(capsys, args, needle):
    from plait import cli

    assert cli.main(["demo", "--model", "gpt", *args]) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("plait demo: "), err
    assert needle in lines[0]


@pytest.mark.parametrize("args", [["--cp", "2"], ["--context", "ring"]])
def test_cp_options_are_refused_for_the_cnn(capsys, args):
    from plait import cli

    assert cli.main(["demo", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plait demo: ") and f"{args[0]}: options of --model gpt" in err


FITTED = [
    (["--cp", "2"], {"world_size": 2, "tp": 1, "dp": 1, "seq_len": 64}),
    (["-n", "6", "--cp", "3"], {"tp": 1, "dp": 2, "seq_len": 66, "batch_size": 16}),
    (["-n", "8", "--cp", "8", "--context", "ulysses"], {"heads": 8, "width": 64}),
    (["--cp", "2", "--tp", "2", "--context", "ulysses"], {"world_size": 4, "heads": 4}),
]


@pytest.mark.parametrize("args,want", FITTED, ids=[" ".join(a) for a, _ in FITTED])
def test_defaults_fit_context_parallelism(monkeypatch, args, want):
    """-n defaults to cp x tp, tp to 1; an unspecified sequence length rises to a multiple
    of 2 x cp, the heads to a multiple of cp x tp under Ulysses."""
    from plait import cli
    from plait.demo import gpt as demo_gpt

    seen = []

    def fake_run(config, *, check, out_dir):
        demo_gpt.validate(config)
        seen.append(config)
        return GPTDemoReport(
            config=config, final_loss=1.0, held_out_loss=1.0, tokens_per_s=1.0,
            train_seconds=1.0, layout="",
        )  # fmt: skip

    monkeypatch.setattr(demo_gpt, "run", fake_run)
    assert cli.main(["demo", "--model", "gpt", *args]) == 0
    (config,) = seen
    assert {k: getattr(config, k) for k in want} == want
