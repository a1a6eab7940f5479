"""Hugging Face MoE models (Mixtral, Qwen2-MoE with a shared expert and a dense layer,
Qwen3-MoE with q/k norms) handed whole to the model-parallel strategies, against one
process on the global batch: pipeline (1F1B, ZB-H1, interleaved; pp 2 and 4), tensor
parallelism with and without sequence parallelism, PTD-P (pp x tp, dp x tp with sequence
parallelism, pp x dp with accumulation, pp x dp with ZeRO-1). The families' load-balancing
loss is on in most runs (``+aux``): under tensor parallelism with sequence parallelism its
router logits are gathered over the sequence; under the pipeline and PTD-P a statistics
pass sums the routers' counts over the batch first. Each run: float64, 3 AdamW steps with
two parameter groups, 2 accumulation micro-steps where the rank functions do, clipping
active. The refusals name what to change.

Tolerance 1e-8 in float64 (observed ~1e-15); the pipeline's and PTD-P's losses are Hugging
Face's float32 loss values, compared at 1e-6 as in tests/test_hf_pipeline.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from tests import hf_moe_layouts_fns as fns  # noqa: E402
from tests import hf_pipeline_fns as pipe_fns  # noqa: E402
from tests import hf_ptdp_fns as ptdp_fns  # noqa: E402
from tests import hf_tp_fns as tp_fns  # noqa: E402
from tests.test_hf_tp import _same  # noqa: E402

TOL = {"rtol": 1e-8, "atol": 1e-8}
SPARSE = {  # the parameter of a sparse block's experts, and of an attention projection
    "mixtral": "model.layers.0.mlp.experts.gate_up_proj",
    "qwen2_moe": "model.layers.0.mlp.experts.gate_up_proj",
    "qwen3_moe": "model.layers.1.mlp.experts.down_proj",
}
SPARSE |= {f"{k}+aux": v for k, v in SPARSE.items()}


@functools.cache
def pipeline_oracle(family: str) -> dict:
    return pipe_fns.oracle(family, False)


@pytest.mark.parametrize(
    ("family", "schedule", "pp", "m"),
    [
        ("mixtral", "1f1b", 2, 2),
        ("mixtral+aux", "1f1b", 2, 2),
        ("mixtral+aux", "interleaved", 2, 4),
        ("qwen2_moe+aux", "zb-h1", 2, 2),
        ("qwen3_moe+aux", "1f1b", 4, 4),
    ],
)
def test_pipeline_matches_one_process(ranks, family, schedule, pp, m):
    want = pipeline_oracle(family)
    state: dict[str, torch.Tensor] = {}
    for res in ranks(pp, pipe_fns.train, family, False, schedule, m, timeout=180):
        torch.testing.assert_close(
            torch.tensor(res["losses"]), torch.tensor(want["losses"]), rtol=1e-6, atol=1e-6
        )
        torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(want["norms"]), **TOL)
        assert min(res["norms"]) > pipe_fns.MAX_NORM
        state |= res["state"]
    assert set(state) == set(want["state"])
    for key, value in want["state"].items():
        torch.testing.assert_close(state[key], value, **TOL, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize(
    ("family", "sequence_parallel"),
    [
        ("mixtral", False),
        ("qwen2_moe", False),
        ("qwen3_moe", False),
        ("mixtral", True),
        ("qwen2_moe", True),
    ],
)
def test_tensor_parallel_matches_one_process(ranks, family, sequence_parallel):
    """Attention (and Qwen2-MoE's dense layer) split, each sparse block whole on both ranks;
    the load-balancing loss on (under sequence parallelism its router logits gathered)."""
    want = tp_fns.oracle(family=family, tied=False)
    results = ranks(
        2, tp_fns.train, family=family, tied=False, sequence_parallel=sequence_parallel,
        timeout=180,
    )  # fmt: skip
    for res in results:
        _same(res, want)
        assert res["sequence_parallel"] == sequence_parallel
        local, dense = res["local_numel"], res["dense_numel"]
        assert local[SPARSE[family]] == dense[SPARSE[family]]  # the experts whole
        q = "model.layers.0.self_attn.q_proj.weight"
        assert 2 * local[q] == dense[q]  # the attention split
        if family == "qwen2_moe":  # layer 1 is dense: its MLP split as Llama's
            up = "model.layers.1.mlp.up_proj.weight"
            assert 2 * local[up] == dense[up]


PTDP_CASES = [
    ptdp_fns.Case(family="mixtral"),
    # the model's own experts split over ep inside PTD-P (carved out of data parallelism)
    ptdp_fns.Case(family="mixtral+aux", pp=2, dp=1, tp=1, ep=2, accumulate=2),
    ptdp_fns.Case(family="qwen2_moe+aux", pp=1, dp=1, tp=2, ep=2),
    # every stage reruns its forward (its routers, the all-to-alls, the loss's shares)
    ptdp_fns.Case(family="mixtral+aux", pp=2, dp=1, tp=1, ep=2, recompute=True),
    ptdp_fns.Case(family="mixtral+aux", pp=1, dp=2, tp=2, sequence_parallel=True),
    ptdp_fns.Case(family="qwen2_moe", schedule="zb-h1", accumulate=2),
    ptdp_fns.Case(family="qwen2_moe+aux", pp=2, dp=2, tp=1, accumulate=2),
    ptdp_fns.Case(family="qwen3_moe+aux", pp=2, dp=2, tp=1, zero=1),
    # context parallelism: the routers' statistics summed over the cp ranks' chunks too
    ptdp_fns.Case(family="mixtral+aux", pp=2, dp=1, tp=1, cp=2),
    ptdp_fns.Case(family="qwen2_moe+aux", pp=2, dp=1, tp=1, cp=2, context="ulysses"),
    # experts split over ep beside cp: their gradients averaged over dp x cp
    ptdp_fns.Case(family="mixtral+aux", pp=1, dp=1, tp=1, ep=2, cp=2),
    ptdp_fns.Case(family="qwen3_moe+aux", pp=2, dp=1, tp=1, ep=2, cp=2),
]


@pytest.mark.parametrize("case", PTDP_CASES, ids=lambda c: c.name)
def test_ptdp_matches_one_process(ranks, case):
    want = ptdp_fns.oracle(case)
    for res in ranks(case.world, ptdp_fns.train, case, timeout=240):
        torch.testing.assert_close(
            torch.tensor(res["losses"]), torch.tensor(want["losses"]), rtol=1e-6, atol=1e-6
        )
        torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(want["norms"]), **TOL)
        assert min(res["norms"]) > ptdp_fns.MAX_NORM
        assert set(res["state"]) == set(want["state"])
        for key, value in want["state"].items():
            torch.testing.assert_close(
                res["state"][key], value, **TOL, msg=lambda m, k=key: f"{k}: {m}"
            )
        # the dense optimizer state assembled from the layout (stacked experts gathered
        # over ep) equals one process's
        assert res["refused"] is None, res["refused"]
        for i, stats in want["optimizer"]["state"].items():
            for stat, value in stats.items():
                torch.testing.assert_close(
                    res["optimizer"]["state"][i][stat], value, **TOL,
                    msg=lambda m, i=i, s=stat: f"optimizer {i} {s}: {m}",
                )  # fmt: skip


def test_ptdp_checkpoint_with_experts_split_over_ep_loads_into_another_layout(ranks, tmp_path):
    """A Mixtral saved from pp2 x ep2 (each rank two of the four experts of its stage's
    layers, stacked) loads into pp2 x tp2 (experts whole, attention split) bitwise."""
    out = ranks(
        4, ptdp_fns.save_then_load, str(tmp_path / "ckpt"), "mixtral+aux",
        {"pp": 2, "dp": 1, "tp": 1, "ep": 2}, {"pp": 2, "dp": 1, "tp": 2}, timeout=300,
    )  # fmt: skip
    for rank, got in enumerate(out):
        assert got["keys"] and got["optimizer entries"] > 0, (rank, got)
        assert got["diff"] == 0.0, (rank, got)


def test_refusals_name_what_to_change(ranks):
    for res in ranks(2, fns.refusals, timeout=120):
        assert "router jitter noise" in res["jitter_pipeline"]
        assert "router_jitter_noise=0" in res["jitter_pipeline"]
        assert "model.layers.0.mlp" in res["jitter_pipeline"]
        # set after wrapping: the two forwards routed differently, named on every rank
        assert "RuntimeError" in res["jitter_after_wrap"]
        assert "load-balancing loss" in res["jitter_after_wrap"]
        assert "[0, 1]" in res["jitter_after_wrap"]
        assert "not deterministic" in res["jitter_after_wrap"]
        assert "ep=2" in res["ep_in_ptdp"] and "sequence parallelism" in res["ep_in_ptdp"]
        assert "jitter" in res["jitter_tp"] and "router_jitter_noise=0" in res["jitter_tp"]
        assert "model.layers.0.mlp" in res["jitter_tp"]
