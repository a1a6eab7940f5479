"""2D (SUMMA), 2.5D (Tesseract) and 3D tensor parallelism against dense computation.

Each operation (the matmul and its two backward products, the linear layer with bias,
LayerNorm, embedding, the vocabulary head with its loss on batch shards) equals the dense
one in float64, at 4 ranks (2D, q=2) and 8 ranks (2.5D q=2 d=2, 3D q=2), under the default
rank layout and a permuted one (reversed ranks, other dimension order). The GPT under each
mode equals the one-process oracle after several Adam steps. Tolerance as in
tests/test_tensor_gpt.py: float64, sums in another order, 1e-10.
"""

from __future__ import annotations

import pytest
import torch

from tests import tensor_gpt_fns
from tests import tensor_nd_fns as fns

TOL = {"rtol": 1e-10, "atol": 1e-10}
WORLD = {"2d": 4, "2.5d": 8, "3d": 8}


@pytest.mark.parametrize(
    ("mode", "permuted"), [("2d", False), ("2d", True), ("2.5d", True), ("3d", False), ("3d", True)]
)
def test_ops_match_dense(ranks, mode, permuted):
    results = ranks(WORLD[mode], fns.ops, mode, permuted, timeout=180)
    coords = {r["coords"] for r in results}
    assert len(coords) == WORLD[mode]  # every rank a distinct grid cell
    losses = {round(r["loss"], 12) for r in results}
    assert len(losses) == 1  # the global-batch loss, the same on every rank


@pytest.mark.parametrize(("mode", "permuted"), [("2d", True), ("2.5d", False), ("3d", True)])
def test_gpt_matches_oracle(ranks, mode, permuted):
    want, want_losses = tensor_gpt_fns.oracle(False, size=fns.GPT_BATCH)
    results = ranks(WORLD[mode], fns.train_gpt, mode, permuted, timeout=300)
    for res in results:
        got = res["state"]
        assert list(got) == list(want)  # the dense model's keys, in order
        for key in want:
            assert got[key].shape == want[key].shape, key
            torch.testing.assert_close(got[key], want[key], **TOL, msg=lambda m, k=key: f"{k}: {m}")
        torch.testing.assert_close(res["losses"], want_losses, **TOL)
    # parameters per rank: weights 1/q^2 (2D, 2.5D) or less; all ranks hold the same count
    local = {r["local_numel"] for r in results}
    assert len(local) == 1
    dense = results[0]["dense_numel"]
    assert local.pop() * 4 <= dense + 4 * 13 * 16  # 1/q^2 (head padded 13 -> 16 columns)


def test_refusals_name_what_to_change(ranks):
    for out in ranks(4, fns.refusals, timeout=120):
        assert "cube number of ranks" in out["three_d_on_4"] and "use 1 or 8" in out["three_d_on_4"]
        assert "square number of ranks" in out["not_square"] and "4 or 9" in out["not_square"]
        assert "dimensions ['col', 'row']" in out["tp_mesh"] and "grid_mesh" in out["tp_mesh"]
        assert "3 attention heads, not divisible by" in out["heads"]
        assert "['tok.weight', 'head.weight'] are one shared tensor" in out["tied"]
        assert "module 'ln_f' (LayerNorm)" in out["uncovered"]
        assert "one mode for every entry" in out["mixed"]
        assert "module 'tok'" in out["width"] and "not divisible" in out["width"]


# one linear layer, forward + backward: bytes sent, summed over the ranks, against
# plait.plan.tensor_costs (ring algorithms; exact)
@pytest.mark.parametrize("mode", ["1d", "2d", "2.5d", "3d"])
def test_linear_bytes_match_formula(ranks, mode):
    from plait.plan.tensor_costs import linear_cost

    world = {"1d": 4, **WORLD}[mode]
    tokens, width = 16, 16
    sent = ranks(world, fns.linear_bytes, mode, tokens, width, width, timeout=120)
    total = sum(sum(s.values()) for s in sent)
    cost = linear_cost(
        mode,
        ranks=world,
        tokens=tokens,
        in_features=width,
        out_features=width,
        depth=2 if mode == "2.5d" else None,
    )
    assert total == cost.bytes_per_rank * world
    kinds = {k for s in sent for k in s}
    expect = {
        "1d": {"all_reduce/ring"},
        "2d": {"broadcast/ring", "reduce/ring"},
        "2.5d": {"broadcast/ring", "reduce/ring", "all_reduce/ring"},
        "3d": {"all_gather/ring", "reduce_scatter/ring"},
    }[mode]
    assert kinds == expect


def test_cost_formulas_match_the_papers_table():
    """With |X| = |W| = |Y| and the papers' reduce, the exact counts are the table's."""
    from plait.plan.tensor_costs import compare_modes, format_modes, linear_cost

    for mode, world in [("1d", 4), ("2d", 16), ("3d", 27)]:
        c = linear_cost(
            mode, ranks=world, tokens=72, in_features=72, out_features=72, algorithm="paper"
        )
        assert c.bytes_per_rank == pytest.approx(c.paper_bytes_per_rank, rel=1e-12), mode
    c = linear_cost(
        "2.5d", ranks=18, depth=2, tokens=72, in_features=72, out_features=72, algorithm="paper"
    )
    depth_all_reduce = 2 * (2 - 1) / 2 * 72 * 72 * 4 / 9
    assert c.bytes_per_rank == pytest.approx(c.paper_bytes_per_rank + depth_all_reduce, rel=1e-12)
    rows = compare_modes(ranks=8, tokens=1024, width=256, layers=2, vocab=1000)
    assert [r.valid for r in rows] == [True, False, True, True]  # 8 is not a square
    assert "n/a" in format_modes(rows)


@pytest.mark.parametrize("mode", ["2d", "2.5d", "3d"])
def test_gpt_step_bytes_match_formula(ranks, mode):
    """A whole training step (linears, vectors and tables, LayerNorm statistics, loss)
    against plait.plan.tensor_costs.gpt_step_bytes, averaged over the ranks (float64)."""
    from plait.plan.tensor_costs import gpt_step_bytes

    cfg = tensor_gpt_fns.config(tied=False)
    sent = ranks(WORLD[mode], fns.gpt_step_sent, mode, timeout=120)
    want = gpt_step_bytes(
        mode,
        ranks=WORLD[mode],
        batch=fns.GPT_BATCH,
        seq=cfg.seq_len,
        width=cfg.width,
        layers=cfg.layers,
        vocab=cfg.vocab,
        depth=2 if mode == "2.5d" else None,
        bytes_per_element=8,
    )
    assert sum(sent) == pytest.approx(want * WORLD[mode], abs=1e-6)


def test_crossover_is_where_the_byte_counts_meet():
    from plait.plan.tensor_costs import compare_modes, crossover_tokens

    shape = {"ranks": 8, "width": 64, "layers": 2, "vocab": 96}
    t = crossover_tokens("3d", **shape)
    assert t is not None and t > 0
    for tokens, wins in [(int(t) - 64, False), (int(t) + 64, True)]:
        tokens -= tokens % 64  # a multiple of every grid's batch blocks
        rows = {r.mode: r.bytes_per_step for r in compare_modes(tokens=tokens, **shape)}
        assert (rows["3d"] < rows["1d"]) == wins, tokens
    assert crossover_tokens("2d", ranks=4, width=1024, layers=24, vocab=50304) is None


def test_gpt_2d_under_dp_matches_oracle(ranks):
    """dp 2 x 2D (2 x 2) with plait DDP on the dp group equals one process on the global batch."""
    want, _ = tensor_gpt_fns.oracle(False, size=2 * fns.GPT_BATCH)
    for got in ranks(8, fns.train_dp_2d, timeout=300):
        assert list(got) == list(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], **TOL, msg=lambda m, k=key: f"{k}: {m}")
