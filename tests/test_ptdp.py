"""PTD-P (tensor + pipeline + data parallelism on one mesh) against one process.

Every factorisation of 4 ranks, with ZeRO-1/2 over dp, sequence parallelism, a tied
embedding, gradient clipping, gradient accumulation and each pipeline schedule, and one
8-rank dp2 x tp2 x pp2 layout, end (after 3 Adam steps, float64) where the dense GPT
trained in one process on the global batch ends: the same losses, the same clipped norms,
the same dense state dict (assembled on every rank). Tolerance: float64 with partial sums
taken in another order (tp splits the matmuls, dp averages rows): 1e-8.

Refusals run in-process on :func:`check_layout` / :func:`check_batch` (pure), and one on
ranks through ``compose`` and ``step``.
"""

from __future__ import annotations

import pytest
import torch

from plait.models import GPT, GPTConfig
from plait.models.gpt import MoEConfig
from plait.strategies.compose import check_batch, check_layout

from . import ptdp_fns as fns
from .ptdp_fns import Case

TOL = 1e-8

FOUR = [
    Case(dp=2, tp=2),
    Case(dp=2, pp=2),
    Case(tp=2, pp=2),
    Case(dp=4, microbatches=1),
    Case(tp=4),
    Case(pp=4, microbatches=4),
    Case(dp=2, pp=2, zero=1),
    Case(dp=2, tp=2, zero=2, microbatches=1),
    Case(tp=2, pp=2, sp=True),
    Case(dp=2, tp=2, sp=True, zero=1),
    Case(tp=2, pp=2, tied=True),
    Case(tp=2, pp=2, tied=True, clip=0.05),
    Case(dp=2, tp=2, zero=1, clip=0.05),
    Case(dp=2, pp=2, accumulate=2),
    Case(dp=2, tp=2, zero=1, accumulate=2),
    Case(dp=2, pp=2, schedule="interleaved", microbatches=2),
    Case(tp=2, pp=2, sp=True, schedule="zb-h1"),
    # zbv puts the first and last stage on one rank: the tied weight is counted once there
    Case(tp=2, pp=2, tied=True, clip=0.05, schedule="zbv"),
    Case(dp=2, pp=2, tied=True, clip=0.05, schedule="gpipe", via_prepare=True),
    # the split backward's W accumulates into ZeRO-1's guarded local gradient
    Case(dp=2, pp=2, zero=1, schedule="zb-h1"),
    # DualPipeV: the V placement with F&B pairs, m >= 2p
    Case(tp=2, pp=2, tied=True, clip=0.05, schedule="dualpipev", microbatches=4),
    Case(dp=2, pp=2, zero=1, schedule="dualpipev", microbatches=4, batch=8),
    # recompute=True: every stage reruns its forward (tensor-parallel collectives included)
    Case(tp=2, pp=2, sp=True, options={"recompute": True}),
    Case(dp=2, pp=2, zero=1, schedule="zb-h1", options={"recompute": True}),
]


def _compare(case: Case, results: list[dict]) -> None:
    want = fns.oracle(case)
    for rank, got in enumerate(results):
        assert list(got["state"]) == list(want["state"]), f"rank {rank}: dense keys differ"
        for key, value in want["state"].items():
            diff = (got["state"][key] - value).abs().max().item()
            assert diff < TOL, f"rank {rank} {case.name}: {key} differs by {diff}"
        assert got["losses"] == pytest.approx(want["losses"], abs=TOL), f"rank {rank} losses"
        assert got["norms"] == pytest.approx(want["norms"], abs=TOL), f"rank {rank} norms"
    if case.clip is not None:
        assert max(want["norms"]) > case.clip, "the test must actually clip"
    dense = sum(v.numel() for v in GPT(fns.config(case.tied, case.moe)).parameters())
    if case.tp * case.pp > 1:
        assert max(r["local"] for r in results) < dense, "every rank holds the whole model"


@pytest.mark.parametrize("case", FOUR, ids=lambda c: c.name)
def test_four_ranks_match_one_process(ranks, case):
    _compare(case, ranks(4, fns.train, case, timeout=120))


def test_eight_ranks_dp2_tp2_pp2(ranks):
    case = Case(dp=2, tp=2, pp=2, zero=1, sp=True, clip=0.05)
    _compare(case, ranks(8, fns.train, case, timeout=240))


def _moe(**options):
    return GPT(GPTConfig(vocab=13, layers=2, heads=2, width=8, moe=MoEConfig(**options)))


def _layout(**kw):
    args = dict(
        shape={"pp": 1, "dp": 1, "tp": 1},
        microbatches=1,
        zero=0,
        schedule="1f1b",
        chunks=None,
        sequence_parallel=False,
        custom_plan=False,
    )
    model = kw.pop("model", None) or GPT(fns.config(False))
    args.update(kw)
    return check_layout(model, **args)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        # (a mesh without pp, dp or tp means size 1 there: tests/test_readme_snippets.py)
        ({"shape": {"pp": 1, "dp": 1, "tp": 1, "xp": 2}}, ["['xp']", "ep=..", "cp=.."]),
        ({"shape": {"pp": 1, "dp": 1, "tp": 1, "ep": 2}}, ["ep=2", "no MoE blocks"]),
        ({"tp_mode": "2d"}, ["tp_mode='2d'", "tp_mode='1d'", "strategy='tp'"]),
        ({"shape": {"pp": 1, "dp": 1, "tp": 3}}, ["tp=3", "heads = 4"]),
        ({"shape": {"pp": 5, "dp": 1, "tp": 1}}, ["pp=5", "4 layers"]),
        (
            {"shape": {"pp": 2, "dp": 1, "tp": 1}, "schedule": "interleaved", "chunks": 3},
            ["6 pipeline stages"],
        ),
        ({"shape": {"pp": 2, "dp": 2, "tp": 1}, "zero": 2}, ["zero=2 with pp=2", "zero=1"]),
        ({"shape": {"pp": 1, "dp": 2, "tp": 1}, "zero": 2, "microbatches": 2}, ["2 times"]),
        ({"zero": 3}, ["zero=3"]),
        ({"microbatches": 0}, ["microbatches=0"]),
        # (a sequence tp does not divide is refused by check_batch, before any collective)
        (
            {
                "shape": {"pp": 1, "dp": 1, "tp": 2},
                "sequence_parallel": True,
                "custom_plan": True,
                "tp_plan": {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise"},
            },
            ["explicit tp_plan", "sequence regions"],
        ),
        (
            {
                "shape": {"pp": 1, "dp": 1, "tp": 4},
                "tp_plan": {"blocks.0.mlp.fc1": "rowwise"},
                "custom_plan": True,
                "model": GPT(GPTConfig(vocab=13, layers=1, heads=2, width=6)),
            },
            ["tp=4", "6 inputs", "'blocks.0.mlp.fc1'", "rowwise"],
        ),
        (
            {"shape": {"pp": 2, "dp": 2, "tp": 1}, "zero": 1, "model": GPT(fns.config(True))},
            ["tied", "zero=1 with pp=2"],
        ),
        ({"model": torch.nn.Linear(2, 2)}, ["plait.models.GPT", "Linear"]),
        ({"shape": {"pp": 1, "dp": 1, "tp": 1, "ep": 3}, "model": _moe()}, ["ep=3", "4"]),
        (
            {"shape": {"pp": 1, "dp": 1, "tp": 2}, "sequence_parallel": True, "model": _moe()},
            ["sequence parallelism with MoE"],
        ),
        ({"shape": {"pp": 1, "dp": 2, "tp": 1, "ep": 2}, "zero": 1, "model": _moe()}, ["zero=0"]),
        ({"model": _moe(aux_loss="switch")}, ["aux_loss='switch'", "'gshard'"]),
        ({"model": _moe(bias_update_rate=1e-3)}, ["bias_update_rate=0"]),
    ],
)
def test_layouts_the_mesh_cannot_build_are_refused(kwargs, words):
    with pytest.raises(ValueError) as err:
        _layout(**kwargs)
    for w in words:
        assert w in str(err.value), f"{w!r} not in: {err.value}"


def test_batches_that_do_not_split_are_refused():
    sizes = _layout(shape={"pp": 1, "dp": 2, "tp": 2}, microbatches=3, sequence_parallel=True)
    ids = torch.zeros(4, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"batch of 4 .* dp=2 .* microbatches=3 .* multiple of 6"):
        check_batch(ids, ids, sizes)
    sizes = _layout(shape={"pp": 1, "dp": 1, "tp": 2}, sequence_parallel=True)
    odd = torch.zeros(2, 7, dtype=torch.long)
    with pytest.raises(ValueError, match="multiple of 2; got 7"):
        check_batch(odd, odd, sizes)
    with pytest.raises(ValueError, match="differ"):
        check_batch(ids, odd, sizes)


def test_refused_on_ranks_before_any_collective(ranks):
    # the batch check runs before the pipeline or the dp group is used: no rank hangs
    errors = ranks(4, fns.refused, Case(dp=2, tp=2, microbatches=2), size=2, timeout=60)
    assert all("multiple of 4" in e for e in errors), errors


def test_a_step_whose_gradients_are_zeroed_does_not_count_as_accumulation(ranks):
    """zero_grad forgets pending steps: evaluating with .step then zero_grad leaves the
    next optimizer step exactly what it is without the evaluation."""
    plain = ranks(4, fns.evaluate_then_train, False, timeout=120)[0]
    after_eval = ranks(4, fns.evaluate_then_train, True, timeout=120)[0]
    for key in plain:
        assert torch.equal(plain[key], after_eval[key]), key
