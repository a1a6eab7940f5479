"""``plait demo --check`` in float32 (issue 43.4): the run is compared with one process in
float64 from the same start, within ``NOISE_FACTOR`` times how far float32 in one process
lands from it (measured in the run, so it holds on any CPU). A clean short run passes; the
same run with rank 1's gradient scaled by 1.01 before the average fails. The bug is
injected on the ranks by tests/demo_check_fns.py (a gradient hook), not by a user option."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.demo import digits, gpt
from plait.demo.options import GPTDemoConfig
from tests import demo_check_fns as fns

#: `plait demo --model gpt -n 2 --tp 1 --steps 6 --evals 2`: plain DDP over 2 ranks
SHORT_GPT = GPTDemoConfig(world_size=2, tp=1, steps=6, evals=2)
#: `plait demo -n 2 --epochs 2`: float32 --check compares epoch 1
SHORT_DIGITS = digits.DemoConfig(world_size=2, epochs=2)


def _gpt(ranks, tmp_path: Path, factor: float) -> gpt.GPTDemoReport:
    results = ranks(2, fns.gpt_with_scaled_gradient, SHORT_GPT, 1, factor, timeout=300)
    return gpt.summarize(SHORT_GPT, results, check=True, run_dir=tmp_path / f"g{factor}")


@pytest.mark.timeout(600)
def test_gpt_float32_check_passes_clean_and_fails_a_gradient_scaled_on_one_rank(
    ranks, tmp_path, capsys
):
    clean = _gpt(ranks, tmp_path, 1.0)
    assert "(ok: bound" in capsys.readouterr().out
    bug = _gpt(ranks, tmp_path, 1.01)
    assert "LARGER THAN EXPECTED" in capsys.readouterr().out
    assert gpt.check_passed(clean) and not gpt.check_passed(bug)
    # the bound is measured: 10 x float32 in one process, the same for both runs
    noise = clean.float32_noise
    assert 0 < noise["distance"] < 1e-3 and noise["orders"] == (1, 2)
    assert clean.check_bound == bug.check_bound == gpt.NOISE_FACTOR * noise["distance"]
    # the bug lands far outside (measured: 1000 x the noise), in parameters and losses
    assert bug.param_distance > 10 * bug.check_bound
    assert bug.max_loss_diff > bug.loss_bound


@pytest.mark.timeout(600)
def test_digits_float32_check_passes_clean_and_fails_a_gradient_scaled_on_one_rank(ranks, tmp_path):
    reports = {}
    for factor in (1.0, 1.01):
        results = ranks(2, fns.digits_with_scaled_gradient, SHORT_DIGITS, 1, factor, timeout=300)
        run_dir = tmp_path / f"d{factor}"
        reports[factor] = digits.summarize(SHORT_DIGITS, results, check=True, run_dir=run_dir)
    clean, bug = reports[1.0], reports[1.01]
    assert digits.check_passed(clean) and not digits.check_passed(bug)
    assert bug.param_distance > 10 * bug.check_bound


def test_a_moe_gpt_measures_rounding_on_the_whole_batch_only():
    """Its experts' capacity counts the tokens of one forward: pieces change the function."""
    assert gpt.summation_orders(GPTDemoConfig(moe=True, tp=1, ep=2)) == (1,)
    assert gpt.summation_orders(GPTDemoConfig(batch_size=16)) == (1, 2)
    assert gpt.summation_orders(GPTDemoConfig(batch_size=9, tp=1, world_size=1)) == (1, 9)


def test_a_float32_check_without_measured_bounds_does_not_pass():
    def report(**check) -> gpt.GPTDemoReport:
        return gpt.GPTDemoReport(
            config=SHORT_GPT, final_loss=1.0, held_out_loss=1.0, tokens_per_s=1.0,
            train_seconds=1.0, layout="", max_param_diff=1.0, **check,
        )  # fmt: skip

    ok = {"param_distance": 1e-5, "check_bound": 1e-4, "max_loss_diff": 1e-7, "loss_bound": 1e-6}
    assert gpt.check_passed(report(**ok))
    assert not gpt.check_passed(report(**{**ok, "param_distance": 2e-4}))
    assert not gpt.check_passed(report(**{**ok, "max_loss_diff": 2e-6}))
    assert not gpt.check_passed(report(**{**ok, "loss_bound": None}))
