"""PTD-P on Hugging Face models handed over whole: ``plait.prepare(model, opt,
strategy="ptdp", mesh=Mesh(pp=2, tp=2))`` (and ``compose(..., plans=plan_for)``) cut the
model's layers into stages by its pipeline plan and split each stage by its
tensor-parallel plan; nothing in compose knows the model.

Against one process on the global batch, float64, 3 AdamW steps with two parameter groups
(per-group lr and weight decay kept), clipping active on every step, 2 micro-batches, the
model's own ``labels=`` loss with ignored labels spread unevenly (over micro-batches and
over dp ranks): a Llama with grouped-query attention (4 heads, 2 key/value heads, tp 2)
untied under 1F1B with 2 accumulation steps, tied under the zero-bubble ZB-H1, on dp2 x tp2
with ZeRO-1 over dp; a GPT-2 (tied, fused ``c_attn``) under 1F1B. Also: the dense optimizer
state assembled from the layout equals one process's (Llama, and GPT-2, whose transposed
and fused projections' shards are not slices of the dense tensors: assembled through an
index map); a Llama checkpoint saved from pp2 x tp2 loads into dp2 x tp2 bitwise, and a
GPT-2 one from pp2 x tp2 into pp1 x tp2 x dp2.

Tolerances: parameters, gradient norms and optimizer statistics at 1e-8 (float64; the
ranks sum partial products in another order). Losses at 1e-6: Hugging Face's causal-LM
loss upcasts logits to float32, so its value is float32 (see tests/test_hf_pipeline.py).
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from plait.models.plans import plan_for  # noqa: E402
from plait.strategies.compose import check_layout  # noqa: E402
from tests import hf_ptdp_fns as fns  # noqa: E402
from tests.hf_ptdp_fns import Case  # noqa: E402

TOL = {"rtol": 1e-8, "atol": 1e-8}

CASES = [
    Case("llama", accumulate=2),
    Case("llama", tied=True, schedule="zb-h1", via_compose=True),
    Case("llama", pp=1, dp=2, tp=2, zero=1),
    Case("gpt2", tied=True),
]


@functools.cache
def oracle(case: Case) -> dict:
    return fns.oracle(case)


def _close(got: object, want: object, what: str) -> None:
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_hf_model_whole_under_ptdp_matches_one_process(ranks, case):
    want = oracle(case)
    results = ranks(4, fns.train, case, timeout=300)
    dense = sum(v.numel() for k, v in want["state"].items() if "rotary" not in k)
    for rank, got in enumerate(results):
        assert got["groups"][0]["weight_decay"] == 0.1 and got["groups"][0]["lr"] == 1e-2
        assert got["groups"][1]["weight_decay"] == 0.0 and got["groups"][1]["lr"] == 2e-2
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-6, atol=1e-6
        )
        _close(torch.tensor(got["norms"]), torch.tensor(want["norms"]), f"rank {rank} norms")
        assert min(got["norms"]) > fns.MAX_NORM  # clipping acted on every step
        assert list(got["state"]) == list(want["state"]), f"rank {rank}: dense keys differ"
        for key, value in want["state"].items():
            _close(got["state"][key], value, f"rank {rank} {key}")
        assert got["local"] < dense, "a rank holds the whole model"
        assert got["refused"] is None
        opt, ref = got["optimizer"], want["optimizer"]
        assert [g["params"] for g in opt["param_groups"]] == [
            g["params"] for g in ref["param_groups"]
        ]
        for g, r in zip(opt["param_groups"], ref["param_groups"], strict=True):
            assert (g["lr"], g["weight_decay"]) == (r["lr"], r["weight_decay"])
        assert set(opt["state"]) == set(ref["state"])
        for i, stats in ref["state"].items():
            for stat, value in stats.items():
                _close(opt["state"][i][stat], value, f"rank {rank} optimizer {i} {stat}")
    if case.pp > 1:
        assert "stage 0 (rank 0): embed" in results[0]["partition"]


def _layout(model, **kw):
    args = dict(
        shape={"pp": 2, "dp": 1, "tp": 2},
        microbatches=2,
        zero=0,
        schedule="1f1b",
        chunks=None,
        sequence_parallel=False,
        custom_plan=False,
        plans=plan_for,
    )
    args.update(kw)
    return check_layout(model, **args)


@pytest.mark.parametrize(
    ("family", "kwargs", "words"),
    [
        ("llama", {"shape": {"pp": 1, "dp": 1, "tp": 3}}, ["tp=3", "4 query heads"]),
        ("llama6x3", {"shape": {"pp": 1, "dp": 1, "tp": 2}}, ["tp=2", "3 key/value heads"]),
        ("llama", {"shape": {"pp": 5, "dp": 1, "tp": 1}}, ["pp=5", "only 4 layers"]),
        (
            "llama",
            {"sequence_parallel": True},
            ["sequence parallelism with pp=2", "rotary", "sequence_parallel=False"],
        ),
        (
            "llama",
            {"plans": None},
            ["no pipeline plan for a LlamaForCausalLM", "plans=plait.models.plans.plan_for"],
        ),
        ("gpt2", {"sequence_parallel": True}, ["GPT2LMHeadModel", "sequence_parallel=False"]),
        ("llama", {"zero": 1, "tied": True}, ["zero=1 with pp=2", "tied parameter"]),
    ],
)
def test_bad_layouts_are_refused_naming_what_to_change(family, kwargs, words):
    """In process, before any group exists: the plan's sizes, the pipeline's cut, the
    per-stage context under sequence parallelism, a model with no plan given."""
    tied = kwargs.pop("tied", False)
    with pytest.raises(ValueError) as err:
        model = fns.llama_heads(6, 3) if family == "llama6x3" else fns.MODELS[family](tied)
        _layout(model, **kwargs)
    for w in words:
        assert w in str(err.value), f"{w!r} not in: {err.value}"


def test_tp_that_does_not_divide_the_heads_is_refused_on_every_rank(ranks):
    out = ranks(4, fns.refused_on_ranks, timeout=60)
    for r, text in enumerate(out):
        assert text.startswith("ValueError: ptdp: tp=4"), (r, text)
        assert "'model.layers.*.self_attn' has 6 query heads" in text, (r, text)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_checkpoint_of_one_layout_loads_into_another(ranks, tmp_path, family):
    """A PTD-P checkpoint (an ordinary plait.checkpoint of the dense model and its
    two-group AdamW) saved from pp2 x tp2 loads into dp2 x tp2 bitwise (GPT-2: its Conv1D
    and fused c_attn shards cut and assembled through their index maps)."""
    out = ranks(4, fns.save_then_load, str(tmp_path / "ckpt"), family, timeout=300)
    for rank, got in enumerate(out):
        assert got["keys"] and got["optimizer entries"] > 0, (rank, got)
        assert got["diff"] == 0.0, (rank, got)
        assert got["groups"] == [(1e-2, 0.1), (2e-2, 0.0)], (rank, got)
