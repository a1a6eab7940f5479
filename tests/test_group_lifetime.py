"""Groups do not accumulate: ``plait.destroy_group``, ``Mesh.destroy`` and the rank pool,
which destroys a run's groups before it answers (issue 43 item 1). Every kept pool of the
suite is also checked after each run (``tests/conftest.py``, THREAD_SLACK)."""

from __future__ import annotations

from tests import groups_fns

GLOO_THREADS_PER_GROUP = 3  # a TCP loop and two run loops, until the group is destroyed


def test_a_pool_run_leaves_no_group_behind(ranks):
    ranks(2, groups_fns.many_groups, 2)  # first use starts the service threads that stay
    pool_before = _pool_threads(ranks)
    inside = ranks(2, groups_fns.many_groups, 40)
    after = _pool_threads(ranks)
    # inside the run the 42 groups were alive: at least 3 threads each on top
    for rank in range(2):
        made = 40 * GLOO_THREADS_PER_GROUP
        assert inside[rank] >= pool_before[rank] + made, (inside, pool_before)
    # and once the run answered, not one group's threads were left
    assert after == pool_before, (pool_before, after)


def test_destroy_group_and_mesh_free_their_threads_and_name_later_use(ranks):
    for r in ranks(2, groups_fns.destroyed_by_hand, 10):
        assert r["with_groups"] >= r["before"] + 10 * GLOO_THREADS_PER_GROUP, r
        assert r["after_groups"] <= r["before"], r
        assert r["with_mesh"] > r["after_groups"], r
        assert r["after_mesh"] <= r["before"], r
        assert r["live"] == 0, r
        assert "group 'hand0' (ranks [0, 1]) was destroyed on rank" in r["errors"]["group"], r
        assert "was destroyed (Mesh.destroy)" in r["errors"]["mesh"], r
        assert "the world group is left by plait.shutdown()" in r["errors"]["world"], r


def _pool_threads(ranks) -> list[int]:
    from tests.conftest import _pool

    return _pool(2).threads()
