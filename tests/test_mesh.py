"""plait.Mesh: the rank layout (pure, against Megatron's documented example) and groups."""

from __future__ import annotations

import pytest

from plait.mesh import layout
from tests import mesh_fns
from tests.faultlog import record


def test_megatron_16_rank_example():
    # Megatron-LM parallel_state docstring: 16 GPUs, t=2, p=4 (so d=2).
    lay = layout(16, {"tp": 2, "pp": 4, "dp": -1})
    assert lay.size("dp") == 2
    assert lay.groups("tp") == [[2 * i, 2 * i + 1] for i in range(8)]  # [0,1], [2,3], ...
    assert lay.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert lay.groups("dp")[:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("dp")[4:] == [[8, 10], [9, 11], [12, 14], [13, 15]]


def test_keyword_order_does_not_change_ptdp_order():
    a = layout(8, {"pp": 2, "dp": 2, "tp": 2})
    b = layout(8, {"tp": 2, "dp": 2, "pp": 2})
    assert a == b
    assert a.names == ("pp", "dp", "tp")
    assert a.coords(5) == {"pp": 1, "dp": 0, "tp": 1}
    assert a.groups("dp", "tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_explicit_order_and_ranks():
    lay = layout(4, {"dp": 2, "tp": 2}, order=("dp", "tp"), ranks=[10, 11, 12, 13])
    assert lay.groups("dp") == [[10, 11], [12, 13]]  # dp innermost now
    assert lay.groups("tp") == [[10, 12], [11, 13]]
    assert "rank  12" in lay.table()


@pytest.mark.parametrize(
    ("dims", "needle"),
    [
        ({"dp": 3, "tp": 2}, "mesh dp=3 x tp=2 = 6 ranks, but the world has 8"),
        ({"dp": -1, "tp": 3}, "8 ranks are not a multiple of tp=3 = 3"),
        ({"dp": -1, "tp": -1}, "only one mesh dimension may be -1"),
        ({"tp": 0}, "tp=0"),
    ],
)
def test_refuses_sizes_that_do_not_factor(dims, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        layout(8, dims)


def test_two_meshes_in_one_process(ranks):
    results = ranks(4, mesh_fns.two_meshes, timeout=120)
    for r, res in enumerate(results):
        tp_ranks, tp_rank, tp_size, tp_sum = res["a"]["tp"]
        assert tp_ranks == [r - r % 2, r - r % 2 + 1] and tp_rank == r % 2 and tp_size == 2
        assert tp_sum == sum(tp_ranks)
        dp_ranks, dp_rank, _, dp_sum = res["a"]["dp"]
        assert dp_ranks == [r % 2, r % 2 + 2] and dp_rank == r // 2 and dp_sum == sum(dp_ranks)
        assert res["b"]["tp"] == ([0, 1, 2, 3], r, 4, 6.0)
        assert res["flat"] == ([0, 1, 2, 3], 4.0)
        assert "rank   3  dp=1 tp=1" in res["text"]


# the meshes' own timeout in the test below: the agreement and the group creation of a
# mesh wait at most this long; the pool's run timeout (2x) is the hang guard
MESH_TIMEOUT_S = 60.0


@pytest.mark.faults
def test_a_rank_building_another_mesh_is_named_before_any_group(ranks):
    """Issue 26 item 9: one rank building another mesh waited in process-group creation
    until the collective timeout, then a store key timeout that named no mesh."""
    errors = ranks(4, mesh_fns.another_mesh_on_rank, 3, MESH_TIMEOUT_S, timeout=2 * MESH_TIMEOUT_S)
    took = max(seconds for _, seconds in errors)  # inside the ranks: pool start-up apart
    for r, (text, _) in enumerate(errors):  # a ValueError: a timeout would be a RankError
        assert "the ranks disagree on mesh number" in text, (r, text)
        assert "ranks [0, 1, 2] built Mesh(pp=2, tp=2) over ranks [0, 1, 2, 3]" in text, text
        assert "ranks [3] built Mesh(pp=4) over ranks [0, 1, 2, 3]" in text, text
    # named before the meshes' timeout would have fired (the old behaviour waited it out)
    assert took < MESH_TIMEOUT_S, took
    # the world still works: the next meshes agree
    assert ranks(4, mesh_fns.two_meshes, timeout=120)[0]["b"]["tp"][2] == 4
    record(
        row=26,
        fault="#9 one rank builds another mesh (pp=4 vs pp=2 x tp=2)",
        detected_after_s=round(took, 2),
        named_correctly=True,
        note="agreed through the store before any process group is created (slowest rank)",
    )
