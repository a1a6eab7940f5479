"""Healing data-parallel training (plait/heal): the pieces without processes, the block
exchange on kept ranks, and two whole fault runs (fresh processes: a rank is killed)."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from plait.heal import blocks
from plait.heal.membership import KEY, Excluded, Membership, _decide
from plait.strategies.reproducible.tree import TreeSum, tree_sum


def test_assign_keeps_own_blocks_and_spreads_the_dead_ones():
    assert blocks.assign((0, 1, 2, 3), 4) == {0: [0], 1: [1], 2: [2], 3: [3]}
    assert blocks.assign((0, 1, 3), 4) == {0: [0, 2], 1: [1], 3: [3]}
    assert blocks.assign((1, 3), 8) == {1: [1, 0, 4, 6], 3: [3, 2, 5, 7]}
    owned = blocks.assign((5,), 8)
    assert sorted(owned[5]) == list(range(8))
    with pytest.raises(ValueError, match="no live member"):
        blocks.assign((), 4)


def test_block_sums_in_block_order_equal_the_full_tree():
    """A survivor that sums two subtrees, then the top levels over block index, gives the
    bits of the tree over every micro-batch (float32 leaves, where order shows)."""
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(1000, generator=g) * 10 ** (i % 5) for i in range(16)]
    per = 4
    partials = []
    for v in range(4):
        acc = TreeSum()
        for leaf in leaves[v * per : (v + 1) * per]:
            acc.push(leaf)
        partials.append(acc.result())
    assert torch.equal(tree_sum(partials), tree_sum(leaves))
    assert not torch.equal(sum(partials[1:], partials[0]), tree_sum(leaves))  # order shows


def _exchange(members_blocks: dict[int, list[int]]) -> list[bool]:
    import plait

    w = plait.world()
    g = torch.Generator().manual_seed(1)
    parts = [torch.randn(37, generator=g, dtype=torch.float32) * 1e3 for _ in range(4)]
    owned = {s: list(v) for s, v in members_blocks.items()}
    mine = {v: parts[v] for v in owned[w.rank]}
    out = blocks.block_tree_all_reduce(mine, owned=owned, world=4, group=w)
    return [torch.equal(out, tree_sum(parts))]


def test_block_tree_all_reduce_with_members_holding_two_blocks(ranks):
    # 2 live ranks of a 4-slot job: each computes its own block and a dead slot's
    assert ranks(2, _exchange, {0: [0, 3], 1: [1, 2]}) == [[True]] * 2


def _bucketed(cuts: list[int]) -> list[bool]:
    """The exchange in pieces (one asynchronous call per bucket, all in flight at once)
    gives the bits of one call on the whole vector."""
    import plait

    w = plait.world()
    g = torch.Generator().manual_seed(2)
    parts = [torch.randn(41, generator=g, dtype=torch.float32) * 1e3 for _ in range(4)]
    owned = {0: [0, 3], 1: [1, 2]}
    total = torch.empty(41)
    handles = [
        blocks.start_block_exchange(
            {v: parts[v][lo:hi] for v in owned[w.rank]},
            total[lo:hi],
            owned=owned,
            world=4,
            group=w,
            async_op=True,
        )
        for lo, hi in zip(cuts, cuts[1:], strict=False)
    ]
    for h in handles:
        h.wait()
    return [torch.equal(total, tree_sum(parts))]


def test_block_exchange_in_buckets_in_flight_together_equals_the_tree(ranks):
    assert ranks(2, _bucketed, [0, 1, 20, 33, 41]) == [[True]] * 2


def test_buckets_walk_the_parameters_in_reverse_and_the_first_carries_the_extra():
    from plait.heal.buckets import plan

    cut = plan([4, 3, 5], extra=2, bucket_elements=6)
    assert [(b.lo, b.hi, b.params) for b in cut] == [(7, 14, [2]), (0, 7, [1, 0])]
    whole = plan([4, 3, 5], extra=2, bucket_elements=10**9)
    assert [(b.lo, b.hi, b.params) for b in whole] == [(0, 14, [2, 1, 0])]
    each = plan([4, 3, 5], extra=2, bucket_elements=1)
    assert [(b.lo, b.hi) for b in each] == [(7, 14), (4, 7), (0, 4)]


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield server


def _member(store, slot, world=4, hb=60.0):
    client = dist.TCPStore(
        "127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10)
    )
    return Membership(client, slot=slot, world=world, heartbeat_timeout=hb, timeout=10)


def test_decision_takes_the_most_advanced_state():
    gen = _decide(3, {0: 5, 1: 4, 3: 5})
    assert gen.members == (0, 1, 3) and gen.done == 5
    assert gen.source == 0 and gen.receivers == (1,)


def test_agreement_drops_a_slot_that_left_and_excludes_a_late_one(store):
    members = [_member(store, s) for s in range(4)]
    members[2].leave()
    results = {}

    def agree(m):
        results[m.slot] = m.agree(1, (0, 1, 2, 3), 7)

    threads = [threading.Thread(target=agree, args=(members[s],)) for s in (0, 1, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert {s: r.members for s, r in results.items()} == {s: (0, 1, 3) for s in (0, 1, 3)}
    assert members[0].store.check([f"{KEY}/current"])
    with pytest.raises(Excluded, match="slot 2 is not a member of generation 1"):
        members[2].agree(1, (0, 1, 2, 3), 7)


def test_a_replacement_is_asked_for_once_and_admitted(store):
    leader, joiner = _member(store, 0), _member(store, 2)
    assert leader.pending_joins((0, 1, 3)) == 0
    joiner.request_join()
    assert leader.pending_joins((0, 1, 3)) == 1 << 2
    assert leader.dead(2, 0.0)  # a replacement asks for slot 2: the old process is gone
    leader.admit((2,), 5)
    assert joiner.wait_admitted() == 5
    assert leader.pending_joins((0, 1, 2, 3)) == 0


def _refused():
    import plait
    from plait.heal import HealingTrainer
    from plait.strategies.tensor.layers import ColumnParallelLinear

    model = torch.nn.Sequential(ColumnParallelLinear(4, 4, group=plait.world()))
    try:
        HealingTrainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn=torch.nn.functional.mse_loss,
            microbatch_size=1,
            world=2,
            address="127.0.0.1:1",
            slot=0,
        )
    except ValueError as exc:
        return str(exc)
    return "not refused"


def test_tensor_parallel_ranks_are_refused_naming_the_replica_trainer(ranks):
    (message,) = ranks(1, _refused)
    assert "ColumnParallelLinear: tensor parallelism" in message
    assert "plait.heal.ReplicaTrainer" in message and "--max-restarts" in message


# --- whole runs: fresh processes, a rank killed (more in test_heal_faults.py, slow) -----
def _run(tmp_path, **kw):
    from plait.demo.heal import HealConfig, max_diff, reference, run

    c = HealConfig(**kw)
    report = run(c, str(tmp_path), deadline=60)
    return c, report, max_diff(report, reference(c))


def test_a_killed_rank_is_healed_around_bitwise(tmp_path):
    c, report, diff = _run(tmp_path, faults=[[2, 3, 5, "kill"]], rejoin=False, steps=5)
    assert report.codes[2] == [-9] and all(report.codes[s] == [0] for s in (0, 1, 3))
    assert sorted(report.finals) == ["slot0", "slot1", "slot3"]
    for r in report.records:
        assert [(h["kind"], h["to"], h["at_step"]) for h in r["heals"]] == [
            ("shrink", [0, 1, 3], 3)
        ]
    assert diff == 0.0  # torch.equal to one process, hence to the uninterrupted run


def test_a_killed_rank_is_healed_around_bitwise_with_one_bucket_per_parameter(tmp_path):
    """Every parameter its own bucket, each exchanged during the last backward while the
    next gradients are computed: still torch.equal to one process, through a kill."""
    c, report, diff = _run(
        tmp_path, faults=[[1, 2, 3, "kill"]], rejoin=False, steps=4, bucket_mb=1e-6
    )
    assert sorted(report.finals) == ["slot0", "slot2", "slot3"]
    # the generations' groups carry their messages by shared memory on one host (unless
    # the suite runs with PLAIT_TRANSPORT=gloo)
    from plait.comm import transport

    local = transport.parse_mode(None) != "gloo"
    assert all(r["shared_memory"] == local for r in report.records)
    assert diff == 0.0


def test_a_replacement_joins_and_the_run_ends_bitwise_at_full_size(tmp_path):
    c, report, diff = _run(
        tmp_path, faults=[[1, 2, 2, "kill"]], rejoin=True, rejoin_step=3, steps=5
    )
    assert sorted(report.finals) == ["slot0", "slot1-join", "slot2", "slot3"]
    assert all(r["members"] == [0, 1, 2, 3] for r in report.records)
    kinds = [h["kind"] for h in report.records[0]["heals"]]
    assert kinds == ["shrink", "grow"]
    assert diff == 0.0


# --- ZeRO-1/2 under healing: chunks, mirrors, refusals, one whole run -------------------
def test_zero_chunks_cut_like_the_exchange_and_each_is_mirrored_by_its_predecessor():
    from plait.heal.zero import bounds, held_chunks

    assert bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert held_chunks(0, 1) == [0]
    holders = {c: [r for r in range(4) if c in held_chunks(r, 4)] for c in range(4)}
    assert holders == {0: [0, 3], 1: [0, 1], 2: [1, 2], 3: [2, 3]}  # owner and mirror


def test_zero_refuses_what_it_cannot_shard_by_name():
    from plait.heal.zero import ShardedState

    model = torch.nn.Linear(3, 2)
    two = torch.optim.Adam([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.1}])
    with pytest.raises(ValueError, match="2 parameter groups"):
        ShardedState(two, list(model.parameters()))
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(ValueError, match="LBFGS"):
        ShardedState(lbfgs, list(model.parameters()))


def test_a_killed_rank_is_healed_around_bitwise_under_zero1(tmp_path):
    """Slot 2 dies in step 2: its shard of the Adam state lives on in slot 1's mirror, the
    survivors re-shard among three and end torch.equal to one process."""
    c, report, diff = _run(tmp_path, faults=[[2, 2, 5, "kill"]], rejoin=False, steps=3, zero=1)
    assert report.codes[2] == [-9] and sorted(report.finals) == ["slot0", "slot1", "slot3"]
    for r in report.records:
        assert [(h["kind"], h["to"]) for h in r["heals"]] == [("shrink", [0, 1, 3])]
    assert diff == 0.0


@pytest.mark.parametrize("victim", [1, 3])
def test_zero_a_member_one_step_ahead_goes_back_and_redoes_the_kept_batch(tmp_path, victim):
    """Forced: the victim stops after stepping its chunks of step 2, before sending them,
    and dies only once its predecessor has started step 3. The predecessor needs nothing
    from the victim in the gather (it mirrors the victim's chunk), so it finished step 2;
    the two others wait for the victim's chunk and fail. Healing, the predecessor is one
    whole step ahead: it restores its copy of its chunks, goes back to step 2, redoes it
    from the batch it kept, then step 3. torch.equal to one process."""
    from plait.comm import transport
    from plait.heal.trainer import GATHERING

    if transport.parse_mode(None) == "gloo":
        pytest.skip(
            "PLAIT_TRANSPORT=gloo: a gloo send completes only once its peer posted the "
            "receive, so the predecessor cannot finish the gather while the victim is held "
            "before it; the forcing needs shared memory (the default on one host)"
        )
    ahead = (victim - 1) % 4
    c, report, diff = _run(
        tmp_path,
        faults=[[victim, 2, GATHERING, "kill", [ahead, 3]]],
        rejoin=False,
        steps=4,
        zero=1,
    )
    assert sorted(report.finals) == [f"slot{s}" for s in range(4) if s != victim]
    returned = {r["slot"]: r["returned"] for r in report.records}
    assert returned == {s: int(s == ahead) for s in range(4) if s != victim}
    for r in report.records:  # every survivor healed at step 2 (the one ahead went back)
        assert [(h["kind"], h["at_step"]) for h in r["heals"]] == [("shrink", 2)]
    assert diff == 0.0


def test_plait_run_heal_refuses_the_restart_options_by_name(capsys):
    from plait.cli import main

    argv = ["run", "-n", "2", "--heal", "1", "--max-restarts", "2", "examples/heal_train.py"]
    assert main(argv) == 2
    assert "--heal does not combine with --max-restarts" in capsys.readouterr().err


def test_zero_chunk_steps_equal_the_users_optimizer_and_follow_its_lr():
    """One member (one chunk): the flat chunk's Adam steps, with the lr changed on the user's
    optimizer between steps (as a scheduler does), give the bits of that optimizer on the
    model (float32)."""
    from plait.heal.zero import ShardedState

    torch.manual_seed(0)
    a, b = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.Adam(a.parameters(), lr=0.1)
    opt_b = torch.optim.Adam(b.parameters(), lr=0.1)
    sharded = ShardedState(opt_b, list(b.parameters()))
    sharded.start((0,), 0, 0)
    for step in range(3):
        total = torch.randn(18, generator=torch.Generator().manual_seed(step))
        offset = 0
        for p in a.parameters():
            p.grad = total[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        opt_a.step()
        sharded.step(total, torch.tensor(0.0))
        sharded.gather(None)  # one member: nothing to send
        for opt in (opt_a, opt_b):  # what a scheduler does between steps
            opt.param_groups[0]["lr"] *= 0.5
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_zero_restore_returns_the_chunks_to_before_the_last_step():
    """What a member one step ahead does when healing: its chunks (values and Adam state)
    go back bitwise to where they were before its last step, and the loss with them."""
    from plait.heal.zero import ShardedState

    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    sharded = ShardedState(torch.optim.Adam(model.parameters(), lr=0.1), list(model.parameters()))
    sharded.start((0,), 0, 0)
    g = torch.Generator().manual_seed(0)
    sharded.step(torch.randn(18, generator=g), torch.tensor(1.0))
    sharded.gather(None)
    (opt,) = sharded.held.values()
    (chunk,) = opt.param_groups[0]["params"]
    before = chunk.detach().clone(), {k: v.clone() for k, v in opt.state[chunk].items()}
    sharded.step(torch.randn(18, generator=g), torch.tensor(2.0))
    assert not torch.equal(chunk, before[0])
    assert sharded.restore().item() == 2.0  # last_loss as it was before the undone step
    assert torch.equal(chunk, before[0]) and not sharded.pending
    assert all(torch.equal(opt.state[chunk][k], v) for k, v in before[1].items())
