"""The tour's use of plait.metrics: the table's MFU column, and every run's metrics.jsonl
gathered into one TensorBoard logdir (read back), without running the tour."""

from __future__ import annotations

import json
from pathlib import Path

from plait.demo.tour import LEGEND, Row, _tensorboard, stops, table
from tests.test_metrics import _events


def _row(**kw: object) -> Row:
    base = {
        "layout": "DDP dp4", "step_ms": 10.0, "param_mib_per_rank": 0.4,
        "mib_sent_per_step": 1.5, "bubble": None, "bubble_simulated": None,
        "bubble_on_cores": None, "bubble_formula": None, "cp_attention_bytes": None,
        "cp_formula_bytes": None, "final_loss": 1.5, "held_out_loss": 1.6,
        "max_param_diff": 1e-12, "check_bound": 1e-8, "passed": True,
    }  # fmt: skip
    return Row(**{**base, **kw})  # type: ignore[arg-type]


def test_the_table_shows_each_layouts_mfu_and_the_legend_says_what_it_is():
    text = table([_row(mfu=0.0304), _row(layout="TP tp4")])
    assert "| step ms | MFU |" in text
    assert "| DDP dp4 | 10 | 3.0% | 0.40 |" in text and "| TP tp4 | 10 | - | 0.40 |" in text
    assert len(LEGEND.splitlines()) == 2 and "MFU: the model's FLOP/s" in LEGEND


def test_every_runs_metrics_jsonl_becomes_a_run_of_one_tensorboard_logdir(tmp_path: Path):
    folder = tmp_path / "tour-1200"
    runs = {folder / "reference-metrics": 2.0}
    runs.update({tmp_path / f"tour-1200-{i}": float(i) for i in range(1, 7)})
    for path, loss in runs.items():
        path.mkdir(parents=True)
        lines = [json.dumps({"step": s, "loss": loss + s, "memory_peak_bytes": [7, 8]})
                 for s in (1, 2)]  # fmt: skip
        (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert _tensorboard(folder, stops(), tmp_path, "1200")
    board = folder / "tensorboard"
    names = sorted(p.name for p in board.iterdir())
    assert names[:3] == ["0-reference", "1-ddp-dp4", "2-tp-tp4"] and len(names) == 7
    assert "4-ptd-p-pp2-x-tp2" in names
    events = _events(board / "4-ptd-p-pp2-x-tp2")
    assert events["loss"] == [(1, 5.0), (2, 6.0)]
    assert events["memory_peak_bytes/rank1"] == [(1, 8.0), (2, 8.0)]
