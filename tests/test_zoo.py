"""The zoo (tests/zoo_fns.py): causal LMs from Hugging Face config classes that no plait
family module knows and no other test uses, handed whole to ``plait.prepare`` under every
strategy and compared with one process on the global batch (float64, 2 AdamW steps, two
parameter groups, ``full_state_dict``).

Every cell is exact (within 1e-10, or a float32 router's stated bound) or refused by name;
a run that differs, or fails any other way, fails the test. :data:`EXPECTED` is the table
(docs/status.md shows it with the reasons); a change in it, a refusal lifted or a new one,
fails the test until the table says so. This suite runs :data:`FAST`, a subset that covers
every code path (the Llama-layout plans, the recorded pipeline plan, per-head norms, a
checked linear subclass, fused and transposed projections, multi-query refusals, the
inferred MoE plan and its refusal); ``benchmarks/zoo.py`` runs all of it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests import zoo_fns  # noqa: E402

E, R = "exact", "refused"
# model -> ddp, fsdp, tp, pipeline, ptdp, ep (MoE only)
EXPECTED: dict[str, dict[str, str]] = {
    "gemma3": {"ddp": E, "fsdp": E, "tp": E, "pipeline": E, "ptdp": E},
    "smollm3": {"ddp": E, "fsdp": E, "tp": E, "pipeline": E, "ptdp": E},
    "glm4": {"ddp": E, "fsdp": E, "tp": E, "pipeline": E, "ptdp": E},
    "starcoder2": {"ddp": E, "fsdp": E, "tp": E, "pipeline": E, "ptdp": E},
    "arcee": {"ddp": E, "fsdp": E, "tp": E, "pipeline": E, "ptdp": E},
    "phi": {"ddp": E, "fsdp": E, "tp": E, "pipeline": E, "ptdp": E},
    "gptj": {"ddp": E, "fsdp": E, "tp": E, "pipeline": E, "ptdp": E},
    "falcon": {"ddp": E, "fsdp": E, "tp": E, "pipeline": E, "ptdp": R},
    "bloom": {"ddp": E, "fsdp": E, "tp": R, "pipeline": E, "ptdp": R},
    "gpt_bigcode": {"ddp": E, "fsdp": E, "tp": E, "pipeline": E, "ptdp": R},
    "olmoe": {"ddp": E, "fsdp": E, "tp": R, "pipeline": E, "ptdp": R, "ep": E},
    "gpt_oss": {"ddp": E, "fsdp": E, "tp": E, "pipeline": E, "ptdp": E, "ep": E},
    "deepseek_v3": {"ddp": E, "fsdp": E, "tp": R, "pipeline": E, "ptdp": R, "ep": E},
}

# every code path: per-head norms and kinds of block (gemma3), a checked linear subclass and
# multi-query (falcon), a tp refusal and the recorded pipeline plan (bloom), the inferred MoE
# plan by Mixtral's formula (olmoe) and by the experts' own forward with sinks split (gpt_oss)
FAST = ("gemma3", "falcon", "bloom", "olmoe", "gpt_oss")
FAST_PTDP = ("gpt_oss", "bloom")


def _check(results: dict[str, dict[str, dict]], names: tuple[str, ...], strategies) -> None:
    table = {name: {s: o["result"] for s, o in row.items()} for name, row in results.items()}
    bad = [
        f"{name} {s}: {o['result']} {o['diff']} {o['why'][:300]}"
        for name, row in results.items()
        for s, o in row.items()
        if o["result"] not in (E, R)
    ]
    assert not bad, "\n".join(bad)
    for name, row in results.items():
        for s, o in row.items():
            if o["result"] == R:  # a refusal says what: the model or a module by name
                assert type(o["why"]) is str and len(o["why"]) > 40, (name, s, o["why"])
    want = {n: {s: r for s, r in EXPECTED[n].items() if s in strategies} for n in names}
    assert table == want


@pytest.mark.timeout(900)
def test_zoo_on_two_ranks(ranks):
    strategies = tuple(s for s in zoo_fns.STRATEGIES if s not in zoo_fns.FOUR_RANKS)
    (results, _) = ranks(2, zoo_fns.run, FAST, strategies, timeout=900)
    _check(results, FAST, strategies)


@pytest.mark.timeout(900)
def test_zoo_ptdp_on_four_ranks(ranks):
    results = ranks(4, zoo_fns.run, FAST_PTDP, zoo_fns.FOUR_RANKS, timeout=900)[0]
    _check(results, FAST_PTDP, zoo_fns.FOUR_RANKS)
