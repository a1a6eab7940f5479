"""``plait demo --tour``: every layout is a valid demo configuration, and a shortened tour
trains all five on 4 ranks, each equal to one process, and writes one table and one plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.demo.gpt import FLOAT64_BOUND, validate
from plait.demo.tour import stops, tour


def test_every_stop_is_a_valid_four_rank_layout():
    names = [s.name for s in stops()]
    assert names == ["DDP dp4", "TP tp4", "PP pp4 1f1b", "PTD-P pp2 x tp2", "MoE ep4"]
    for s in stops():
        assert s.config.world_size == 4
        validate(s.config)  # raises on a bad one


@pytest.mark.timeout(600)
def test_a_short_tour_trains_every_layout_and_writes_the_table(tmp_path: Path):
    rows = tour(steps=4, out_dir=tmp_path, dtype="float64")  # exact on any CPU
    assert [r.layout for r in rows] == [s.name for s in stops()]
    for r in rows:
        assert r.max_param_diff >= 0 and r.max_param_diff < FLOAT64_BOUND, r
        assert r.check_bound == FLOAT64_BOUND
        assert r.step_ms > 0 and r.mib_sent_per_step > 0
    dense = [r.final_loss for r in rows if not r.layout.startswith("MoE")]
    assert max(dense) - min(dense) < 1e-4  # the same function, the same batches
    assert rows[2].bubble is not None and 0 <= rows[2].bubble < 1
    (folder,) = [
        p for p in tmp_path.iterdir() if p.name.startswith("tour-") and "-" not in p.name[5:]
    ]
    saved = json.loads((folder / "tour.json").read_text())
    assert len(saved) == 5
    assert (folder / "tour.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (folder / "tour.md").read_text().startswith("| layout |")
