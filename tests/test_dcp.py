"""torch.distributed.checkpoint (DCP) both ways: a plait layout saves with ``dcp.save`` what
PyTorch's FSDP2 loads at another world size and one process loads with ``no_dist=True``;
a directory FSDP2 saved (nested, and in torchtitan's flattened optimizer format) loads into
plait layouts. Float64: parameters and Adam/AdamW state bitwise equal to what was saved,
then one more step equal to one process's step on the global batch (to 1e-12: the ranks'
gradient sums run in another order)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from plait import checkpoint
from plait.strategies.dcp_chunks import ShardChunks, flat_range_chunks
from tests import dcp_fns as F

STEPS = 2
CLOSE = {"rtol": 0.0, "atol": 1e-12}


def _equal(want: dict[str, Any], got: dict[str, Any], where: str) -> None:
    """Parameters and optimizer state bitwise equal (keys as the one-process model's)."""
    assert want["model"].keys() == got["model"].keys(), where
    for k, v in want["model"].items():
        assert v.dtype == torch.float64 and torch.equal(v, got["model"][k]), f"{where}: {k}"
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
    for k, v in want["model"].items():
        torch.testing.assert_close(got["model"][k], v, **CLOSE, msg=f"{where}: {k}")
    if got["optimizer"] is None:  # tensor parallel after its step: the parameters say it
        return
    for fqn, entry in want["optimizer"].items():
        for key, value in entry.items():
            torch.testing.assert_close(
                torch.as_tensor(got["optimizer"][fqn][key]),
                torch.as_tensor(value),
                **CLOSE,
                msg=f"{where}: {fqn} {key}",
            )


def test_flat_range_chunks_cover_the_range_exactly():
    for shape in [(3, 4), (2, 3, 5), (7,), (1, 1, 6), ()]:
        total = int(torch.tensor(shape).prod()) if shape else 1
        index = torch.arange(total).reshape(shape)
        for start in range(total + 1):
            for stop in range(start, total + 1):
                chunks = flat_range_chunks(shape, start, stop)
                seen = []
                for c in chunks:
                    block = index[
                        tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))
                    ]
                    assert block.reshape(-1).tolist() == list(range(c.start, c.stop))
                    seen += block.reshape(-1).tolist()
                assert seen == list(range(start, stop)), (shape, start, stop)
                assert len(chunks) <= max(2 * len(shape) - 1, 1)


def test_shard_chunks_refuse_computation_by_name():
    t = torch.arange(12.0)
    pieces = [t[2:4].view(1, 2), t[4:6].view(1, 2)]
    s = ShardChunks((3, 4), flat_range_chunks((3, 4), 2, 6), pieces, dtype=t.dtype, device=t.device)
    assert "ShardChunks(shape=(3, 4)" in repr(s)
    with pytest.raises(RuntimeError, match="only this rank's pieces"):
        s + 1


# plait layouts (2 ranks) saving, with the optimizer each uses
SAVING = [
    ("fsdp", "adam"),
    ("fsdp_units", "adamw"),
    ("ddp", "adamw"),
    ("zero2", "adam"),
    ("tp", "adamw"),
]
# FSDP2 (4 ranks) saving: the optimizer, and torchtitan's flattened optimizer format or not
SAVED_BY_FSDP2 = [("adamw", True), ("adam", False)]
# plait layouts (2 ranks) loading those
LOADING = [
    ("fsdp", "adamw", True),
    ("fsdp_units", "adam", False),
    ("ddp", "adamw", True),
    ("zero1", "adamw", True),
    ("zero2", "adam", False),
    ("tp", "adam", False),
]


def test_plait_saves_what_fsdp2_and_one_process_load(ranks, tmp_path):
    """Each plait layout on 2 ranks saves; one process (no_dist) and FSDP2 on 4 ranks load
    it bitwise; their next step equals one process's."""
    root = str(tmp_path)
    saved = ranks(2, F.plait_save_all, SAVING, root, STEPS, timeout=300)[0]
    loaded = ranks(4, F.fsdp2_load_all, SAVING, root, STEPS, timeout=300)
    for strategy, opt in SAVING:
        case = f"{strategy}-{opt}"
        alone = F.one_process_load(f"{root}/{case}", STEPS, opt, False)  # no_dist=True
        want = saved[case]
        if want["optimizer"] is None:  # tensor parallel: the saved state is one process's
            _close(F.oracle(STEPS, opt), alone["loaded"], f"{case}: the saved state")
            want["optimizer"] = alone["loaded"]["optimizer"]
        _equal(want, alone["loaded"], f"{case} (2 ranks) -> one process")
        for r, got in enumerate(loaded):
            _equal(want, got[case]["loaded"], f"{case} (2 ranks) -> FSDP2 rank {r} of 4")
            _close(alone["after"], got[case]["after"], f"{case} -> FSDP2 rank {r}: next step")


def test_fsdp2_saves_what_plait_loads(ranks, tmp_path):
    """FSDP2 on 4 ranks saves (nested, and torchtitan's flattened optimizer format); each
    plait layout on 2 ranks loads it bitwise, each FSDP/ZeRO/TP rank reading only the
    stored chunks it needs; the next step equals one process's."""
    root = str(tmp_path)
    saved = ranks(4, F.fsdp2_save_all, SAVED_BY_FSDP2, root, STEPS, timeout=300)[0]
    loaded = ranks(2, F.plait_load_all, LOADING, root, STEPS, timeout=300)
    for strategy, opt, flatten in LOADING:
        source = f"{opt}-{flatten}"
        alone = F.one_process_load(f"{root}/{source}", STEPS, opt, flatten)
        _equal(saved[source], alone["loaded"], f"FSDP2 {source} -> one process")
        for r, part in enumerate(loaded):
            got = part[f"{strategy}-{source}"]
            where = f"FSDP2 {source} (4 ranks) -> {strategy} rank {r} of 2"
            if got["loaded"]["optimizer"] is None:  # tensor parallel: checked by the next step
                got["loaded"]["optimizer"] = saved[source]["optimizer"]
            _equal(saved[source], got["loaded"], where)
            _close(alone["after"], got["after"], f"{where}: the next step")
            if strategy == "ddp":
                assert got["read"] == got["total"], where
            else:
                assert 0 < got["read"] < got["total"], (where, got["read"], got["total"])


def test_verify_checks_a_dcp_directory(tmp_path):
    """``plait.checkpoint.verify`` on a DCP directory: complete, then a lost chunk in the
    metadata, a truncated file and a missing file are each named."""
    d = tmp_path / "dcp"
    dcp.save({"model": F.make_net(0).state_dict()}, checkpoint_id=str(d), no_dist=True)
    assert checkpoint.verify(d) == []

    meta = d / ".metadata"
    original = meta.read_bytes()
    md = FileSystemReader(str(d)).read_metadata()
    md.state_dict_metadata["model.fc1.weight"].chunks.pop()
    with open(meta, "wb") as f:
        pickle.dump(md, f)
    problems = checkpoint.verify(d)
    assert any("'model.fc1.weight'" in p and "0 of its 60 elements" in p for p in problems)
    meta.write_bytes(original)

    (file,) = d.glob("*.distcp")
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    assert any("truncated" in p and file.name in p for p in checkpoint.verify(d))
    file.unlink()
    assert any("missing" in p and file.name in p for p in checkpoint.verify(d))


def _merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole model and optimizer state from each pipeline rank's stages."""
    out: dict[str, Any] = {"model": {}, "optimizer": {}, "lr": parts[0]["lr"]}
    for part in parts:
        out["model"].update(part["model"])
        out["optimizer"].update(part["optimizer"])
    return out


@pytest.mark.parametrize("flatten", [True, False])
def test_pipeline_saves_and_loads_dcp(ranks, tmp_path, flatten):
    """A 2-stage pipeline saves what one process loads (no_dist) bitwise; a directory one
    process saved loads into the pipeline's stages bitwise and the next step equals one
    process's. In torchtitan's flattened optimizer format and in the nested one (whose
    param_groups then list both stages' parameters)."""
    d = str(tmp_path / "from_pipeline")
    saved = _merge(ranks(2, F.pipeline_save, d, STEPS, flatten, timeout=180))
    alone = F.one_process_seq(d, STEPS, save=False, flatten=flatten)
    _equal(saved, alone["loaded"], "pipeline (2 stages) -> one process")

    d = str(tmp_path / "from_one_process")
    want = F.one_process_seq(d, STEPS, save=True, flatten=flatten)["loaded"]
    got = ranks(2, F.pipeline_load, d, STEPS, flatten, timeout=180)
    _equal(want, _merge([g["loaded"] for g in got]), "one process -> pipeline (2 stages)")
    oracle = F.one_process_seq(d, STEPS, save=False, flatten=flatten)["after"]
    _close(oracle, _merge([g["after"] for g in got]), "pipeline: the step after loading")
