"""Checkpoints: sharded save/load round trips, incomplete saves are refused, full state
dicts keep the unwrapped keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import plait
from plait import checkpoint
from tests import checkpoint_fns, ddp_fns


def test_sharded_round_trip_and_full_state_dict_keys(ranks, tmp_path: Path):
    results = ranks(2, checkpoint_fns.save_and_load, str(tmp_path / "ck"))
    keys = sorted(ddp_fns.make_model().state_dict())
    for same, full_keys in results:
        assert same and full_keys == keys
    files = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert files == ["manifest.json", "shard-0-of-2.pt", "shard-1-of-2.pt"]  # no *.tmp left


def test_a_save_without_manifest_is_refused(ranks, tmp_path: Path):
    for message in ranks(2, checkpoint_fns.interrupted_save, str(tmp_path / "half")):
        assert "not a complete plait checkpoint" in message


def test_atomic_write_replaces_whole_files(tmp_path: Path):
    target = tmp_path / "f.pt"
    checkpoint.save_atomic({"a": torch.arange(3)}, target)
    checkpoint.save_atomic({"a": torch.arange(5)}, target)
    assert torch.equal(torch.load(target)["a"], torch.arange(5))
    assert [p.name for p in tmp_path.iterdir()] == ["f.pt"]


def test_full_state_dict_of_a_plain_model():
    model = ddp_fns.make_model()
    assert checkpoint.full_state_dict(model).keys() == model.state_dict().keys()
    with pytest.raises(RuntimeError, match="plait.init"):
        plait.DistributedDataParallel(model)
