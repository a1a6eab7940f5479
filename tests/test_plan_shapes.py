"""The planner's memory for other shapes (GQA, SwiGLU, fused attention), its communication
buffers, the memory-bound term of the step time, and `plait plan fit`: pure arithmetic,
each against a value derived by hand."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from plait.plan import hf
from plait.plan.activations import model_layer_bytes, per_layer_bytes
from plait.plan.buffers import BUCKET_BYTES, buffer_bytes
from plait.plan.cli import default_subcommand
from plait.plan.hardware import a100
from plait.plan.layout import Job, Layout
from plait.plan.model import published
from plait.plan.time import step_time


def test_gpt_formula_is_unchanged() -> None:
    # Korthikanti Table 2: s b h (34 + 5 a s / h), e = 2, k = 1
    s, b, h, a = 2048, 1, 12288, 96
    assert per_layer_bytes(s=s, b=b, h=h, a=a) == s * b * h * (34 + 5 * a * s / h)


def test_gqa_swiglu_fused_attention_by_hand() -> None:
    # Llama 3 8B: h 4096, 32 heads of 128, 8 kv heads (kv 1024), f 14336; bf16, no dropout
    m = hf.load("llama3-8b")
    job = Job(global_batch=1, seq=8192, dropout=False, flash_attention=True)
    s, h, q, kv, f = 8192, 4096, 4096, 1024, 14336
    # two RMSNorms: fp32 input, normalised input, output (the q/k/v and MLP inputs)
    whole = 2 * (4 + 2 * 2) * h
    # Q K V, out-proj input (fused attention); SwiGLU: gate, silu(gate), up, down input
    split = 2 * (2 * q + 2 * kv) + 4 * 2 * f
    lse = 4 * 32  # fp32 log-sum-exp per head and token
    assert model_layer_bytes(m, job, Layout()) == s * (whole + split + lse)
    # tp 2 without SP: the whole part stays, the rest halves
    lay = Layout(tp=2)
    assert model_layer_bytes(m, job, lay) == s * whole + s * (split + lse) / 2
    # unfused (eager) attention repeats K and V to the queries' width and keeps the fp32
    # softmax and its bf16 cast: (4 + e) a s^2 = 6 * 32 * s^2 without dropout
    unfused = replace(job, flash_attention=False)
    eager_split = 2 * 4 * q + 4 * 2 * f
    assert model_layer_bytes(m, unfused, Layout()) == s * (whole + eager_split) + 6 * 32 * s * s


def test_buffers_by_hand() -> None:
    m = published("175B")
    job = Job(global_batch=64, seq=2048)
    act = 2048 * 12288 * 2
    assert buffer_bytes(m, job, Layout()) == 0
    assert buffer_bytes(m, job, Layout(dp=8)) == 2 * BUCKET_BYTES
    assert buffer_bytes(m, job, Layout(tp=8, pp=8, schedule="1f1b")) == 2 * act / 8
    split, whole = m.block_split()
    assert buffer_bytes(m, job, Layout(dp=8, zero=3)) == 3 * 2 * (split + whole)


def test_memory_bound_term_adds_passes_over_activations() -> None:
    m, job = published("22B"), Job(global_batch=4, seq=2048)
    lay = Layout(tp=8, microbatch=4, recompute="full")
    off = replace(a100(1), elementwise_passes=0.0)
    on = replace(off, elementwise_passes=2.0)
    moved = 2.0 * model_layer_bytes(m, job, lay, recompute="none") * 4 / 3 / on.hbm_bandwidth
    extra = step_time(m, job, lay, on).compute_per_mb - step_time(m, job, lay, off).compute_per_mb
    assert math.isclose(extra, m.layers * moved, rel_tol=1e-9)


def test_default_subcommand() -> None:
    assert default_subcommand(["plan", "--model", "x"]) == ["plan", "layouts", "--model", "x"]
    assert default_subcommand(["plan", "fit", "--model", "x"])[1] == "fit"
    assert default_subcommand(["plan", "--help"]) == ["plan", "--help"]


def test_plan_fit_json_and_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    from plait.cli import main

    rc = main(
        [
            "plan",
            "fit",
            "--model",
            "llama3-8b",
            "--gpus",
            "8xH100",
            "--top",
            "3",
            "--json",
            "-",
            "--tp",
            "1,2",
            "--pp",
            "1",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["fits"] is True
    for row in data["layouts"]:
        assert math.isclose(row["headroom"], 72e9 - row["needed"])
        parts = ("parameters", "gradients", "optimizer_states", "activations")
        total = sum(row[k] for k in parts) + row["communication_buffers"]
        assert math.isclose(total, row["needed"]) and row["fits"] == (row["headroom"] >= 0)
    with pytest.raises(SystemExit):
        main(["plan", "fit", "--params", "1e30", "--gpus", "8xH100"])
    with pytest.raises(SystemExit):
        main(["plan", "fit", "--model", "gpt", "--layers", "-2"])
    err = capsys.readouterr().err
    assert "outside 1 to" in err


def test_plot_writes_a_png(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("matplotlib")
    from plait.cli import main

    out = tmp_path / "mem.png"
    rc = main(
        [
            "plan",
            "fit",
            "--model",
            "llama3-8b",
            "--gpus",
            "8xH100",
            "--top",
            "2",
            "--tp",
            "1",
            "--pp",
            "1",
            "--plot",
            str(out),
        ]
    )
    assert rc == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
