"""The planner's per-rank model-state bytes against what ``plait.plan.memory.measure``
reads on 4 real ranks after one Adam step of the reference GPT (fp32).

What both count: every parameter, its gradient and Adam's two moments (plus ZeRO's flat
shard, which shares storage with the moments' parameters and is counted once). What only
``measure`` counts: Adam's ``step`` scalar per parameter tensor (4 bytes each, a few hundred
bytes here), the only difference; the assertion allows 5%. Activations are not compared:
``measure`` reads model states only.
"""

from __future__ import annotations

from typing import Any

import pytest

from plait.plan.layout import Job, Layout
from plait.plan.model import from_gpt_config
from plait.plan.states import rank_states
from tests import plan_fns

LAYERS = 4
JOB = Job(global_batch=plan_fns.BATCH, seq=16, precision="fp32", optimizer="adam")
LAYOUTS = {
    "ddp": Layout(dp=4),
    "zero1": Layout(dp=4, zero=1),
    "zero2": Layout(dp=4, zero=2),
    "fsdp": Layout(dp=4, zero=3),
    "tp": Layout(tp=4),
    "dp2tp2": Layout(dp=2, tp=2),
    "pp": Layout(pp=4, schedule="1f1b", microbatch=2),
    "ep4": Layout(ep=4),
    "dp2ep2": Layout(dp=2, ep=2),
}
EXPERTS = {"ep4": 4, "dp2ep2": 4}


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_planner_memory_matches_measure_within_5_percent(ranks: Any, kind: str) -> None:
    model = from_gpt_config(plan_fns.config(LAYERS, EXPERTS.get(kind, 0)))
    predicted = rank_states(model, JOB, LAYOUTS[kind])
    for got in ranks(4, plan_fns.measured, kind, LAYERS, timeout=120):
        want = predicted[got["pp_rank"]]
        b = got["bytes"]
        assert b["params"] == pytest.approx(want.params_bytes, rel=0.05), (kind, b, want)
        assert b["grads"] == pytest.approx(want.grads_bytes, rel=0.05), (kind, b, want)
        assert b["optimizer"] == pytest.approx(want.optimizer_bytes, rel=0.05), (kind, b, want)
        assert b["total"] == pytest.approx(want.total_bytes, rel=0.05), (kind, b, want)
        # the only difference is Adam's step counters: a few bytes per tensor
        assert 0 <= b["total"] - want.total_bytes < 4 * 64
