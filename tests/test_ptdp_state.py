"""PTD-P with loss scaling and checkpoints, against one process.

Loss scaling: plait.amp's DynamicLossScaler through ``compose(..., scaler=)``. With
nothing overflowing the run equals the unscaled one-process run (1e-8, float64); an inf
injected into one gradient on one rank makes every rank skip that step and halve the
scale, and the run then equals one process that skipped the same step.

Checkpoints: a layout saved through plait.checkpoint loads into another layout and into
one process (plain GPT + Adam through plait.checkpoint.load) with the dense parameters
and Adam state bitwise equal; one more step after the load matches across them.
"""

from __future__ import annotations

import math

import pytest
import torch

from . import ptdp_fns as fns
from .ptdp_fns import Case

TOL = 1e-8

SCALED = [
    (Case(tp=2, pp=2, clip=0.05), (3, 1)),  # inf on rank 3 (pp 1, tp 1) at step 1
    (Case(dp=2, tp=2, zero=1), None),
    (Case(dp=2, ep=2, moe=1.0, microbatches=1), (2, 1)),  # MoE: auxiliary losses scaled too
]


@pytest.mark.parametrize(("case", "inject"), SCALED, ids=lambda v: getattr(v, "name", str(v)))
def test_loss_scaling_skips_together_and_matches_one_process(ranks, case, inject):
    skip = None if inject is None else inject[1]
    want = fns.oracle_skipping(case, skip)
    results = ranks(4, fns.train_scaled, case, inject, timeout=120)
    stepped = [s != skip for s in range(fns.STEPS)]
    for rank, got in enumerate(results):
        assert got["stepped"] == stepped, f"rank {rank} stepped {got['stepped']}"
        halvings = [sum(not s for s in stepped[: i + 1]) for i in range(fns.STEPS)]
        assert got["scales"] == [2.0**10 / 2**h for h in halvings], f"rank {rank}"
        assert got["losses"] == pytest.approx(want["losses"], abs=TOL), f"rank {rank} losses"
        for a, b in zip(got["norms"], want["norms"], strict=True):
            assert (math.isnan(b) and not math.isfinite(a)) or abs(a - b) < TOL, (a, b)
        for key, value in want["state"].items():
            diff = (got["state"][key] - value).abs().max().item()
            assert diff < TOL, f"rank {rank} {case.name}: {key} differs by {diff}"


def _same_state(a: dict, b: dict, where: str) -> None:
    assert list(a["model"]) == list(b["model"]), where
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"{where}: model {k}"
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sorted(sa) == sorted(sb) and sa, where
    for i in sa:
        for stat in sa[i]:
            assert torch.equal(sa[i][stat], sb[i][stat]), f"{where}: optimizer {i} {stat}"


@pytest.mark.parametrize(
    ("source", "target"),
    [
        (Case(tp=2, pp=2), Case(dp=2, tp=2)),
        (Case(dp=2, ep=2, moe=4.0, microbatches=1), Case(tp=2, pp=2, moe=4.0)),
    ],
    ids=lambda c: c.name,
)
def test_checkpoint_of_one_layout_loads_into_another_and_one_process(
    ranks, tmp_path, source, target
):
    root = str(tmp_path / "ckpt")
    saved = ranks(4, fns.train_and_save, source, root, timeout=120)
    loaded = ranks(4, fns.load_into, target, root, timeout=120)
    single = ranks(1, fns.load_one_process, source.tied, source.moe, root, timeout=120)[0]
    _same_state(saved[0], single, "one process")
    for rank, got in enumerate(loaded):
        _same_state(saved[0], got, f"{target.name} rank {rank}")
        for k, v in single["next"].items():
            diff = (got["next"][k] - v).abs().max().item()
            assert diff < TOL, f"rank {rank}: after one more step {k} differs by {diff}"
