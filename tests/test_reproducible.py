"""Reproducible mode (``reproducible=True``): bitwise the same parameters as one process.

Every distributed case trains the MLP of tests/reproducible_fns.py for 5 Adam steps on
global batches of 16 (micro-batches of 2, M=8) and must give ``torch.equal`` parameters to
the single-process oracle (``strategy="none"``, same micro-batches): data-parallel world
sizes 1, 2, 4 and 8, every all-reduce algorithm, the shared-memory and the gloo transport,
DDP, ZeRO-1/2, FSDP, pipelines of depth 2 and 4 under six schedules (depth 1 is the
oracle), an elastic restart from 4 ranks to 2, and a float32 Hugging Face Llama. PTD-P
(dp x pp, tp=1) trains plait's GPT (dp2 x pp2 under 1F1B and ZB-H1, dp1 x pp2, dp4 x pp1)
and the Llama (dp2 x pp2) against their one-process oracles.
Cases of one world size share one visit of the ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import plait
from plait import RankPool
from plait.strategies.compose.reproducible import check_reproducible
from plait.strategies.fsdp import fully_shard
from plait.strategies.reproducible import (
    LayoutError,
    ReproducibleRunner,
    TreeSum,
    microbatch_count,
    tree_all_reduce,
    tree_sum,
)
from tests import reproducible_fns as fns

ALGORITHMS = ["auto", "ring", "tree", "halving_doubling", "naive", "hierarchical", "ring_tree"]
ALGORITHMS += ["native", "shm"]


@pytest.fixture(scope="module")
def oracle() -> dict[str, torch.Tensor]:
    return fns.train("none", world=False)


@pytest.fixture(scope="module")
def gpt_oracle() -> dict[str, torch.Tensor]:
    """One process, the GPT's 8 micro-batches of 2 sequences on the tree (PTD-P cases)."""
    return fns.train_gpt_oracle()


@pytest.fixture(scope="module")
def llama_oracle() -> dict[str, torch.Tensor]:
    """One process, the float32 Llama's 4 micro-batches of 2 sequences on the tree."""
    return fns.train_llama("none", world=False)


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: Any) -> None:
    assert sorted(got) == sorted(want), what
    for k in want:
        diff = (got[k] - want[k]).abs().max().item()
        assert torch.equal(got[k], want[k]), f"{what}: {k} differs by {diff}"


def _merged(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for part in per_rank:
        out.update(part)
    return out


# --- the tree, without processes ----------------------------------------------------------
def test_tree_sum_is_the_balanced_tree_and_the_counter_follows_it_in_any_order():
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(1000, generator=g) * 10 ** (i % 5) for i in range(8)]
    want = ((leaves[0] + leaves[1]) + (leaves[2] + leaves[3])) + (
        (leaves[4] + leaves[5]) + (leaves[6] + leaves[7])
    )
    assert torch.equal(tree_sum(leaves), want)
    in_order = TreeSum()
    for leaf in leaves:
        in_order.push(leaf)
    assert in_order.peak_bytes <= 4 * 4000  # log2(8) + 1 partial sums of 4000 bytes
    shuffled = TreeSum()
    for i in (5, 0, 7, 2, 3, 6, 1, 4):  # a pipeline schedule's order
        shuffled.push(leaves[i], i)
    assert torch.equal(in_order.result(), want) and torch.equal(shuffled.result(), want)
    sequential = leaves[0].clone()
    for leaf in leaves[1:]:
        sequential += leaf
    assert not torch.equal(sequential, want)  # why the order must be fixed


def test_layouts_that_cannot_split_the_tree_are_refused_by_name():
    assert microbatch_count(16, 2, 4) == 8
    with pytest.raises(LayoutError, match="B=16, microbatch_size m=3"):
        microbatch_count(16, 3, 2)
    with pytest.raises(LayoutError, match="M=B/m=6 micro-batches.*power of two"):
        microbatch_count(12, 2, 2)
    with pytest.raises(LayoutError, match="W=16.*M=8.*power of two dividing M"):
        microbatch_count(16, 2, 16)
    with pytest.raises(LayoutError, match="W=3"):
        microbatch_count(16, 2, 3)


@pytest.mark.parametrize("strategy", ["tp", "ep", "cp", "ps", "naive"])
def test_prepare_refuses_strategies_the_mode_cannot_keep_bitwise(strategy):
    model = fns.make_model()
    with pytest.raises(ValueError, match=f"strategy='{strategy}', reproducible=True.* refused"):
        plait.prepare(model, None, strategy=strategy, reproducible=True)


PTDP_LAYOUT = {"pp": 2, "dp": 2, "tp": 1, "ep": 1, "microbatches": 4, "zero": 0}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"tp": 2}, "tp=2 is refused: tensor parallelism"),
        ({"ep": 2}, "MoE blocks are refused"),
        ({"moe": True}, "MoE blocks are refused"),
        ({"zero": 1}, "zero=1 is refused"),
        ({"scaler": True}, "a loss scaler is refused"),
        ({"reduction": "items"}, "reduction='items'.*mean over each micro-batch"),
        ({"tied": "tok.weight"}, r"tied parameter \(tok.weight.*pp=1"),
        ({"microbatches": 3}, "microbatches=3 per replica and dp=2 must be powers of two"),
        ({"dp": 3}, "must be powers of two"),
    ],
)
def test_ptdp_refuses_by_name_what_cannot_follow_the_tree(change, message):
    base = {**PTDP_LAYOUT, "moe": False, "scaler": False, "reduction": "mean"}
    check_reproducible(**base)  # dp2 x pp2, tp=1, a mean loss: accepted
    with pytest.raises(ValueError, match=message):
        check_reproducible(**{**base, **change})


def test_prepare_asks_for_the_microbatch_size_and_the_loss():
    with pytest.raises(TypeError, match="needs microbatch_size= and loss_fn="):
        plait.prepare(fns.make_model(), None, strategy="ddp", reproducible=True)
    with pytest.raises(TypeError, match="microbatch_size= is an option of reproducible=True"):
        plait.prepare(fns.make_model(), None, strategy="ddp", microbatch_size=2)


def test_a_strategy_built_by_hand_needs_the_keyword_and_a_runner():
    sharded = fully_shard(fns.make_model())
    with pytest.raises(ValueError, match="fully_shard was built without reproducible=True"):
        ReproducibleRunner(sharded, None, loss_fn=len, microbatch_size=2)
    before = torch.get_num_threads()
    try:
        sharded = fully_shard(fns.make_model(), reproducible=True)
        x, y = fns.batch(0)
        with pytest.raises(RuntimeError, match=r"fully_shard\(reproducible=True\).*outside"):
            torch.nn.functional.mse_loss(sharded(x), y).backward()
    finally:
        torch.set_num_threads(before)


def test_threads_are_pinned_per_rank():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        model = fns.make_model()
        plait.prepare(
            model, None, strategy="none", reproducible=True, microbatch_size=2, loss_fn=len
        )
        assert torch.get_num_threads() == 1
        plait.prepare(
            model,
            None,
            strategy="none",
            reproducible=True,
            microbatch_size=2,
            loss_fn=len,
            threads=2,
        )
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_one_process_runs_the_same_tree_as_its_microbatches_by_hand(oracle):
    """The oracle itself: 8 micro-batch gradients of loss/8, summed on the tree."""
    model = fns.make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(fns.STEPS):
        x, y = fns.batch(step)
        grads = []
        for j in range(8):
            model.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[2 * j : 2 * j + 2]), y[2 * j : 2 * j + 2])
            (loss * 0.125).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = tree_sum([g[i] for g in grads])
        optimizer.step()
    _equal(dict(model.state_dict()), oracle, "by hand")


# --- ranks ----------------------------------------------------------------------------------
DP_CASES = [("ddp", {"algorithm": a}) for a in ALGORITHMS] + [
    ("ddp", {"bucket_mb": 0.001}),  # several buckets, each launched during the last backward
    ("zero1", {}),
    ("zero2", {"bucket_mb": 0.001}),
    ("fsdp", {}),
]


def test_dp2_every_algorithm_zero_fsdp_pipeline_and_llama(ranks, oracle, gpt_oracle, llama_oracle):
    results = ranks(2, fns.cases, DP_CASES, timeout=300)
    for per_rank in results:
        for case, got in zip(DP_CASES, per_rank, strict=True):
            _equal(got, oracle, ("dp 2", case))
    schedules = ["gpipe", "1f1b", "interleaved", "zb-h1"]
    per_rank = ranks(2, fns.pipeline_cases, schedules, timeout=300)
    for i, schedule in enumerate(schedules):
        _equal(_merged([r[i] for r in per_rank]), oracle, ("pp 2", schedule))
    by_hand = ["ddp", "zero2", "fsdp"]
    for per_rank in ranks(2, fns.by_hand_cases, by_hand, timeout=300):
        for strategy, got in zip(by_hand, per_rank, strict=True):
            _equal(got, oracle, ("by hand, dp 2", strategy))
    for per_rank in ranks(2, fns.llama_cases, ["ddp", "fsdp"], timeout=300):
        for strategy, got in zip(["ddp", "fsdp"], per_rank, strict=True):
            _equal(got, llama_oracle, ("llama dp 2", strategy))
    # PTD-P dp1 x pp2: the GPT's one-process tree (dp2 x pp2 and dp4 x pp1 on 4 ranks)
    per_rank = ranks(2, fns.ptdp_cases, [("gpt", 2, 1, "1f1b")], timeout=300)
    _equal(_merged([r[0] for r in per_rank]), gpt_oracle, "ptdp dp1 x pp2")


def test_dp4_and_pp4_and_an_elastic_restart_on_2(ranks, oracle, gpt_oracle, llama_oracle, tmp_path):
    cases = [("ddp", {"algorithm": "ring"}), ("ddp", {"algorithm": "halving_doubling"})]
    cases += [("zero1", {}), ("zero2", {}), ("fsdp", {})]
    for per_rank in ranks(4, fns.cases, cases, timeout=300):
        for case, got in zip(cases, per_rank, strict=True):
            _equal(got, oracle, ("dp 4", case))
    schedules = ["interleaved", "zbv", "dualpipev"]
    per_rank = ranks(4, fns.pipeline_cases, schedules, timeout=300)
    for i, schedule in enumerate(schedules):
        _equal(_merged([r[i] for r in per_rank]), oracle, ("pp 4", schedule))
    # PTD-P dp2 x pp2 under two schedules and dp4 x pp1: the GPT's one-process tree
    specs = [("gpt", 2, 2, "1f1b"), ("gpt", 2, 2, "zb-h1"), ("gpt", 1, 4, "1f1b")]
    specs += [("llama", 2, 2, "1f1b")]
    per_rank = ranks(4, fns.ptdp_cases, specs, timeout=300)
    for i, spec in enumerate(specs):
        want = gpt_oracle if spec[0] == "gpt" else llama_oracle
        _equal(_merged([r[i] for r in per_rank]), want, ("ptdp", spec))
    refusals = ranks(4, fns.ptdp_refusals, timeout=300)[0]
    for got, want in zip(
        refusals,
        [
            "tp=2 is refused",
            "zero=1 is refused",
            "MoE blocks are refused",
            "tied parameter (tok.weight",
            "a second step before optimizer.step()",
            "clip_grad_norm_ (reproducible=True) is refused",
        ],
        strict=True,
    ):
        assert want in got, got
    # elastic: 4 ranks save after step 2, 2 ranks resume and run steps 2..4
    root = str(tmp_path / "ckpt")
    for strategy in ("fsdp",):  # resharded optimizer state: the case a replica cannot hide
        ranks(4, fns.train, strategy, None, 2, True, f"{root}-{strategy}", None, timeout=300)
        resumed = ranks(2, fns.train, strategy, None, 5, True, None, f"{root}-{strategy}")
        for got in resumed:
            _equal(got, oracle, ("4 -> 2", strategy))


def test_full_state_dict_of_a_runner_is_the_one_process_state(ranks, oracle):
    """``plait.checkpoint.full_state_dict`` of what ``prepare(..., reproducible=True)``
    returns: the one-process model's keys and values, as for the strategy alone (issue 43
    item 5c: it raised AttributeError, the runner has no full_state_dict)."""
    _equal(fns.train("none", world=False, full=True), oracle, "one process, runner")
    strategies = ["ddp", "zero2", "fsdp"]  # a wrapper, the plain model, a sharded model
    for per_rank in ranks(2, fns.runner_full_states, strategies, timeout=300):
        for strategy, got in zip(strategies, per_rank, strict=True):
            _equal(got, oracle, ("full_state_dict(runner), dp 2", strategy))


@pytest.fixture(scope="module")
def gloo_ranks() -> Iterator[RankPool]:
    pool = RankPool(2, timeout=60, env={"PLAIT_TRANSPORT": "gloo"})
    yield pool
    pool.close()


def test_gloo_transport_gives_the_same_bits(gloo_ranks, oracle):
    cases = [("ddp", {"algorithm": "ring"}), ("ddp", {"algorithm": "native"}), ("fsdp", {})]
    for per_rank in gloo_ranks.run(fns.cases, cases, timeout=300):
        for case, got in zip(cases, per_rank, strict=True):
            _equal(got, oracle, ("gloo dp 2", case))


def test_dp8(ranks, oracle):
    cases = [("ddp", {}), ("fsdp", {})]
    for per_rank in ranks(8, fns.cases, cases, timeout=400):
        for case, got in zip(cases, per_rank, strict=True):
            _equal(got, oracle, ("dp 8", case))


def _tree_all_reduce_bytes() -> dict[str, int]:
    from plait import comm

    g = plait.world()
    flat = torch.arange(1000, dtype=torch.float32) * (g.rank + 1)
    comm.reset_stats()
    tree_all_reduce(flat, group=g, algorithm="ring")
    sent = sum(s.bytes_sent for s in comm.stats().values())
    return {"sent": sent, "ok": int(torch.equal(flat, torch.arange(1000.0) * 3))}


def test_tree_all_reduce_sends_what_ring_all_reduce_sends(ranks):
    for out in ranks(2, _tree_all_reduce_bytes):
        assert out["ok"]
        assert out["sent"] == 2 * (2 - 1) * 1000 * 4 // 2  # 2(W-1)/W of the tensor
