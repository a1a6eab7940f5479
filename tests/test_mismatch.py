"""Ranks that disagree on a collective are named by default (no debug mode): no abort,
no wrong result, every involved rank raises CollectiveMismatch (within about a second,
recorded for the fault table), long before the collective timeout."""

from __future__ import annotations

import pytest

from plait import RankPool, cli
from tests import faultlog, mismatch_fns

# what each scenario's message must show of both ranks' calls
EXPECTED = {
    "shape": ["bytes=16", "bytes=20", "shape=(4,)", "shape=(5,)"],
    "shape_native": ["native", "bytes=16", "bytes=20"],
    "shape_ring": ["ring", "bytes=4096", "bytes=4000"],
    "dtype": ["float32", "float64"],
    "op": ["sum", "max"],
    "int32_vs_float32": ["int32", "float32"],
    "skip": ["all_reduce", "broadcast"],
    "barrier": ["barrier", "all_reduce"],
    "zero_state_dict_on_rank0": ["all_gather", "reduce_scatter"],
}
# long: what fires must be the check, not the timeout (the old behaviour waited it out)
COLLECTIVE_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def recorder_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("recorder")


@pytest.fixture(scope="module")
def outcomes(recorder_dir):
    env = {"PLAIT_RECORDER_DIR": str(recorder_dir)}
    with RankPool(2, timeout=COLLECTIVE_TIMEOUT_S, env=env) as pool:
        results = pool.run(mismatch_fns.run, list(EXPECTED), timeout=240)
        after = pool.run(mismatch_fns.agree_after, timeout=60)
    assert after == [6.0, 6.0]  # the world group is untouched by the failed sub-groups
    return results


@pytest.mark.faults
@pytest.mark.parametrize("scenario", list(EXPECTED))
def test_disagreeing_ranks_are_named(outcomes, scenario):
    seconds = []
    for rank in (0, 1):
        kind, disagreeing, message, elapsed = outcomes[rank][scenario]
        assert kind == "CollectiveMismatch", (rank, message)
        assert disagreeing == [0, 1], message
        assert "rank 0" in message and "rank 1" in message, message
        for fragment in EXPECTED[scenario]:
            assert fragment in message, (fragment, message)
        assert "#" in message and f"m-{scenario}" in message, message
        seconds.append(elapsed)
    faultlog.record(
        row=6 if scenario.startswith(("shape", "dtype", "int32")) else 5,
        fault=f"mismatch: {scenario}",
        detected_after_s=round(max(seconds), 3),
        named_correctly=True,
    )
    # a CollectiveMismatch (above), not a timeout, and before the timeout would have fired
    assert max(seconds) < COLLECTIVE_TIMEOUT_S, seconds


def test_doctor_names_the_first_disagreement(outcomes, recorder_dir, capsys):
    assert sorted(p.name for p in recorder_dir.glob("rank*.json")) == [
        "rank0.json",
        "rank1.json",
    ]
    assert cli.main(["doctor", str(recorder_dir)]) == 0
    out = capsys.readouterr().out
    lines = {line.split(":")[0].strip(" *"): line for line in out.splitlines()}
    skip = lines["group 'm-skip' #1"]
    assert "rank 0: all_reduce #1" in skip and "rank 1: broadcast #1" in skip, out
    zero = lines["group 'm-zero_state_dict_on_rank0' #4"]
    assert "rank 0: all_gather #4" in zero and "rank 1: reduce_scatter #4" in zero, out
    assert "int32" in lines["group 'm-int32_vs_float32' #1"], out
    assert "CollectiveMismatch" in out  # each rank's reason
