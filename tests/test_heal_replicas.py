"""Healing the dp dimension of PTD-P (plait/heal/replicas.py): a replica is a whole
pp x tp group; one of its ranks dies, the replica leaves whole, the others go on and a
replacement replica joins; the parameters end torch.equal to the uninterrupted run.

The membership per replica runs without processes; the whole jobs (fresh processes, one
killed) are slow tests (tests/conftest.py's SLOW)."""

from __future__ import annotations

import datetime
import threading

import numpy as np
import pytest
import torch.distributed as dist

from plait.heal.membership import Excluded, Membership


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield server


def _member(store, slot, world=4, size=2):
    client = dist.TCPStore(
        "127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10)
    )
    return Membership(
        client, slot=slot, world=world, heartbeat_timeout=60.0, timeout=10, replica_size=size
    )


def test_a_replica_with_one_dead_rank_is_out_whole_and_its_live_rank_is_excluded(store):
    """Slot 3 left: replica 1 (slots 2, 3) is out without waiting for slot 2 (alive,
    beating, not checked in), and slot 2 checking in afterwards is excluded by name."""
    members = [_member(store, s) for s in range(4)]
    for m in members:
        m.beat()
    members[3].leave()
    results = {}

    def agree(m):
        results[m.slot] = m.agree(1, (0, 1, 2, 3), 7)

    threads = [threading.Thread(target=agree, args=(members[s],)) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert {s: r.members for s, r in results.items()} == {0: (0, 1), 1: (0, 1)}
    with pytest.raises(Excluded, match=r"its replica \(slots \[2, 3\]\) lost a rank"):
        members[2].agree(1, (0, 1, 2, 3), 7)


def test_a_replica_is_waited_for_until_all_its_ranks_checked_in(store):
    """No rank dead: the decision waits for every slot of every replica (here slot 3
    checks in last) and takes the most advanced state, replica by replica."""
    members = [_member(store, s) for s in range(4)]
    for m in members:
        m.beat()
    results = {}

    def agree(m, done):
        results[m.slot] = m.agree(1, (0, 1, 2, 3), done)

    threads = [
        threading.Thread(target=agree, args=(members[s], d)) for s, d in ((0, 4), (1, 4), (2, 5))
    ]
    for t in threads:
        t.start()
    threads[0].join(0.5)
    assert not results  # slot 3 has not checked in, and it is alive: no decision yet
    agree(members[3], 5)
    for t in threads:
        t.join(10)
    gen = results[0]
    assert gen.members == (0, 1, 2, 3) and gen.done == 5
    assert gen.receivers == (0, 1) and gen.source == 2  # replica 1 finished the step


def test_every_replica_lost_is_said_plainly(store):
    members = [_member(store, s) for s in range(4)]
    for m in members:
        m.beat()
    members[1].leave()
    members[3].leave()
    with pytest.raises(RuntimeError, match="every replica lost a rank"):
        members[0].agree(1, (0, 1, 2, 3), 3)


def test_replica_settings_are_checked_before_any_process_group():
    from plait.heal.replicas import ReplicaTrainer
    from plait.strategies.reproducible.tree import LayoutError

    with pytest.raises(LayoutError, match="12 ranks in replicas of 4"):
        ReplicaTrainer(
            lambda mesh: None, replica={"pp": 2, "tp": 2}, world=12, address="x:1", rank=0
        )
    with pytest.raises(ValueError, match="the data-parallel one is the replicas themselves"):
        ReplicaTrainer(
            lambda mesh: None, replica={"pp": 2, "dp": 2}, world=8, address="x:1", rank=0
        )


def test_layers_that_draw_random_numbers_are_named():
    """A survivor computing a lost replica's block draws its own numbers: said at once."""
    import torch

    from plait.heal.model_checks import warn_random as _warn_random
    from plait.moe import MoE

    with pytest.warns(UserWarning, match=r"Dropout\(p=0.1\)"):
        _warn_random(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1)), 0)
    moe = MoE(8, num_experts=2, top_k=2, second_expert="random")
    with pytest.warns(UserWarning, match="second_expert='random'"):
        _warn_random(torch.nn.Sequential(moe), 0)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_random(torch.nn.Sequential(torch.nn.Dropout(0.0)), 0)
        _warn_random(torch.nn.Sequential(MoE(8, num_experts=2, second_expert="all")), 0)


# --- whole jobs: fresh processes (slow) ---------------------------------------------------
_UNINTERRUPTED: dict[tuple[int, ...], np.ndarray] = {}


def _job(tmp_path, **kw):
    from plait.demo.heal_replicas import ReplicaConfig, reference, run

    c = ReplicaConfig(**kw)
    report = run(c, str(tmp_path / "faulted"), deadline=240)
    key = (c.replicas, c.pp, c.tp, c.ep, c.cp, c.steps, c.batch)
    if key not in _UNINTERRUPTED:  # the same job without a fault (once per layout)
        clean = ReplicaConfig(
            replicas=c.replicas,
            pp=c.pp,
            tp=c.tp,
            ep=c.ep,
            cp=c.cp,
            steps=c.steps,
            batch=c.batch,
            rejoin=False,
        )
        whole = run(clean, str(tmp_path / "uninterrupted"), deadline=240)
        assert all(codes == [0] for codes in whole.codes.values()), whole.codes
        finals = list(whole.finals.values())
        assert len(finals) == c.world and all(np.array_equal(f, finals[0]) for f in finals)
        # and that job is one process's training to float64 rounding (the layout differs)
        assert np.abs(finals[0] - reference(clean)).max() < 1e-12
        _UNINTERRUPTED[key] = finals[0]
    return report, _UNINTERRUPTED[key]


def _equal_everywhere(report, uninterrupted):
    return all(np.array_equal(v, uninterrupted) for v in report.finals.values())


def test_job_a_killed_pipeline_rank_takes_its_replica_out_and_the_others_go_on_bitwise(
    tmp_path,
):
    """Four replicas of two pipeline stages (8 processes); rank 5 (replica 2's second
    stage) is killed in step 2: rank 4 finds its replica lost and leaves, replica 0 adds
    replica 2's block to its own, and the tree over the 4 blocks keeps the bits of the
    uninterrupted job (an order over live replicas would not: ((0+1)+(2+3)) is not
    ((0+2)+1)+3)."""
    report, whole = _job(
        tmp_path, replicas=4, batch=16, faults=[[5, 2, 2, "kill"]], rejoin=False, steps=4
    )
    assert report.codes[5] == [-9] and report.codes[4] == [1]
    assert sorted(report.finals) == [f"rank{s}" for s in (0, 1, 2, 3, 6, 7)]
    for r in report.records:
        assert [(h["kind"], h["to"], h["at_step"]) for h in r["heals"]] == [
            ("shrink", [0, 1, 2, 3, 6, 7], 2)
        ]
    assert _equal_everywhere(report, whole)


def test_job_a_replacement_replica_joins_and_the_job_ends_bitwise_at_full_size(tmp_path):
    report, whole = _job(
        tmp_path,
        replicas=4,
        batch=16,
        faults=[[2, 1, 1, "kill"]],
        rejoin=True,
        rejoin_step=2,
        steps=4,
    )
    joined = ["rank2-join", "rank3-join"]
    assert sorted(report.finals) == sorted([f"rank{s}" for s in (0, 1, 4, 5, 6, 7)] + joined)
    assert all(r["members"] == list(range(8)) for r in report.records)
    kinds = [(h["kind"], h["to"]) for h in report.records[0]["heals"]]
    assert kinds == [("shrink", [0, 1, 4, 5, 6, 7]), ("grow", list(range(8)))]
    assert _equal_everywhere(report, whole)


def test_job_a_tensor_parallel_replica_heals_too_and_a_raise_counts_as_a_death(tmp_path):
    """Replicas of tp=2: rank 1 (replica 0's second tp rank) raises in step 1; replica 0
    leaves (slot 0, then the leader, is gone: replica 1 leads), its replacement joins."""
    report, whole = _job(
        tmp_path, pp=1, tp=2, faults=[[1, 1, 0, "raise"]], rejoin=True, rejoin_step=2, steps=4
    )
    assert report.codes[1][0] == 1 and report.codes[0][0] == 1
    assert sorted(report.finals) == ["rank0-join", "rank1-join", "rank2", "rank3"]
    assert _equal_everywhere(report, whole)


def test_job_a_second_replica_lost_while_the_first_heals_still_ends_bitwise(tmp_path):
    """Rank 5 (replica 2) is killed in step 2; rank 3 (replica 1) dies as it starts
    healing: replicas 0 and 3 go on with two blocks each."""
    report, whole = _job(
        tmp_path,
        replicas=4,
        batch=16,
        faults=[[5, 2, 2, "kill"], [3, 2, -1, "kill"]],
        rejoin=False,
        steps=4,
    )
    assert sorted(report.finals) == ["rank0", "rank1", "rank6", "rank7"]
    assert all(r["members"] == [0, 1, 6, 7] for r in report.records)
    assert _equal_everywhere(report, whole)


def test_job_a_frozen_rank_and_a_replacement_dead_on_arrival(tmp_path):
    """Rank 3 freezes (SIGSTOP) in step 1: its replica-mate and the position-1 peer find
    it by the heartbeat, the replica leaves; the replacement's rank 3 dies on arrival: the
    survivors' grown generation fails to connect and they go on alone, bitwise."""
    report, whole = _job(
        tmp_path,
        faults=[[3, 1, 1, "stop"]],
        rejoin_faults=[[3, -1, -2, "kill"]],
        rejoin=True,
        rejoin_step=2,
        steps=4,
        heartbeat_timeout=2.0,
        connect_timeout=5.0,
    )
    assert sorted(report.finals) == ["rank0", "rank1"]
    assert all(r["members"] == [0, 1] for r in report.records)
    causes = [h["cause"] for r in report.records for h in r["heals"] if h["kind"] == "shrink"]
    assert any("PeerUnresponsive" in c or "CollectiveError" in c for c in causes), causes
    assert _equal_everywhere(report, whole)


def test_job_experts_split_over_ep_inside_a_replica_heal_bitwise(tmp_path):
    """Replicas of ep=2 (the GPT's MoE block's 4 experts split over 2 ranks): rank 3 is
    killed in step 1, its replica replaced; bitwise to the uninterrupted job."""
    report, whole = _job(
        tmp_path, pp=1, ep=2, faults=[[3, 1, 1, "kill"]], rejoin=True, rejoin_step=2, steps=4
    )
    assert sorted(report.finals) == ["rank0", "rank1", "rank2-join", "rank3-join"]
    assert _equal_everywhere(report, whole)


def test_job_context_parallel_replicas_heal_bitwise(tmp_path):
    """Replicas of cp=2 (each sequence split over 2 ranks, ring attention)."""
    report, whole = _job(tmp_path, pp=1, cp=2, faults=[[2, 2, 1, "kill"]], rejoin=False, steps=4)
    assert sorted(report.finals) == ["rank0", "rank1"]
    assert _equal_everywhere(report, whole)
