"""Hugging Face models through torch.distributed.checkpoint (DCP): a Llama under plait's
fsdp and tp, a Mixtral (experts stacked in one tensor per weight) under ep, each on 2
ranks, save under Hugging Face's own keys (``model.layers.0.self_attn.q_proj.weight``...)
what the unwrapped model loads in one process bitwise; what the unwrapped model saved in
one process each layout loads bitwise, and its next step equals one process's (to 1e-12).
Float64, random init from config objects, nothing downloaded."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from tests import dcp_hf_fns as F

pytest.importorskip("transformers")

CLOSE = {"rtol": 0.0, "atol": 1e-12}


def _merged(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from every rank's: under ep each rank's optimizer holds the state of its
    slice of each stacked expert tensor (experts in ep-rank order along dimension 0)."""
    out = dict(parts[0])
    if out["optimizer"] is None:
        return out
    out["optimizer"] = {}
    for fqn, entry in parts[0]["optimizer"].items():
        full = out["model"][fqn].shape
        out["optimizer"][fqn] = {
            key: torch.cat([p["optimizer"][fqn][key] for p in parts])
            if isinstance(value, torch.Tensor) and value.dim() and value.shape != full
            else value
            for key, value in entry.items()
        }
    return out


def _equal(want: dict[str, Any], got: dict[str, Any], where: str) -> None:
    assert want["model"].keys() == got["model"].keys(), where
    for k, v in want["model"].items():
        assert torch.equal(v, got["model"][k]), f"{where}: {k}"
    if want["optimizer"] is None or got["optimizer"] is None:
        return
    assert want["optimizer"].keys() == got["optimizer"].keys(), where
    for fqn, entry in want["optimizer"].items():
        for key, value in entry.items():
            other = got["optimizer"][fqn][key]
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), (where, fqn, key)
    assert want["lr"] == got["lr"], where


def _close(want: dict[str, Any], got: dict[str, Any], where: str) -> None:
    for k, v in want["model"].items():
        torch.testing.assert_close(got["model"][k], v, **CLOSE, msg=f"{where}: {k}")
    if want["optimizer"] is None or got["optimizer"] is None:
        return
    for fqn, entry in want["optimizer"].items():
        for key, value in entry.items():
            torch.testing.assert_close(
                torch.as_tensor(got["optimizer"][fqn][key]),
                torch.as_tensor(value),
                **CLOSE,
                msg=f"{where}: {fqn} {key}",
            )


@pytest.mark.parametrize("name", ["fsdp", "tp", "ep"])
def test_hf_layout_saves_what_the_unwrapped_model_loads(ranks, tmp_path, name):
    d = str(tmp_path / name)
    saved = _merged([r[name] for r in ranks(2, F.save_all, [name], str(tmp_path), timeout=300)])
    keys = set(FileSystemReader(d).read_metadata().state_dict_metadata)
    assert "model.model.layers.0.self_attn.q_proj.weight" in keys, sorted(keys)[:8]
    family = F.FAMILY[name]
    alone = F.one_process(family, d, train=False)
    if saved["optimizer"] is None:  # tp: the one-process run says what it should hold
        want = F.one_process(family, str(tmp_path / "oracle"), train=True)["loaded"]
        _close(want, alone["loaded"], f"{name}: the saved state")
        saved["optimizer"] = alone["loaded"]["optimizer"]
    _equal(saved, alone["loaded"], f"{name} (2 ranks) -> the unwrapped {family}")


@pytest.mark.parametrize("name", ["fsdp", "tp", "ep"])
def test_hf_layout_loads_what_the_unwrapped_model_saved(ranks, tmp_path, name):
    family = F.FAMILY[name]
    d = str(tmp_path / family)
    saved = F.one_process(family, d, train=True)["loaded"]
    parts = [r[name] for r in ranks(2, F.load_all, [(name, family)], str(tmp_path), timeout=300)]
    where = f"the unwrapped {family} -> {name} (2 ranks)"
    _equal(saved, _merged([p["loaded"] for p in parts]), where)
    alone = F.one_process(family, d, train=False)
    _close(alone["after"], _merged([p["after"] for p in parts]), f"{where}: next step")
