"""The planner's activation bytes per rank under context parallelism against a measured
forward on every cp rank.

plait's GPT and a tiny Hugging Face Llama (sdpa, grouped-query attention: 4 heads, 2
key/value heads) run one training forward under ``plait.prepare(strategy="cp")`` on 2 and
4 local ranks, with ring attention and with Ulysses, each rank on its load-balanced
``seq / cp`` tokens (tests/plan_context_measured_fns.py). What each rank's autograd saves
for the backward is measured as in tests/test_plan_activations.py (each storage once,
parameters and buffers left out, the logits the loop keeps counted); one block is the
two-block model less the one-block model. Both are compared with
:func:`plait.plan.activations.activation_memory` at ``Layout(cp=c, context=...)`` for the
spec the CLI builds (``from_gpt_config``, ``hf.from_hf_config``), fp32, no dropout, fused
attention (the CLI's default): every rank must agree within 1% per block and 2% per model
(the same tolerances, for the same left-out terms: the norms' statistics, the token ids,
RoPE's cos and sin, and here the position ids of this rank's tokens).

Print the table: ``PYTHONPATH=$PWD .venv/bin/python tests/test_plan_context_measured.py``.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from plait.plan import hf  # noqa: E402
from plait.plan.activations import activation_memory  # noqa: E402
from plait.plan.layout import Job, Layout  # noqa: E402
from plait.plan.model import from_gpt_config  # noqa: E402
from tests import plan_context_measured_fns as fns  # noqa: E402

BLOCK_TOL = 0.01
MODEL_TOL = 0.02
CASES = [(f, c, n) for n in (2, 4) for f in ("gpt", "llama") for c in ("ring", "ulysses")]
pytestmark = pytest.mark.timeout(300)


def predicted(family: str, context: str, cp: int) -> tuple[float, float]:
    """The planner's (block, whole model) bytes per rank for the measured shapes."""
    spec = (
        from_gpt_config(fns.gpt_config(2))
        if family == "gpt"
        else hf.from_hf_config(fns.llama_config(2))
    )
    job = Job(
        global_batch=fns.BATCH, seq=fns.SEQ, precision="fp32", dropout=False, flash_attention=True
    )
    act = activation_memory(spec, job, Layout(microbatch=fns.BATCH, cp=cp, context=context))
    return act.per_layer, act.total


def rows(run: Any, family: str, context: str, cp: int) -> list[dict[str, Any]]:
    block, model = predicted(family, context, cp)
    out = []
    for rank, got in enumerate(run(cp, fns.saved_per_rank, family, context, timeout=120)):
        measured_block = got["two"] - got["one"]
        out.append(
            {
                "case": f"{family} {context} cp={cp}",
                "rank": rank,
                "block": measured_block,
                "predicted_block": block,
                "block_error": block / measured_block - 1,
                "model": got["two"],
                "predicted_model": model,
                "model_error": model / got["two"] - 1,
            }
        )
    return out


@pytest.mark.parametrize(("family", "context", "cp"), CASES, ids=[str(c) for c in CASES])
def test_every_cp_rank_keeps_what_the_planner_predicts(ranks, family, context, cp):
    for row in rows(ranks, family, context, cp):
        assert abs(row["block_error"]) <= BLOCK_TOL, row
        assert abs(row["model_error"]) <= MODEL_TOL, row


if __name__ == "__main__":
    from plait import RankPool

    pools: dict[int, Any] = {}

    def run(n: int, fn: Any, *args: Any, timeout: float = 120) -> list[Any]:
        if n not in pools:
            pools[n] = RankPool(n, timeout=60)
        return pools[n].run(fn, *args, timeout=timeout)

    out = sys.stdout
    out.write(
        "| case | rank | block measured | predicted | error | model measured | predicted "
        "| error |\n|---|---|---|---|---|---|---|---|\n"
    )
    for family, context, cp in CASES:
        for r in rows(run, family, context, cp):
            out.write(
                f"| {r['case']} | {r['rank']} | {r['block']:,} | {r['predicted_block']:,.0f} | "
                f"{r['block_error']:+.2%} | {r['model']:,} | {r['predicted_model']:,.0f} | "
                f"{r['model_error']:+.2%} |\n"
            )
    for pool in pools.values():
        pool.close()
