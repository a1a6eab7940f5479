"""The MoE layer's static-capacity dispatch (``pad_to_capacity=True``, GShard's ``[E, G*C, d]``
buffers, :mod:`plait.strategies.moe.padded`) against the dropless dispatch and the
one-process oracle on the global batch: in one process, under ep at 2 ranks, and in PTD-P
pp2 x ep2 at 4 ranks (float64). The all-to-alls move the padded buffers, every byte of them,
and no counts are gathered.

Tolerance: float64; the experts run on more rows (the empty slots) and their weight
gradients sum them in another order, so results agree to rounding, not bitwise.
"""

from __future__ import annotations

import copy

import pytest
import torch

from plait.moe import MoE
from tests import moe_fns as fns
from tests import moe_padded_fns as padded_fns
from tests import ptdp_fns
from tests.ptdp_fns import Case
from tests.test_ptdp import _compare

TOL = 1e-10


@pytest.mark.parametrize("case", ["top2_random", "top1", "sampling", "dropless"])
def test_padded_layer_equals_the_dropless_layer_in_one_process(case):
    dropless = fns.build_layer(case)
    padded = copy.deepcopy(dropless)
    padded.pad_to_capacity = True
    for step in range(2):  # two calls: two draws
        x = fns.global_batch(4, step)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ya, yb = dropless(xa), padded(xb)
        torch.testing.assert_close(yb, ya, rtol=0, atol=TOL)
        fns._loss(ya).backward()
        fns._loss(yb).backward()
        torch.testing.assert_close(xb.grad, xa.grad, rtol=0, atol=TOL)
        want = dict(dropless.named_parameters())
        for name, p in padded.named_parameters():
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, want[name].grad, rtol=0, atol=TOL, msg=name)
        # the same routing: the same tokens kept and dropped, expert by expert
        assert padded.last_stats == dropless.last_stats
    stats = dropless.last_stats
    assert stats is not None and (stats.dropped == 0) == (case == "dropless"), stats


def test_padded_layer_reads_its_statistics_only_when_asked(monkeypatch):
    """The forward leaves the counts on the device; the host read happens on access."""
    moe = MoE(6, num_experts=4, pad_to_capacity=True, dtype=torch.float64)
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real(t))
    moe(torch.randn(2, 8, 6, dtype=torch.float64))
    assert reads == []
    stats = moe.last_stats
    assert stats is not None and sum(stats.tokens_per_expert) > 0
    assert reads == [torch.Size([4]), torch.Size([4])]  # kept, routed
    assert "pad_to_capacity=True" in repr(moe)


@pytest.mark.parametrize("case", ["top2_random", "top1"])
def test_padded_layer_under_ep_matches_one_process(ranks, case):
    results = ranks(2, fns.layer_vs_oracle, case, 2, True, timeout=120)
    for res in results:
        assert res["y"] < TOL and res["xgrad"] < TOL and res["grads"] < TOL, res
    for step in range(2):  # padded statistics count this rank's tokens: they add up
        want_kept, want_routed = results[0]["kept"][step][1], results[0]["routed"][step][1]
        kept = [sum(col) for col in zip(*(r["kept"][step][0] for r in results), strict=True)]
        routed = [sum(col) for col in zip(*(r["routed"][step][0] for r in results), strict=True)]
        assert (kept, routed) == (want_kept, want_routed)
        assert sum(kept) < sum(routed)  # something was dropped


def test_padded_all_to_alls_send_the_whole_buffers_and_gather_no_counts(ranks):
    results = ranks(2, padded_fns.padded_bytes, timeout=60)
    p, local = 2, padded_fns.E // 2
    for res in results:
        # the first step agrees on (G, C): one all-gather of 2 int64; after it no counts
        # are gathered (the all-reduces are the gradients' and the finite check's)
        gathers = [v for key, v in res["first"].items() if key[0] == "all_gather"]
        assert [calls for calls, _ in gathers] == [1], res["first"]
        assert not [key for key in res["sent"] if key[0] == "all_gather"], res["sent"]
        calls, sent = res["sent"][("all_to_all", "ring")]
        # G = ROWS groups (sequences) of C slots per expert; each all-to-all sends the other
        # rank its E/p experts' block: 4 (p-1)/p * E * G * C * d * 8 bytes, padding included
        rows = (p - 1) * local * padded_fns.ROWS * res["capacity"]
        assert calls == 4 and sent == 4 * rows * fns.D * 8, res
        assert res["rows"] == (rows, rows)
        assert res["dropped"] > 0


def test_ranks_routing_different_groups_are_refused_naming_each(ranks):
    for text in ranks(2, padded_fns.uneven_groups, timeout=60):
        assert text.startswith("MoE layer (4 experts): pad_to_capacity=True needs"), text
        assert "rank 0: G=2, C=" in text and "rank 1: G=1, C=" in text, text
        assert "pad_to_capacity=False" in text, text


def test_padded_moe_in_ptdp_pp2_ep2_matches_one_process(ranks):
    """The oracle is the dropless GPT in one process on the global batch."""
    case = Case(pp=2, ep=2, moe=1.0, clip=0.05, pad_to_capacity=True)
    _compare(case, ranks(4, ptdp_fns.train, case, timeout=120))
