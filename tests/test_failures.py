"""Nothing hangs: timeouts, mismatches, crashes and bad functions are named."""

from __future__ import annotations

import pytest

import plait
from plait import RankError, RankTimeout
from tests import rank_fns


@pytest.mark.parametrize("algorithm", ["ring", "naive", "native"])
def test_rank_that_skips_a_collective_is_named(algorithm):
    results = plait.spawn(
        rank_fns.skip_collective,
        world_size=3,
        args=(1, algorithm, 3.0),  # the world's timeout, set once every rank has started
        timeout=120,
    )
    assert results[1] == "skipped"
    for r in (0, 2):
        kind, missing, message = results[r]
        assert "all_reduce #2" in message and "'world'" in message, message
        # naive: rank 2 waits on the root, rank 0, which waits on rank 1; whichever times
        # out first publishes its verdict before ending the other's wait, so both name rank 1
        assert kind == "CollectiveTimeout", (r, message)
        assert missing == [1], message


def test_debug_mode_names_the_rank_with_another_shape():
    results = plait.spawn(
        rank_fns.mismatched_shape,
        world_size=3,
        args=(2,),
        debug=True,
        collective_timeout=10,
        timeout=60,
    )
    for kind, disagreeing, message in results:  # every rank raises, none hangs
        assert kind == "CollectiveMismatch"
        assert disagreeing == [2]
        assert "shape=(5,)" in message and "shape=(4,)" in message


def test_debug_mode_names_a_rank_that_never_arrives():
    results = plait.spawn(
        rank_fns.skip_collective,
        world_size=3,
        args=(0, "ring", 3.0),
        debug=True,
        timeout=120,
    )
    for r in (1, 2):
        kind, missing, message = results[r]
        assert kind == "CollectiveTimeout" and missing == [0], message


def test_spawn_returns_results_in_rank_order():
    results = plait.spawn(rank_fns.rank_and_env, world_size=3, timeout=60)
    assert results == [(0, 3, "0", "gloo"), (1, 3, "1", "gloo"), (2, 3, "2", "gloo")]


def test_spawn_reraises_with_rank_and_traceback():
    with pytest.raises(RankError) as info:
        plait.spawn(rank_fns.fail_on, world_size=2, args=(1,), timeout=60)
    assert info.value.rank == 1
    assert isinstance(info.value.__cause__, KeyError)
    assert "fail_on" in info.value.remote_traceback
    assert "deliberate failure" in str(info.value)


def test_spawn_names_a_rank_that_dies():
    with pytest.raises(RankError, match="rank 1 failed.*exit code 3"):
        plait.spawn(rank_fns.die_on, world_size=2, args=(1,), timeout=60)


def test_spawn_names_a_rank_that_hangs():
    with pytest.raises(RankTimeout) as info:
        plait.spawn(rank_fns.sleep_on, world_size=3, args=(2, 120.0), timeout=10)
    assert info.value.ranks == [2]


def test_spawn_refuses_functions_new_processes_cannot_import():
    with pytest.raises(ValueError, match="top level of a module"):
        plait.spawn(lambda: 1, world_size=2)


def test_init_without_environment_says_how_to_launch(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="plait run -n N"):
        plait.init()
