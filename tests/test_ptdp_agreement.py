"""PTD-P refuses, on every rank and before any step, ranks that disagree (issue: trust)."""

from __future__ import annotations

import time

import pytest

from tests import faultlog
from tests import ptdp_agreement_fns as fns


def _timed(ranks, *args, **kwargs):
    start = time.perf_counter()
    out = ranks(*args, **kwargs)
    return out, time.perf_counter() - start


@pytest.mark.faults
def test_one_rank_on_another_schedule_is_named_before_training(ranks):
    out, took = _timed(ranks, 4, fns.one_rank_on_another_schedule, 1, "gpipe", timeout=120)
    faultlog.record(
        row=26,
        fault="#1 PTD-P pp2 x tp2, one rank on schedule gpipe",
        detected_after_s=took,
        named_correctly="rank 1 has 'schedule: gpipe'" in out[0],
    )
    for msg in out:
        assert "the ranks were given different settings" in msg
        assert "rank 1 has 'schedule: gpipe'" in msg and "rank 0 has 'schedule: 1f1b'" in msg


@pytest.mark.faults
def test_one_rank_seeded_differently_is_named_before_training(ranks):
    out, took = _timed(ranks, 4, fns.one_rank_seeded_differently, 3, timeout=120)
    faultlog.record(
        row=26,
        fault="#2 PTD-P pp2 x tp2, one rank seeded differently",
        detected_after_s=took,
        named_correctly="rank 3 differs" in out[0],
    )
    for msg in out:
        assert "start from different weights" in msg
        assert "rank 3 differs from rank 0 at tensor #0" in msg


@pytest.mark.faults
def test_a_dense_state_of_another_vocabulary_is_refused(ranks):
    for msg in ranks(4, fns.load_another_vocabulary, timeout=120):
        assert "tok.weight" in msg and "(17, 16)" in msg and "(13, 16)" in msg


@pytest.mark.faults
def test_a_nan_on_one_rank_stops_every_rank(ranks):
    for msg, _ in ranks(4, fns.nan_on_one_rank, 2, "raise", timeout=120):
        assert "inf or NaN on ranks [2]" in msg and "no rank stepped" in msg


def test_a_nan_on_one_rank_skips_the_step_everywhere(ranks):
    for msg, unchanged in ranks(4, fns.nan_on_one_rank, 2, "skip", timeout=120):
        assert "inf or NaN on ranks [2]" in msg and "skipped on every rank" in msg
        assert unchanged
