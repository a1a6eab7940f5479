"""The GPT under pipeline parallelism equals the one-process oracle: every schedule at
p in {2, 4} and m in {1, p, 2p+1} where the schedule allows it (interleaved needs m % p == 0,
dualpipev m >= 2p, also run at its least m = 2p; the refusals are tested in
test_pipeline_schedules.py), tied and untied head, with and without recomputation:
first-step gradients, losses, and parameters after 3 Adam steps. Also: 1F1B's measured
in-flight micro-batches, a failing or dying stage named on every rank, and the bubble
report from the tracer.

Tolerance: float64; the pipeline sums micro-batch gradients in another order than the
dense backward of the whole batch (observed ~1e-14); we allow 1e-10.
"""

from __future__ import annotations

import functools

import pytest
import torch

from plait.launch.pool import RankExited
from plait.strategies.pipeline import bubble_report, build
from plait.strategies.pipeline.schedules import default_chunks
from tests import pipeline_fns as fns

TOL = {"rtol": 1e-10, "atol": 1e-10}
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")


@functools.cache
def oracle(tied: bool, layers: int, size: int) -> dict:
    return fns.oracle(tied, layers, size)


def cases() -> list[tuple[str, int, int]]:
    out = []
    for p in (2, 4):
        for name in SCHEDULES:
            for m in (1, p, 2 * p, 2 * p + 1):
                if m == 2 * p and name != "dualpipev":  # 2p: only DualPipeV's least m
                    continue
                if name == "interleaved" and m % p or name == "dualpipev" and m < 2 * p:
                    continue
                out.append((name, p, m))
    return out


@pytest.mark.parametrize(("name", "p", "m"), cases())
@pytest.mark.parametrize(("tied", "recompute"), [(False, False), (True, False), (True, True)])
def test_gpt_matches_oracle(ranks, name, p, m, tied, recompute):
    layers = max(2, p * default_chunks(name) - 2)  # at least one layer per stage
    size = 2 * m
    want = oracle(tied, layers, size)
    results = ranks(p, fns.train, name, m, tied, layers, recompute, size, timeout=120)
    state: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    for res in results:
        assert "stage 0 (rank 0): embed" in res["partition"]
        assert not set(res["state"]) & set(state)  # every parameter on exactly one rank
        state |= res["state"]
        grads |= res["grads"]
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(want["losses"]), **TOL)
    assert set(state) == set(want["state"]) or tied  # tied: tok and head on different ranks
    for key, value in want["state"].items():
        got = state[key] if key in state else state["tok.weight"]
        torch.testing.assert_close(got, value, **TOL, msg=lambda s, k=key: f"{k}: {s}")
    for key, value in want["grads"].items():
        if key in grads:
            torch.testing.assert_close(grads[key], value, **TOL, msg=lambda s, k=key: f"{k}: {s}")
    assert set(grads) >= set(want["grads"]) - {"head.weight", "tok.weight"}
    # bytes: one activation and one gradient per SEND action, b s h float64 each
    sched = build(name, p=p, m=m)
    message = 2 * fns.config(tied, layers).seq_len * 16 * 8
    sends = {
        k: sum(1 for acts in sched.ranks for a in acts if a.kind.value == k)
        for k in ("SEND_F", "SEND_B")
    }
    got = {
        k: sum(res["sent"].get(k, 0) for res in results)
        for k in ("pp_activation", "pp_gradient", "pp_tied_grad")
    }
    assert got["pp_activation"] == sends["SEND_F"] * message
    assert got["pp_gradient"] == sends["SEND_B"] * message
    tied_apart = tied and sched.placement[0] != sched.placement[-1]
    assert got["pp_tied_grad"] == (2 * 13 * 16 * 8 if tied_apart else 0)


@pytest.mark.parametrize("p", [2, 4])
def test_1f1b_in_flight_at_most_p(ranks, p):
    m = 2 * p + 1
    results = ranks(p, fns.train, "1f1b", m, False, 2, False, 2 * m, timeout=120)
    for r, res in enumerate(results):
        assert res["peak"] == {r: p - r}  # measured by the runtime, never above p
    gp = ranks(p, fns.train, "gpipe", m, False, 2, False, 2 * m, timeout=120)
    for r, res in enumerate(gp):
        assert res["peak"] == {r: m}


@pytest.mark.parametrize(("p", "bad"), [(2, 1), (4, 2)])
def test_raising_stage_named_on_every_rank(ranks, p, bad):
    out = ranks(p, fns.failing, "raise", bad, 20.0, timeout=60)
    for r, text in enumerate(out):
        assert text.startswith("PipelineError"), (r, text)
        assert f"rank {bad} (pp rank {bad}) (stage {bad}) failed in {bad}F" in text, (r, text)
        assert "boom in this stage" in text, (r, text)


def test_dying_stage_named_on_every_rank(ranks):
    out = ranks(2, fns.failing, "die", 1, 20.0, timeout=60, may_exit=[1])
    assert isinstance(out[1], RankExited)
    assert out[0].startswith("PipelineError"), out[0]
    assert "rank 1" in out[0], out[0]


def test_bubble_report_from_trace(ranks):
    p, m = 2, 4
    results = ranks(p, fns.traced, "1f1b", m, 2, 2, timeout=120)
    spans = [s for res in results for s in res["spans"]]
    names = sorted(s.name for s in spans if s.stream == "compute")
    assert names == sorted(["F"] * m * p + ["B"] * m * p)
    report = bubble_report(build("1f1b", p=p, m=m), spans)
    assert 0.0 <= report.measured < 1.0
    assert 0.0 <= report.simulated < 1.0
    assert report.formula == pytest.approx(1 / 5)
    assert "bubble measured" in report.describe()


def test_bad_configuration_is_refused_by_name(ranks):
    for out in ranks(2, fns.refusals, timeout=120):
        assert "microbatches=3 is not a multiple of p=2" in out["interleaved"]
        assert "exactly 2 chunks per rank" in out["zbv_chunks"]
        assert "4 stages from 2 layers" in out["too_many_stages"]
        assert "pass loss_fn=" in out["no_loss"]
        assert "pass microbatches=" in out["no_m"]
        assert "a batch of 4 does not split into microbatches=3" in out["batch"]
        assert "3 stage modules given" in out["stage_list"]


def test_stage_list_equals_one_process(ranks):
    torch.manual_seed(0)
    stages = [torch.nn.Linear(4, 4, dtype=torch.float64) for _ in range(2)]
    x = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = float(((stages[1](stages[0](x)) - x) ** 2).mean())
    for got in ranks(2, fns.stage_list, timeout=120):
        assert got == pytest.approx(want, rel=1e-12)
