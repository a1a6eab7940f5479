"""``plait demo --tour``: the reference learns in one process, every layout continues it on
4 ranks equal to one process, and the tour prints a table a newcomer can read, writes the
pictures and ends with a verdict. The shortened tour runs a small GPT in float64 (exact on
any CPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from plait import checkpoint
from plait.demo.gpt import FLOAT64_BOUND
from plait.demo.layouts import upcycle
from plait.demo.options import GPTDemoConfig, validate
from plait.demo.reference import Reference, Schedule, fastest_threads, lr_at
from plait.demo.tour import LEGEND, Row, Tour, _print, bubble_note, context_note, stops, table, tour
from plait.models import GPT

PNG = b"\x89PNG\r\n\x1a\n"
SMALL = {"width": 32, "layers": 3, "heads": 4, "seq_len": 32, "batch_size": 16}


def test_every_stop_is_a_valid_four_rank_layout_and_says_what_it_trades():
    names = [s.name for s in stops()]
    assert names == [
        "DDP dp4", "TP tp4", "PP pp4 1f1b", "PTD-P pp2 x tp2", "CP cp4 ring", "MoE ep4",
    ]  # fmt: skip
    for s in stops():
        assert s.config.world_size == 4
        validate(s.config)  # raises on a bad one
        assert len(s.trade.split()) > 10 and "." not in s.trade  # one sentence


def test_the_learning_rate_warms_up_then_decays_to_the_continuations_rate():
    s = Schedule(steps=100, warmup=10, peak_lr=1e-2, final_lr=1e-3)
    assert lr_at(0, s) == pytest.approx(1e-3) and lr_at(9, s) == pytest.approx(1e-2)
    lrs = [lr_at(i, s) for i in range(10, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))
    assert lrs[-1] == pytest.approx(1e-3)
    assert stops()[0].config.lr == pytest.approx(Schedule().final_lr)


def test_the_reference_trains_on_one_thread_or_every_core_whichever_is_faster():
    before = torch.get_num_threads()
    assert fastest_threads(GPTDemoConfig(**SMALL), repeats=1) in {1, os.cpu_count()}
    torch.set_num_threads(before)


def test_upcycling_starts_every_expert_as_the_dense_mlp():
    config = GPTDemoConfig(moe=True, ep=4, **SMALL)
    dense = GPT(GPTDemoConfig(**SMALL).model_config())
    moe = upcycle(dense.state_dict(), GPT(config.model_config()))
    want = dense.state_dict()
    got = moe.state_dict()
    for e in range(4):
        assert torch.equal(
            got[f"blocks.1.mlp.experts.{e}.fc1.weight"], want["blocks.1.mlp.fc1.weight"]
        )
    assert torch.equal(got["blocks.0.mlp.fc1.weight"], want["blocks.0.mlp.fc1.weight"])
    assert torch.equal(got["head.weight"], want["head.weight"])


def _row(**kw: object) -> Row:
    base = {
        "layout": "PP pp4 1f1b", "step_ms": 10.0, "param_mib_per_rank": 0.4,
        "mib_sent_per_step": 1.5, "bubble": 0.7, "bubble_simulated": 0.3,
        "bubble_on_cores": 0.6, "bubble_formula": 3 / 11, "cp_attention_bytes": None,
        "cp_formula_bytes": None, "final_loss": 1.5,
        "held_out_loss": 1.6, "max_param_diff": 1e-6, "check_bound": 1e-5, "passed": True,
    }  # fmt: skip
    return Row(**{**base, **kw})  # type: ignore[arg-type]


def test_the_bubble_note_gives_the_formula_and_the_shared_cores():
    pp = stops()[2]
    note = bubble_note(pp, _row(), cores=2)
    assert "3/11 = 27%" in note and "share 2 cores" in note and "60%" in note
    assert "share" not in bubble_note(pp, _row(), cores=8)
    assert "70% / 30% / 27%" in table([_row()])


def test_the_context_note_gives_the_rings_bytes_per_layer_and_the_count():
    """The tour's GPT in float64: 32 rows x 4 heads x 32 tokens x head dim 24 x 8 bytes =
    0.75 MiB of K (or V) per rank and layer; 3 other ranks' K and V = 4.5 MiB forward, the
    backward twice that, 3 layers: 40.5 MiB a training step."""
    cp = stops()[4]
    counted = _row(layout=cp.name, cp_attention_bytes=3 * 2**20, cp_formula_bytes=3 * 2**20)
    note = context_note(cp, counted)
    assert "4.50 MiB per rank" in note and "40.5 MiB a training step" in note
    assert "equal to the formula's 3.0 MiB" in note
    assert "NOT equal" in context_note(cp, _row(cp_attention_bytes=0, cp_formula_bytes=1))


def test_a_failed_check_prints_fail(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    ref = Reference(root="r", step=1, held_out_nats=1.5, train_seconds=1.0)
    bad = Tour([_row(max_param_diff=1e-3, passed=False)], ref, tmp_path, "text")
    assert not bad.passed
    _print(bad, stops()[2:3])
    assert "FAIL: PP pp4 1f1b ended 1.0e-03 from one process" in capsys.readouterr().err


@pytest.mark.timeout(600)
def test_a_short_tour_learns_continues_every_layout_and_writes_the_pictures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    schedule = Schedule(steps=12, warmup=2, evals=2, threads=1)
    result = tour(steps=3, schedule=schedule, out_dir=tmp_path, dtype="float64", model=SMALL)
    out = capsys.readouterr().out
    assert result.passed and "PASS: all 6 layouts match one process" in out
    rows = result.rows
    assert [r.layout for r in rows] == [s.name for s in stops()]
    for r in rows:
        assert 0 <= r.max_param_diff < FLOAT64_BOUND and r.check_bound == FLOAT64_BOUND, r
        assert r.step_ms > 0 and r.mib_sent_per_step > 0
    dense = [r.final_loss for r in rows if not r.layout.startswith("MoE")]
    assert max(dense) - min(dense) < 1e-9  # the same function from the same checkpoint
    pp = rows[2]
    assert pp.bubble_formula == pytest.approx(3 / 11)
    for value in (pp.bubble, pp.bubble_simulated):
        assert value is not None and 0 <= value < 1
    # the reference: a committed plait checkpoint, its held-out loss per character
    assert checkpoint.committed_steps(Path(result.reference.root)) == [12]
    assert len(result.reference.losses) == 12
    assert 0 < result.reference.held_out_nats < 5 and result.text.startswith("The assert")
    # the table, its two-line legend, one sentence per layout, the bubble explained
    assert len(LEGEND.splitlines()) == 2 and LEGEND in out
    for s in stops():
        assert f"- {s.name}: {s.trade}." in out
    assert "3/11 = 27%" in out
    # context parallelism did run over cp: rank 0's attention bytes counted on the cp group
    # equal the formula, by hand: 16 rows x 4 heads x 8 tokens x head dim 8 x 8 bytes = 32768
    # bytes of K per rank and layer (held-out: 16 rows too); 3 layers x 3 other ranks x K and
    # V, over 3 steps and 2 held-out forwards, and the backward's 3 steps twice
    cp = rows[4]
    assert cp.layout == "CP cp4 ring" and cp.passed
    q = 32768
    assert cp.cp_attention_bytes == cp.cp_formula_bytes == 3 * 3 * 2 * (5 + 2 * 3) * q
    assert cp.mib_sent_per_step > rows[0].mib_sent_per_step  # K and V beside the gradients
    assert all(r.cp_attention_bytes is None for r in rows if r is not cp)
    assert "equal to the formula's" in out and "NOT equal" not in out
    folder = result.folder
    assert (folder / "tour.md").read_text().startswith("| layout |")
    saved = json.loads((folder / "tour.json").read_text())
    assert len(saved["rows"]) == 6 and saved["passed"] is True
    assert saved["reference"]["held_out_nats_per_char"] == result.reference.held_out_nats
    for name in ("tour.png", "schedule.png", "timeline.png"):
        assert (folder / name).read_bytes()[:8] == PNG, name
        assert f"{name} " in out
