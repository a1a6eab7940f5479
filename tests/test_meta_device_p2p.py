"""The pipeline's messages under NCCL's ordering, simulated on the schedules' plain data
(``tests/meta_device_p2p.py``): what the fake backend cannot show, since its messages
complete at once."""

from __future__ import annotations

import pytest

import plait
from plait.strategies.pipeline.schedules import SCHEDULES, build
from tests.meta_device_p2p import stuck

SIZES = [(2, 4), (4, 8)]


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p,m", SIZES)
def test_every_schedule_completes_with_a_stream_per_direction(name, p, m):
    schedule = build(name, p=p, m=m)
    assert stuck(schedule, per_direction=True) == []
    assert stuck(schedule, blocking=False, per_direction=True) == []


@pytest.mark.parametrize("name", SCHEDULES)
def test_one_stream_per_pair_deadlocks_every_schedule_on_two_ranks(name):
    """Why the pipeline does not put both directions on one group on NCCL: with its
    receives posted early on the pair's one stream, the first early receive blocks the
    send its peer waits for. The gloo and shared-memory transports match by tag and are
    not affected (one group there)."""
    left = stuck(build(name, p=2, m=4))
    assert left and any("RECV" in a for a in left)


def test_the_pipeline_sends_each_direction_on_its_own_group_on_a_device_backend():
    """What the simulation's ``per_direction`` assumes is what the Link does: on the fake
    backend (a device backend) a message to a lower pp rank takes the pp group's reverse
    twin, made once and destroyed with the group; on gloo one group carries both."""
    from plait import runtime
    from plait.strategies.pipeline.messages import Link
    from tests.meta_device_fns import fake_world

    with fake_world(4):
        mesh = plait.Mesh(pp=4, ranks=range(4))
        pp = mesh.group("pp")
        link = Link(pp, None)
        twin = pp.reverse
        assert link.per_direction and twin is not None and twin is not pp
        assert twin.ranks == pp.ranks and twin.rank == pp.rank
        assert Link(pp, None).groups == (pp, twin)  # made once per group
        assert link.channel("pp_activation", 1, 0, 1).group is pp
        assert link.channel("pp_gradient", 2, 1, 0).group is twin
        assert twin in runtime.live_groups()
        mesh.destroy()
        assert twin.destroyed and twin not in runtime.live_groups()
