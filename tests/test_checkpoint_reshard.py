"""Resharding: a checkpoint saved at world size 2 under one strategy loads at world size
1, 3 and 4 under another, with parameters and Adam state (exp_avg, exp_avg_sq, step)
bitwise equal to the saving run's dense state, the sampler continuing the same global order
(the samples read before and after the restart are exactly the epoch, none lost or twice),
the loss-scaler and LR-scheduler state restored, and each rank's RNG streams restored
(rank r < 2 continues saved rank r's; new ranks get derived streams: see
test_rng_streams_at_another_world_size). Loads read only the bytes each rank keeps.

The suite runs each saving strategy against each new world size under a rotating loading
strategy; ``PLAIT_RESHARD_FULL=1`` runs the whole cross product (slower)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.checkpoint import blocks, transaction
from plait.strategies import fsdp
from tests import checkpoint_fns, faultlog

# fully_shard models load through plait.strategies.fsdp's full-state API
HAVE_FSDP = all(
    hasattr(fsdp, name)
    for name in (
        "load_full_state_dict",
        "full_optimizer_state_dict",
        "load_full_optimizer_state_dict",
    )
)
SAVING = ["ddp", "zero1", "zero2"] + (["fsdp", "fsdp_units"] if HAVE_FSDP else [])
LOADING = ["ddp", "zero1", "zero2", "none"] + (["fsdp", "fsdp_units"] if HAVE_FSDP else [])
STEPS = 3
FULL = os.environ.get("PLAIT_RESHARD_FULL") == "1"


def _check_state(saved: dict[str, Any], got: dict[str, Any], where: str) -> None:
    assert saved["model"].keys() == got["model"].keys(), where
    for k, v in saved["model"].items():
        assert torch.equal(v, got["model"][k]), f"{where}: parameter {k}"
    assert saved["optimizer"].keys() == got["optimizer"].keys(), where
    for fqn, entry in saved["optimizer"].items():
        assert set(entry) == {"step", "exp_avg", "exp_avg_sq"}, entry.keys()
        for key, value in entry.items():
            assert torch.equal(value, got["optimizer"][fqn][key]), f"{where}: {fqn} {key}"
    assert got["lr"] == saved["lr"] == 0.005, where  # StepLR halved it after step 2
    assert got["scaler"] == saved["scaler"], where
    assert got["scheduler"] == saved["scheduler"], where
    assert got["loss_finite"], where


def _targets(world: int) -> list[str]:
    names = LOADING if world == 1 else [s for s in LOADING if s != "none"]
    return names


def test_reshard_matrix(ranks, tmp_path: Path):
    roots = {s: str(tmp_path / s) for s in SAVING}
    saved_by_rank = ranks(2, checkpoint_fns.train_and_save, [(s, roots[s]) for s in SAVING], STEPS)
    saved = dict(zip(SAVING, saved_by_rank[0], strict=True))
    for i, s in enumerate(SAVING):  # every rank reports the same dense state
        other = saved_by_rank[1][i]
        for k, v in saved[s]["model"].items():
            assert torch.equal(v, other["model"][k])
        assert saved[s]["scaler"]["clean_steps"] == STEPS and saved[s]["scaler"]["scale"] == 2.0**11
    consumed_before = {
        s: [i for rank_reports in saved_by_rank for i in rank_reports[SAVING.index(s)]["consumed"]]
        for s in SAVING
    }
    checked, load_s = 0, []
    for j, world in enumerate((1, 3, 4, 2)):
        targets = _targets(world)
        cases = []
        for i, s in enumerate(SAVING):
            chosen = targets if FULL else [targets[(i + j) % len(targets)]]
            cases += [(s, t) for t in chosen]
        results = ranks(world, checkpoint_fns.load_and_report, [(t, roots[s]) for s, t in cases])
        for c, (s, t) in enumerate(cases):
            where = f"saved by {s} at ws=2, loaded by {t} at ws={world}"
            for r in range(world):
                got = results[r][c]
                load_s.append(got["load_s"])
                _check_state(saved[s], got, where)
                assert got["step"] == STEPS and got["extra"] == {"strategy": s}
                assert got["rng_restored"], where
                if r < 2:  # rank r continues saved rank r's generator
                    assert got["rng_source"] == "saved", where
                    assert torch.equal(got["rng"], saved_by_rank[r][SAVING.index(s)]["rng"])
                else:  # a new rank: derived streams, not a copy of a saved one
                    assert got["rng_source"] == "derived", where
                    assert not any(
                        torch.equal(got["rng"], saved_by_rank[q][SAVING.index(s)]["rng"])
                        for q in range(2)
                    )
            after = [i for r in range(world) for i in results[r][c]["after"]]
            union = sorted(consumed_before[s] + after)
            assert union == list(range(checkpoint_fns.N_SAMPLES)), where
            checked += 1
    faultlog.record(
        row=11,
        fault=f"restart at another world size and strategy ({checked} cells: ws 2 -> 1/3/4/2)",
        detected_after_s=None,
        named_correctly=None,
        recovered_after_s=round(max(load_s), 3),  # the slowest checkpoint.load call
        state_equal=True,
    )


@pytest.mark.parametrize("strategy", ["ddp", "zero2"] + (["fsdp_units"] if HAVE_FSDP else []))
def test_resume_at_the_same_world_size_is_bit_exact(ranks, tmp_path: Path, strategy: str):
    """Row 12: train 6 steps straight vs 3 + save + load into a fresh setup + 3: the same
    samples in the same order, the same final parameters and optimizer state."""
    results = ranks(
        2, checkpoint_fns.uninterrupted_vs_resumed, strategy, str(tmp_path / "run"), 3, 6
    )
    for got in results:
        assert got["straight_ids"] == got["resumed_ids"]
        a, b = got["straight"], got["resumed"]
        for k in a["model"]:
            assert torch.equal(a["model"][k], b["model"][k]), k
        for fqn in a["optimizer"]:
            for key in a["optimizer"][fqn]:
                assert torch.equal(a["optimizer"][fqn][key], b["optimizer"][fqn][key])
        assert a["scaler"] == b["scaler"] and a["sampler"] == b["sampler"]
        assert a["scheduler"] == b["scheduler"] and a["lr"] == b["lr"]
    faultlog.record(
        row=12,
        fault=f"resume mid-epoch from a checkpoint ({strategy}, ws=2; no kill)",
        detected_after_s=None,
        named_correctly=None,
        state_equal=True,
    )


def test_param_groups_survive_resharding(ranks, tmp_path: Path):
    """A ZeRO-1 optimizer with two param groups (own lr and weight decay) saved at ws=2
    loads into a plain optimizer at ws=1 and into ZeRO-2 at ws=3: the same groups, hyper-
    parameters and state."""
    root = str(tmp_path / "groups")
    saved = ranks(2, checkpoint_fns.save_param_groups, "zero1", root)[0]
    assert saved["groups"] == [(0.01, 0.0, 2), (0.02, 0.1, 2)]
    for world, strategy in ((1, "none"), (3, "zero2")):
        for got in ranks(world, checkpoint_fns.load_param_groups, strategy, root):
            assert got["groups"] == saved["groups"] and got["names"] == saved["names"]
            for k, v in saved["model"].items():
                assert torch.equal(v, got["model"][k]), k
            for fqn, entry in saved["optimizer"].items():
                for key, value in entry.items():
                    assert torch.equal(value, got["optimizer"][fqn][key]), (fqn, key)


# --- each rank reads only what it keeps ------------------------------------------------------
def _same_state(saved: dict[str, Any], got: dict[str, Any], where: str) -> None:
    assert "error" not in got, (where, got)
    assert saved["model"].keys() == got["model"].keys(), where
    for k, v in saved["model"].items():
        assert torch.equal(v, got["model"][k]), f"{where}: parameter {k}"
    assert saved["optimizer"].keys() == got["optimizer"].keys(), where
    for fqn, entry in saved["optimizer"].items():
        for key, value in entry.items():
            assert torch.equal(value, got["optimizer"][fqn][key]), f"{where}: {fqn} {key}"


def _sizes(directory: Path) -> tuple[int, int, int]:
    """(manifest bytes, header bytes of all files, tensor data bytes of all files)."""
    manifest = json.loads((directory / transaction.MANIFEST).read_text())
    headers = sum(e["header_bytes"] for e in manifest["files"].values())
    data = sum(e["bytes"] - e["header_bytes"] for e in manifest["files"].values())
    return (directory / transaction.MANIFEST).stat().st_size, headers, data


@pytest.mark.skipif(not HAVE_FSDP, reason="needs plait.strategies.fsdp's full-state API")
def test_each_rank_reads_only_the_bytes_it_keeps(ranks, tmp_path: Path):
    """Saved at W=4 by ZeRO-1 and FSDP; loaded at W'=2 and 4: under ZeRO-1 and FSDP each
    rank reads about 1/W' of the tensor bytes (plus the manifest and headers), under DDP
    (and with whole_files=True) all of them; every load is bitwise equal to the saved
    state."""
    roots = {s: str(tmp_path / s) for s in ("zero1", "fsdp")}
    saved_by_rank = ranks(
        4, checkpoint_fns.save_wide, [(s, roots[s]) for s in roots], [1], timeout=120
    )
    saved = {s: saved_by_rank[0][i][1] for i, s in enumerate(roots)}
    sizes = {s: _sizes(Path(root) / "step-1") for s, root in roots.items()}
    cases = [("zero1", "zero1"), ("fsdp", "fsdp"), ("zero1", "ddp")]
    for world in (2, 4):
        results = ranks(
            world, checkpoint_fns.load_wide, [(t, roots[s]) for s, t in cases], timeout=120
        )
        for c, (s, t) in enumerate(cases):
            for r in range(world):
                got = results[r][c]
                where = f"saved by {s} at 4, loaded by {t} at {world}, rank {r}"
                _same_state(saved[s], got, where)
                manifest_bytes, header_bytes, data_bytes = sizes[s]
                read = got["bytes_read"] - manifest_bytes - header_bytes  # tensor bytes
                assert got["checkpoint_bytes"] == manifest_bytes + header_bytes + data_bytes
                if t == "ddp":
                    assert read >= 0.99 * data_bytes, (where, read, data_bytes)
                else:  # 1/W' of the data, give or take the 4 KiB blocks around each slice
                    assert 0.95 < read / (data_bytes / world) < 1.15, (where, read, data_bytes)
    whole = ranks(2, checkpoint_fns.load_wide, [("fsdp", roots["fsdp"])], whole_files=True)
    for r, (got,) in enumerate(whole):
        _same_state(saved["fsdp"], got, f"whole_files=True, rank {r}")
        assert got["bytes_read"] == got["checkpoint_bytes"]


@pytest.mark.faults
@pytest.mark.skipif(not HAVE_FSDP, reason="needs plait.strategies.fsdp's full-state API")
def test_a_flipped_bit_is_named_by_the_rank_reading_its_block_then_fallback(ranks, tmp_path):
    """One bit flipped inside model/2.weight of the latest checkpoint (W=4, FSDP, 4 KiB
    blocks): the rank whose slice holds it names file, writer, tensor and block; every rank
    refuses the checkpoint, and with fallback=True every rank loads the previous one."""
    root = tmp_path / "run"
    saved = ranks(4, checkpoint_fns.save_wide, [("fsdp", str(root))], [1, 2], timeout=120)[0][0]
    directory = root / "step-2"
    manifest = json.loads((directory / transaction.MANIFEST).read_text())
    key = "model/2.weight"
    victim = directory / manifest["tensors"][key]
    data = bytearray(victim.read_bytes())
    start, header = blocks.split_header(data)
    element = 39321  # 60% into the weight: rank 2's slice of the unit (65792 / 4 each)
    offset = 8 + start + header[key]["data_offsets"][0] + 4 * element
    data[offset] ^= 0x10
    victim.write_bytes(bytes(data))
    block = 4 * element // checkpoint_fns.SMALL_BLOCK
    refused = ranks(4, checkpoint_fns.load_wide, [("fsdp", str(root))], timeout=120)
    for (got,) in refused:
        message = got["error"]
        assert (
            str(victim) in message
            and f"written by rank {manifest['files'][victim.name]['rank']}" in message
        )
        assert f"tensor {key!r} block {block}" in message and "read by rank 2" in message
        assert "read by rank 0" not in message and "fallback=True" in message
    back = ranks(4, checkpoint_fns.load_wide, [("fsdp", str(root))], fallback=True, timeout=120)
    for r, (got,) in enumerate(back):
        assert got["step"] == 1
        _same_state(saved[1], got, f"fallback, rank {r}")


# --- random streams at another world size ----------------------------------------------------
def test_rng_streams_at_another_world_size(ranks, tmp_path: Path):
    """W=4 -> W'=2: rank r draws what saved rank r would have drawn next. W=2 -> W'=4:
    ranks 0 and 1 likewise; ranks 2 and 3 get derived streams: two resumes draw the same
    numbers, and every rank draws different numbers."""
    four, two = str(tmp_path / "w4"), str(tmp_path / "w2")
    saved4 = [r[0][1] for r in ranks(4, checkpoint_fns.save_wide, [("ddp", four)], [1])]
    saved2 = [r[0][1] for r in ranks(2, checkpoint_fns.save_wide, [("ddp", two)], [1])]
    for r, (got,) in enumerate(ranks(2, checkpoint_fns.load_wide, [("ddp", four)])):
        assert got["rng_source"] == "saved"
        assert torch.equal(got["draws"]["torch"], saved4[r]["draws"]["torch"])
        assert got["draws"]["python"] == saved4[r]["draws"]["python"]
    results = ranks(4, checkpoint_fns.load_wide, [("ddp", two), ("zero1", two)], timeout=120)
    for r, (first, second) in enumerate(results):
        assert first["rng_source"] == second["rng_source"] == ("saved" if r < 2 else "derived")
        assert torch.equal(first["draws"]["torch"], second["draws"]["torch"])  # two resumes
        assert first["draws"]["python"] == second["draws"]["python"]
        if r < 2:
            assert torch.equal(first["draws"]["torch"], saved2[r]["draws"]["torch"])
            assert first["draws"]["python"] == saved2[r]["draws"]["python"]
    torch_draws = [got[0]["draws"]["torch"] for got in results]
    python_draws = [got[0]["draws"]["python"] for got in results]
    for a in range(4):
        for b in range(a):
            assert not torch.equal(torch_draws[a], torch_draws[b]), (a, b)
            assert python_draws[a] != python_draws[b], (a, b)
