"""Context parallelism with ZeRO-1/2 and FSDP over cp x dp (``plait.prepare(strategy="cp",
zero=...)``) against one process on the whole sequences of the global batch, float64:
losses, parameters and the optimizer's state after 3 steps; each rank's share of the
parameters under zero=3; the refusals."""

from __future__ import annotations

import pytest

from tests import context_sharded_fns as fns

pytestmark = pytest.mark.timeout(300)


def _check(results, want, *, state=True):
    for res in results:
        diff = max(abs(a - b) for a, b in zip(res["losses"], want["losses"], strict=True))
        assert diff < 1e-10, (diff, res["losses"], want["losses"])
        assert set(res["params"]) == set(want["params"])
        for name, v in want["params"].items():
            assert float((res["params"][name] - v).abs().max()) < 1e-8, name
        if state:  # the whole optimizer state, gathered from the shards
            assert set(res["optim"]) == set(want["optim"]) and want["optim"]
            for name, v in want["optim"].items():
                assert float((res["optim"][name] - v).abs().max()) < 1e-8, name


def test_gpt_cp2_dp2_fsdp_ring_holds_a_quarter_of_the_parameters(ranks):
    want = fns.oracle("gpt", 2)
    results = ranks(4, fns.sharded, "gpt", "ring", 2, 2, 3, timeout=240)
    _check(results, want)
    total = want["numel"]
    for res in results:
        n = res["n"]
        assert n == 4
        # each unit's flat buffer is padded to a multiple of n, then cut in n
        assert total / n <= res["held"] <= (total + res["units"] * (n - 1)) / n
        assert res["held"] < total / 3  # the point of zero=3: not the whole model


@pytest.mark.parametrize(
    ("family", "context", "cp", "dp", "zero"),
    [
        ("llama", "ulysses", 2, 1, 3),
        ("llama", "ring", 2, 2, 1),
        ("gpt", "ulysses", 2, 1, 2),
    ],
)
def test_sharded_optimizer_under_cp_matches_one_process(ranks, family, context, cp, dp, zero):
    want = fns.oracle(family, dp)
    _check(ranks(cp * dp, fns.sharded, family, context, cp, dp, zero, timeout=240), want)


@pytest.mark.parametrize(
    ("family", "zero", "sp"),
    [("gpt", 3, False), ("llama", 2, False), ("gpt", 0, True), ("gpt", 2, True)],
)
def test_tp2_cp2_matches_one_process(ranks, family, zero, sp):
    """SGD with momentum, whose step is linear in the gradient (an average off by a factor
    would show in the parameters); its state lives on tp shards, so the parameters compare.
    With tp's sequence parallelism too (``sp``): the position ids are replaced before its
    sequence region slices them."""
    want = fns.oracle(family, 1, "sgd")
    results = ranks(4, fns.sharded, family, "ring", 2, 1, zero, 2, "sgd", sp, timeout=240)
    _check(results, want, state=False)


def test_bad_settings_are_refused_by_name(ranks):
    for got in ranks(4, fns.refusals, timeout=120):
        assert "zero=4; use 0" in got["zero4"]
        assert "zero=True; use 0" in got["zero_bool"]
        assert "check_finite='skip' with zero=1" in got["skip"]
        assert "wrap= chooses FSDP units; it needs zero=3" in got["wrap"]
        assert "zero=2 shards the optimizer" in got["no_optimizer"]
        assert "sequence_parallel=True with zero=3" in got["sequence_parallel"]


@pytest.mark.parametrize("zero", [1, 3])
def test_a_nonfinite_gradient_stops_every_rank(ranks, zero):
    for text in ranks(2, fns.nonfinite, zero, timeout=120):
        assert text.startswith("NonFiniteGradientError"), text
        assert f"zero={zero}" in text and "rank(s)" in text, text
