"""Resharding: a checkpoint saved at world size 2 under one strategy loads at world size
1, 3 and 4 under another, with parameters and Adam state (exp_avg, exp_avg_sq, step)
bitwise equal to the saving run's dense state, the sampler continuing the same global order
(the samples read before and after the restart are exactly the epoch, none lost or twice),
the loss-scaler and LR-scheduler state restored, and each rank's RNG streams restored
(rank r < 2 continues saved rank r's; new ranks get derived streams, see test_checkpoint_rng).

The suite runs each saving strategy against each new world size under a rotating loading
strategy; ``PLAIT_RESHARD_FULL=1`` runs the whole cross product (slower)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

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
