"""torch.distributed.checkpoint (DCP) both ways for expert (ep), context (cp) and PTD-P
layouts of plait's GPT in float64: what each saves, one process (``no_dist=True``) and
PyTorch FSDP2 on 4 ranks load bitwise (the whole parameters and AdamW state equal to what
the layout held); what FSDP2 saves (nested, and torchtitan's flattened optimizer format)
each layout loads bitwise, each rank reading only what it holds, and its next step equals
one process's (to 1e-12: the ranks sum gradients in another order)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests import dcp_layouts_fns as F

CLOSE = {"rtol": 0.0, "atol": 1e-12}


def _keys(model: dict[str, Any]) -> list[str]:
    return [k for k in model if not k.endswith(F.LOCAL_BUFFERS)]


def _equal(want: dict[str, Any], got: dict[str, Any], where: str) -> None:
    assert set(_keys(want["model"])) == set(_keys(got["model"])), where
    for k in _keys(want["model"]):
        v = want["model"][k]
        assert torch.equal(v, got["model"][k]), f"{where}: {k}"
    assert want["optimizer"].keys() == got["optimizer"].keys(), where
    for fqn, entry in want["optimizer"].items():
        assert set(entry) == {"step", "exp_avg", "exp_avg_sq"}, (where, fqn, set(entry))
        for key, value in entry.items():
            other = got["optimizer"][fqn][key]
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), (
                f"{where}: {fqn} {key}"
            )
    assert want["lr"] == got["lr"], where


def _close(want: dict[str, Any], got: dict[str, Any], where: str) -> None:
    for k in _keys(want["model"]):
        torch.testing.assert_close(got["model"][k], want["model"][k], **CLOSE, msg=f"{where}: {k}")
    for fqn, entry in want["optimizer"].items():
        for key, value in entry.items():
            torch.testing.assert_close(
                torch.as_tensor(got["optimizer"][fqn][key]),
                torch.as_tensor(value),
                **CLOSE,
                msg=f"{where}: {fqn} {key}",
            )


def _merged(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from every rank's: under ep each rank's optimizer holds its experts."""
    out = dict(parts[0])
    out["optimizer"] = {}
    for part in parts:
        out["optimizer"].update(part["optimizer"])
    return out


def _saved(parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {name: _merged([p[name] for p in parts]) for name in parts[0]}


# each layout's world size (the FSDP2 side always runs on 4 ranks)
WORLD = {
    "ep": 2,
    "ep2_dp2": 4,
    "cp": 2,
    "pp2_tp2": 4,
    "pp2_dp2": 4,
    "pp2_dp2_zero1": 4,
    "pp2_ep2": 4,
    "pp2_cp2": 4,
    "tp2_dp2_zero1": 4,
}


@pytest.mark.parametrize("name", list(WORLD))
def test_layout_saves_what_fsdp2_and_one_process_load(ranks, tmp_path, name):
    """ep and cp (2 ranks), ep2 x dp2, PTD-P pp2 x tp2, pp2 x dp2, pp2 x dp2 with ZeRO-1,
    pp2 x ep2, pp2 x cp2 and tp2 x dp2 with ZeRO-1 (4 ranks) save (the nested optimizer
    format); one process and FSDP2 on 4 ranks load them bitwise; FSDP2's next step equals
    one process's."""
    root = str(tmp_path)
    saved = _saved(ranks(WORLD[name], F.plait_save_all, [name], root, timeout=300))[name]
    alone = F.one_process_load(F.FAMILY[name], f"{root}/{name}", False)
    _equal(saved, alone["loaded"], f"{name} -> one process")
    for r, got in enumerate(ranks(4, F.fsdp2_load_all, [name], root, timeout=300)):
        _equal(saved, got[name]["loaded"], f"{name} -> FSDP2 rank {r} of 4")
        _close(alone["after"], got[name]["after"], f"{name} -> FSDP2 rank {r}: next step")


# FSDP2 (4 ranks) saving: model family, torchtitan's flattened optimizer format or not
SAVED_BY_FSDP2 = [("moe", False), ("gpt", True), ("gpt", False)]


@pytest.fixture(scope="module")
def fsdp2_saved(ranks, tmp_path_factory):
    """FSDP2's directories (one pool run for the module) and the state each holds."""
    root = str(tmp_path_factory.mktemp("fsdp2"))
    return root, ranks(4, F.fsdp2_save_all, SAVED_BY_FSDP2, root, timeout=300)[0]


@pytest.mark.parametrize(
    ("name", "source", "flat"),
    [
        ("ep", "moe-False", False),
        ("ep2_dp2", "moe-False", False),
        ("cp", "gpt-True", True),
        ("pp2_tp2", "gpt-False", False),
        ("pp2_dp2", "gpt-True", True),
        ("pp2_dp2_zero1", "gpt-False", False),
        ("pp2_ep2", "moe-False", False),
        ("pp2_cp2", "gpt-True", True),
        ("tp2_dp2_zero1", "gpt-False", False),
    ],
)
def test_layout_loads_what_fsdp2_saved(ranks, fsdp2_saved, name, source, flat):
    """FSDP2 on 4 ranks saved (nested, or torchtitan's flattened optimizer format); the
    layout loads it bitwise, each ep and PTD-P rank reading only what it holds, and takes
    the step one process takes."""
    root, saved = fsdp2_saved
    alone = F.one_process_load(source.split("-")[0], f"{root}/{source}", flat)
    _equal(saved[source], alone["loaded"], f"FSDP2 {source} -> one process")
    parts = ranks(WORLD[name], F.plait_load_all, [(name, source, flat)], root, timeout=300)
    mine = [part[f"{name}-{source}"] for part in parts]
    where = f"FSDP2 {source} (4 ranks) -> {name} on {len(parts)} ranks"
    _equal(saved[source], _merged([m["loaded"] for m in mine]), where)
    _close(alone["after"], _merged([m["after"] for m in mine]), f"{where}: next step")
    for r, got in enumerate(mine):
        if name != "cp":  # cp holds everything; the others only their part
            assert 0 < got["read"] < got["total"], (where, r, got["read"], got["total"])


def test_unmapped_layouts_are_refused_by_name(ranks):
    """2D tensor parallelism (Colossal-AI's layouts) and ZeRO-1 over a tensor-parallel
    weight stored transposed (GPT-2's Conv1D) have no DCP mapping yet: refused, naming
    the layer or parameter and what to use instead."""
    pytest.importorskip("transformers")
    got = ranks(4, F.refusals, timeout=120)[0]
    assert "2D/2.5D/3D tensor parallel" in got["2d"] and "plait.checkpoint.save" in got["2d"]
    text = got.get("conv1d_zero", "NOT REFUSED")
    assert "stored transposed" in text and "'transformer.h.0.attn.c_attn.weight'" in text, text
