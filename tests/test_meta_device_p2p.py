"""The pipeline's messages under NCCL's ordering, simulated on the schedules' plain data
(``tests/meta_device_p2p.py``): what the fake backend cannot show, since its messages
complete at once."""

from __future__ import annotations

import pytest

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
    """How the runtime posts messages today (receives early, on the pair's one NCCL
    stream): the first early receive blocks the send its peer waits for. The gloo and
    shared-memory transports match by tag and are not affected."""
    left = stuck(build(name, p=2, m=4))
    assert left and any("RECV" in a for a in left)
