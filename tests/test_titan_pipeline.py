"""A torchtitan-shaped Llama 3 handed whole to the pipeline (pp 2, 1F1B) and to PTD-P
(pp 2 x tp 2) through its family's pipeline plan (``plait/models/torchtitan_llama.py``:
the complex rotary table read by every stage, torchtitan's loss on pre-shifted labels,
ignored labels spread unevenly) equals one process on the global batch: float64, 3 AdamW
steps with two parameter groups, clipping active, 1e-8. Context parallelism too: cp 2
(strategy='cp') and pp 2 x cp 2 (PTD-P, ring and Ulysses)."""

from __future__ import annotations

import pytest
import torch

from tests import titan_pipeline_fns as fns

TOL = {"rtol": 1e-8, "atol": 1e-8}


@pytest.mark.parametrize(
    ("world", "mesh", "strategy"),
    [(2, {"pp": 2}, "pipeline"), (4, {"pp": 2, "dp": 1, "tp": 2}, "ptdp")],
    ids=["pp2", "pp2xtp2"],
)
def test_torchtitan_shape_under_pipeline_and_ptdp(ranks, world, mesh, strategy):
    want = fns.oracle()
    assert min(want["norms"]) > fns.MAX_NORM  # clipping acts on every step
    for res in ranks(world, fns.train, mesh, strategy, timeout=180):
        torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(want["norms"]), **TOL)
        assert set(res["state"]) == set(want["state"])
        for key, value in want["state"].items():
            torch.testing.assert_close(
                res["state"][key], value, **TOL, msg=lambda m, k=key: f"{k}: {m}"
            )


@pytest.mark.parametrize(
    ("world", "mesh", "strategy", "context"),
    [
        (2, {"cp": 2}, "cp", "ring"),
        (4, {"pp": 2, "dp": 1, "tp": 1, "cp": 2}, "ptdp", "ring"),
        (4, {"pp": 2, "dp": 1, "tp": 1, "cp": 2}, "ptdp", "ulysses"),
    ],
    ids=["cp2-ring", "pp2xcp2-ring", "pp2xcp2-ulysses"],
)
def test_torchtitan_shape_under_context_parallelism(ranks, world, mesh, strategy, context):
    """Context parallelism on the same model: with strategy='cp' the rotary table holds the
    rank's rows around each forward; inside PTD-P every stage's context reads the rank's
    global position_ids (the loader's labels need no shift)."""
    want = fns.oracle()
    for res in ranks(world, fns.train_cp if strategy == "cp" else fns.train,
                     *(() if strategy == "cp" else (mesh, strategy)), context,
                     timeout=180):  # fmt: skip
        if strategy == "cp":
            assert res["tokens"] == [4] * fns.STEPS  # each rank ran half of every sequence
        torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(want["norms"]), **TOL)
        for key, value in want["state"].items():
            torch.testing.assert_close(
                res["state"][key], value, **TOL, msg=lambda m, k=key: f"{k}: {m}"
            )
