"""Healing under FSDP (``HealingTrainer(zero=3)``, plait/heal/fsdp.py): the chunks and the
freed parameters without processes, the mirror reduce-scatter and the gather on kept
ranks, and whole fault runs (fresh processes: ranks are killed; in the slow set,
tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from plait.heal.fsdp import EXTRA, ShardedParams, spans
from plait.heal.zero import bounds
from plait.plan.memory import measure


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 7, dtype=torch.float64),
        torch.nn.Tanh(),
        torch.nn.Linear(7, 3, dtype=torch.float64),
    )


def _numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_the_exchange_is_cut_as_the_chunks_with_the_extras_in_the_last():
    assert spans(10, 3) == [(0, 4), (4, 7), (7, 12)]
    assert spans(10, 3)[:-1] == bounds(10, 3)[:-1]
    assert spans(5, 1) == [(0, 5 + EXTRA)]


def test_at_rest_a_member_holds_its_chunks_only_and_steps_like_the_users_optimizer():
    """One member (one chunk): the model's parameters are freed after start and after each
    step (0 bytes; using one raises), the chunk holds them, and gathering gives the bits of
    the user's Adam on the whole model (float64), step after step."""
    a, b = _mlp(), _mlp()
    opt_a = torch.optim.Adam(a.parameters(), lr=0.1)
    sharded = ShardedParams(torch.optim.Adam(b.parameters(), lr=0.1), list(b.parameters()))
    sharded.start((0,), 0, 0)
    numel = _numel(b)
    held = measure(sharded)  # the model's parameters freed: only the chunk's bytes
    assert held.params_bytes == numel * 8
    with pytest.raises(RuntimeError):
        b(torch.zeros(1, 5, dtype=torch.float64))
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        total = torch.randn(numel + EXTRA, generator=g, dtype=torch.float64)
        offset = 0
        for p in a.parameters():
            p.grad = total[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        opt_a.step()
        sharded.unshard(None)  # one member: nothing to receive
        assert measure(sharded).params_bytes == 2 * numel * 8  # the model's and the chunk
        sharded.step(total, torch.tensor(0.0))
        sharded.free()
        assert measure(sharded).params_bytes == numel * 8
    sharded.unshard(None)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_a_parameter_that_is_a_view_is_refused_by_name():
    model = torch.nn.Linear(4, 4)
    flat = torch.zeros(20)
    model.weight = torch.nn.Parameter(flat[:16].view(4, 4))
    model.bias = torch.nn.Parameter(flat[16:])
    names = {id(p): n for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="parameter weight is a view into a larger storage"):
        ShardedParams(
            torch.optim.SGD(model.parameters(), lr=0.1), list(model.parameters()), names=names
        )


def test_a_model_wrapped_by_plaits_fsdp_is_refused_with_what_to_do():
    from plait.heal import HealingTrainer
    from plait.strategies.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    fully_shard(model)  # one process, no group
    with pytest.raises(
        ValueError, match="wrapped by plait's FSDP .*pass the plain model with zero=3"
    ):
        HealingTrainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn=torch.nn.functional.mse_loss,
            microbatch_size=1,
            world=2,
            address="127.0.0.1:1",  # refused before it connects
            slot=0,
            zero=3,
        )


def _mirror_exchange(owned: dict[int, list[int]], numel: int) -> dict[str, object]:
    import plait
    from plait.heal import blocks

    group = plait.world()
    me, n = group.rank, group.size
    g = torch.Generator().manual_seed(1)
    parts = [torch.randn(numel + EXTRA, generator=g) * 1e3 for _ in range(4)]  # float32
    flat = torch.nn.Parameter(torch.zeros(numel))  # only the count matters here
    sharded = ShardedParams(torch.optim.SGD([flat], lr=0.1), [flat])
    mine = {v: parts[v] for v in owned[me]}
    plait.comm.stats(reset=True)
    out = sharded.exchange(mine, owned=owned, world=4, group=group)
    sent = plait.comm.stats()[("reduce_scatter", "tree_order/blocks_mirror")].bytes_sent
    blocks.block_tree_all_reduce(mine, owned=owned, world=4, group=group)
    sent_all = plait.comm.stats()[("all_reduce", "tree_order/blocks")].bytes_sent
    want = blocks.tree_sum(parts)
    shm = blocks.shared(group)  # the all-reduce's second phase: shared memory or the ring
    cut = spans(numel, n)
    held = [me, (me + 1) % n]
    summed = torch.zeros(numel + EXTRA, dtype=torch.bool)
    for c in held:
        summed[slice(*cut[c])] = True
    summed[-EXTRA:] = True
    return {
        "held exact": torch.equal(out[summed], want[summed]),
        "rest nan": bool(out[~summed].isnan().all()),
        "sent": sent,
        "sent by the all-reduce": sent_all,
        "freed": sharded.gathered is False,
        "shm": shm,
    }


def test_the_exchange_gives_each_member_its_two_chunks_in_the_trees_bits(ranks):
    """4 members, one block each: own and mirrored chunk and the two extras hold the tree
    sum over every block bitwise (float32, where order shows), nothing else is sent; one
    vector out per member against 1.5 for the all-reduce whose second phase is the ring
    (across hosts); on one host its shared-memory all-gather writes each chunk once, 1.0."""
    numel = 37
    out = ranks(4, _mirror_exchange, {s: [s] for s in range(4)}, numel)
    cut = spans(numel, 4)
    for me, r in enumerate(out):
        assert r["held exact"] and r["rest nan"] and r["freed"]
        chunk = cut[me][1] - cut[me][0]
        extras = 2 * EXTRA if me == 3 else 0  # the last chunk's owner tells slots 0 and 1
        assert r["sent"] == 4 * (numel + EXTRA - chunk + chunk + extras)
        even = bounds(numel + EXTRA, 4)[me]  # the all-reduce cuts the whole vector evenly
        part = even[1] - even[0]
        second = part if r["shm"] else 3 * part  # written once, or sent to 3 peers
        assert r["sent by the all-reduce"] == 4 * (numel + EXTRA - part + second)
        if not r["shm"]:
            assert r["sent"] < r["sent by the all-reduce"]


def test_the_exchange_with_members_summing_two_blocks(ranks):
    # 2 live members of a 4-slot job: each computes its own block and a dead slot's
    out = ranks(2, _mirror_exchange, {0: [0, 3], 1: [1, 2]}, 10)
    assert all(r["held exact"] and r["freed"] for r in out)


def _gather_after_start() -> dict[str, object]:
    import plait

    group = plait.world()
    model = _mlp()
    want = [p.detach().clone() for p in model.parameters()]
    sharded = ShardedParams(torch.optim.Adam(model.parameters(), lr=0.1), list(model.parameters()))
    sharded.start(group.ranks, group.rank, 0)
    at_rest = measure(sharded)
    plait.comm.stats(reset=True)
    sharded.unshard(group)
    sent = plait.comm.stats()[("all_gather", "heal/zero")].bytes_sent
    same = all(torch.equal(p, w) for p, w in zip(model.parameters(), want, strict=True))
    return {
        "params bytes": at_rest.params_bytes,
        "grads bytes": at_rest.grads_bytes,
        "same": same,
        "held": sorted(sharded.held),
        "sent": sent,
    }


def test_members_hold_own_and_mirror_chunks_and_gather_the_rest(ranks):
    """At rest each of 4 members holds chunks i and i+1 of the parameters (2/4) and none of
    the model's; gathering sends its own chunk to the two members that hold neither."""
    numel = _numel(_mlp())
    cut = bounds(numel, 4)
    out = ranks(4, _gather_after_start)
    for me, r in enumerate(out):
        assert r["same"] and r["held"] == sorted([me, (me + 1) % 4])
        # the model's parameters hold no storage: what is held is the two chunks
        assert r["params bytes"] == 8 * sum(cut[c][1] - cut[c][0] for c in r["held"])
        assert r["grads bytes"] == 0
        assert r["sent"] == 2 * 8 * (cut[me][1] - cut[me][0])


# --- whole runs: fresh processes, ranks killed (slow set, tests/conftest.py) ------------
def _run(tmp_path, **kw):
    from plait.demo.heal import HealConfig, max_diff, reference, run

    c = HealConfig(zero=3, **kw)
    report = run(c, str(tmp_path), deadline=120)
    diff = max_diff(report, reference(c)) if report.finals else float("inf")
    return report, diff


def _params_held_at_rest(report) -> list[int]:
    """Bytes of parameters each member held after its last step, over those of its two
    chunks (the model's own freed): 1.0 each."""
    cut = bounds(NUMEL, 4)
    out = []
    for r in sorted(report.records, key=lambda r: r["slot"]):
        mine = [r["slot"], (r["slot"] + 1) % 4]
        out.append(r["held"]["params"] / (8 * sum(cut[c][1] - cut[c][0] for c in mine)))
    return out


NUMEL = 16 * 32 + 32 + 32 * 4 + 4  # the demo's float64 MLP: two nn.Linear units
LARGEST_UNIT = 8 * (16 * 32 + 32)


def test_a_killed_rank_is_healed_around_bitwise_under_fsdp(tmp_path):
    """In make test (the rest of the whole runs are in the slow set): slot 2 dies in step
    2, inside the gathers of one unit at a time (the default); its parameter chunk and
    state live on in slot 1's mirror, the survivors re-shard among three (slot 0 computes
    two blocks, the others idle through its second round), hold no full parameter at rest,
    at most the largest unit in a step, and end torch.equal to one process."""
    report, diff = _run(tmp_path, faults=[[2, 2, 5, "kill"]], rejoin=False, steps=4)
    assert report.codes[2] == [-9] and sorted(report.finals) == ["slot0", "slot1", "slot3"]
    cut = bounds(NUMEL, 3)  # among three
    for r in report.records:
        assert [(h["kind"], h["to"]) for h in r["heals"]] == [("shrink", [0, 1, 3])]
        rank = [0, 1, 3].index(r["slot"])  # it holds chunks rank and rank + 1 of 3
        chunks = sum(cut[c][1] - cut[c][0] for c in (rank, (rank + 1) % 3))
        assert r["held"]["params"] == 8 * chunks  # the model's own parameters freed
        assert r["peaks"][-1] == LARGEST_UNIT  # step 3 (step 2 re-shards: the model once)
    assert diff == 0.0


def test_whole_job_fsdp_whole_model_gather_heals_bitwise_too(tmp_path):
    """wrap=None: the whole model gathered at each step's start (its flat vector and the
    parameters: twice the model at the peak); a kill and a replacement, torch.equal."""
    report, diff = _run(
        tmp_path, faults=[[1, 1, 2, "kill"]], rejoin=True, rejoin_step=2, steps=4, wrap=None
    )
    assert len(report.finals) == 4 and "slot1-join" in report.finals
    assert all(r["peaks"][-1] == 2 * 8 * NUMEL for r in report.records)
    assert _params_held_at_rest(report) == [1.0] * 4
    assert diff == 0.0


@pytest.mark.parametrize(
    "slot,step,index",
    [(0, 0, 0), (3, 1, 7), (1, 2, -3)],  # -3: at the step's start, before the gather
)
def test_whole_job_fsdp_kill_then_rejoin_bitwise(tmp_path, slot, step, index):
    """The dead slot's parameter chunk and state come from its mirror, the survivors
    re-shard to 3, the replacement receives its chunks from the holders; every member
    ends holding no full parameter at rest and the run is torch.equal to one process."""
    report, diff = _run(
        tmp_path,
        faults=[[slot, step, index, "kill"]],
        rejoin=True,
        rejoin_step=step + 1,
        steps=step + 3,
    )
    assert len(report.finals) == 4 and f"slot{slot}-join" in report.finals
    assert _params_held_at_rest(report) == [1.0] * 4
    assert diff == 0.0


def test_whole_job_fsdp_a_member_one_step_ahead_goes_back_and_redoes_the_kept_batch(tmp_path):
    """Slot 2 dies in step 2's exchange with its chunk summed, before sending it to slot 1
    (its mirror). Slot 0 needs nothing more from slot 2 (chunk 1 comes from slot 1, the
    extras from slot 3): it steps and starts step 3, whose gather fails; slots 1 and 3
    fail in step 2's exchange. Healing agrees on step 2: slot 0 restores its copy and
    redoes step 2 from the kept batch, then step 3; bitwise."""
    report, diff = _run(tmp_path, faults=[[2, 2, -4, "kill"]], rejoin=True, rejoin_step=3, steps=5)
    assert len(report.finals) == 4 and "slot2-join" in report.finals
    returned = {r["slot"]: r["returned"] for r in report.records if not r["join"]}
    assert returned[0] == 1, returned
    assert diff == 0.0


def test_whole_job_fsdp_two_non_neighbours_dying_while_healing_bitwise(tmp_path):
    report, diff = _run(
        tmp_path, faults=[[1, 3, 2, "kill"], [3, 3, -1, "kill"]], rejoin=False, steps=5
    )
    assert sorted(report.finals) == ["slot0", "slot2"]
    assert [h["to"] for h in report.records[0]["heals"]] == [[0, 2]]
    assert diff == 0.0


def test_whole_job_fsdp_two_ring_neighbours_dying_at_once_fail_loudly(tmp_path):
    """Slots 1 and 2 die in the same step: chunk 2's owner and mirror are gone, its
    parameters with them; the survivors stop (StateLost), no silent wrong run."""
    report, _ = _run(tmp_path, faults=[[1, 2, 2, "kill"], [2, 2, 4, "kill"]], rejoin=False, steps=4)
    assert not report.finals
    assert report.codes[0] == [1] and report.codes[3] == [1]


def test_whole_job_fsdp_without_reproducible_mode_is_within_the_tolerance(tmp_path):
    """Not bitwise: arrival order and a whole all-reduce; float64, 6 Adam steps, a kill
    and a replacement: within 1e-12 of one process, and the members agree exactly."""
    report, diff = _run(
        tmp_path,
        faults=[[2, 3, 5, "kill"]],
        rejoin=True,
        rejoin_step=4,
        steps=6,
        reproducible=False,
    )
    assert len(report.finals) == 4
    assert diff < 1e-12
    finals = list(report.finals.values())
    assert all((f == finals[0]).all() for f in finals)


def test_whole_job_the_demo_command_heals_bitwise_under_fsdp():
    import subprocess
    import sys

    argv = ["demo", "-n", "4", "--reproducible", "--check", "--strategy", "fsdp"]
    argv += ["--kill-rank", "2", "--kill-step", "3", "--batch-size", "256"]
    proc = subprocess.run(
        [sys.executable, "-m", "plait.cli", *argv, "--microbatch-size", "32"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "plait demo: healed; 4 ranks finished at size [4]" in proc.stdout
    assert "max diff 0 (bitwise)" in proc.stdout
