"""MoE blocks inside PTD-P: experts split over an ``ep`` dimension carved out of data
parallelism, against the one-process MoE GPT on the global batch.

The GPT's block 1 is a GShard top-2 MoE of 4 experts with the random second expert, the
auxiliary loss and the z-loss on; float64, 3 Adam steps, tolerance 1e-8 (as
tests/test_ptdp.py). With capacity factor 1.0 tokens are dropped: the same ones as in one
process (groups are sequences, the draws follow the global rows), which the equal states
show. Clipping counts each expert element once (the norms equal one process's).
"""

from __future__ import annotations

import pytest

from . import ptdp_fns as fns
from .ptdp_fns import Case
from .test_ptdp import _compare

MOE = [
    Case(dp=2, ep=2, moe=4.0, microbatches=1),
    Case(pp=2, ep=2, moe=1.0, clip=0.05),
    Case(tp=2, ep=2, moe=4.0, clip=0.05),
    Case(dp=2, tp=2, moe=1.0),  # ep = 1: experts replicated over dp and tp
    Case(dp=2, ep=2, moe=1.0, accumulate=2, microbatches=1),
]


@pytest.mark.parametrize("case", MOE, ids=lambda c: c.name)
def test_moe_layouts_match_one_process(ranks, case):
    _compare(case, ranks(4, fns.train, case, timeout=120))


def test_capacity_one_drops_tokens_in_the_oracle():
    """The capacity-1.0 cases above do drop tokens (so they show the same drops)."""
    import torch

    from plait.models import GPT

    cfg = fns.config(False, 1.0)
    model = GPT(cfg)
    model(fns.batch(0, cfg, 4)[0])
    stats = model.blocks[1].mlp.last_stats
    assert stats is not None and stats.dropped > 0, stats
    roomy = GPT(fns.config(False, 4.0))
    with torch.no_grad():
        roomy(fns.batch(0, cfg, 4)[0])
    assert roomy.blocks[1].mlp.last_stats.dropped == 0
