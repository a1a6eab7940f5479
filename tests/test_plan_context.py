"""plait.plan with context parallelism: a cp dimension in layouts, activations per rank
``1 / cp``, the ring's and Ulysses' bytes and exposed seconds per layer against numbers
derived by hand, and the search choosing cp at long sequences and not at short ones.
Pure arithmetic, one process."""

from __future__ import annotations

import pytest

from plait.plan import hf
from plait.plan.activations import per_layer_bytes
from plait.plan.buffers import BUCKET_BYTES, buffer_bytes
from plait.plan.hardware import preset
from plait.plan.layout import Job, Layout, LayoutError, check
from plait.plan.model import ModelSpec
from plait.plan.search import SearchSpace, search
from plait.plan.states import model_states
from plait.plan.time import spans_nodes, step_time
from tests.test_plan import flat_cluster, run_cli

# 2 blocks, h = 64, 4 heads of 16 (no grouped-query attention), a position table of 1024
LONG = ModelSpec(layers=2, hidden=64, heads=4, vocab=64, seq_len=1024)
JOB = Job(global_batch=1, seq=1024, dropout=False)


def test_layout_cp_world_label_and_refusals() -> None:
    lay = Layout(dp=2, tp=2, cp=4, context="ulysses")
    assert lay.world == 16 and lay.replicas == 8 and lay.tokens(JOB) == 256
    assert lay.label() == "dp2xtp2xcp4xpp1 ulysses b1"
    check(LONG, JOB, Layout(cp=4))
    with pytest.raises(LayoutError, match=r"seq=1020 must divide into 2\*cp = 8"):
        check(LONG, Job(global_batch=1, seq=1020), Layout(cp=4))
    with pytest.raises(LayoutError, match=r"tp\*cp = 8 must divide heads=4"):
        check(LONG, JOB, Layout(tp=2, cp=4, context="ulysses"))
    with pytest.raises(LayoutError, match="context='star'"):
        check(LONG, JOB, Layout(cp=2, context="star"))
    with pytest.raises(LayoutError, match=r"dp\*tp\*cp\*pp\*ep = 1\*1\*4\*1\*1 = 4"):
        check(LONG, JOB, Layout(cp=4), world=8)


def test_cp_with_moe_blocks_refused_where_strategy_cp_refuses_them() -> None:
    """Hugging Face MoE blocks run under cp (with tp, dp, pp and ep: PTD-P); in plait's
    GShard layer they are refused, naming why."""
    moe = dict(layers=2, hidden=64, heads=4, vocab=64, seq_len=1024, experts=4, moe_every=1)
    hf_moe = ModelSpec(**moe, hugging_face=True, positions="rope")  # type: ignore[arg-type]
    check(hf_moe, Job(global_batch=2, seq=1024, dropout=False), Layout(dp=2, tp=2, cp=2))
    check(hf_moe, Job(global_batch=2, seq=1024, dropout=False), Layout(cp=2, ep=2))  # PTD-P
    with pytest.raises(LayoutError, match="in plait's GShard layer"):
        check(ModelSpec(**moe), JOB, Layout(cp=2))  # type: ignore[arg-type]
    # inside PTD-P too (the routers' statistics summed over dp x cp)
    check(hf_moe, Job(global_batch=2, seq=1024), Layout(cp=2, pp=2, microbatch=1, schedule="1f1b"))


def test_activations_per_rank_are_one_cp_th() -> None:
    # per token of one block, e = 2, no masks, h = 64: replicated 4e h = 512, split
    # e (2q + 2kv) + 2 e f = 2 (128 + 128) + 4 * 256 = 1536; 2048 B per token
    common = dict(s=1024, b=1, h=64, a=4, mask_bytes=0)
    one = per_layer_bytes(**common)  # unfused: + e a s^2 b (e = 2, no dropout)
    assert one == 2048 * 1024 + 2 * 4 * 1024 * 1024
    # ring, cp 4: 256 tokens, and the fp32 log-sum-exp of its rows: 4 a 256
    assert per_layer_bytes(**common, cp=4) == 2048 * 256 + 4 * 4 * 256
    # Ulysses, cp 4: the unfused kernel on a / 4 heads of the whole sequence
    ulysses = per_layer_bytes(**common, cp=4, context="ulysses")
    assert ulysses == 2048 * 256 + 2 * 4 * 1024 * 1024 / 4 == one / 4
    # fused attention at cp 1 vs ring at cp 4: exactly a quarter
    assert per_layer_bytes(**common, cp=4) == per_layer_bytes(**common, flash=True) / 4
    # full recomputation keeps the block's input of this rank's tokens
    assert per_layer_bytes(**common, cp=4, recompute="full") == 2 * 256 * 64


def test_ring_buffers_and_states_over_dp_cp() -> None:
    # ring: 6 K/V-sized blocks (module doc of plait.plan.buffers), KV = 2 e (s/c) kv; the
    # gradients are averaged over the cp ranks: DDP's two buckets too
    buckets = 2 * BUCKET_BYTES
    assert buffer_bytes(LONG, JOB, Layout(cp=4)) == 6 * 2 * 2 * 256 * 64 + buckets
    ulysses = buffer_bytes(LONG, JOB, Layout(cp=4, context="ulysses"))
    assert ulysses == 2 * 256 * (64 + 128) + buckets
    # ZeRO-1 shards the optimizer over dp * cp, as over dp alone
    job = Job(global_batch=4, seq=1024)
    sharded = model_states(LONG, job, Layout(dp=2, cp=2, zero=1))
    assert sharded.total_bytes == model_states(LONG, job, Layout(dp=4, zero=1)).total_bytes


def test_ring_bytes_and_exposed_seconds_per_layer() -> None:
    """1 TFLOP/s, 1 GB/s, no latency. Per rank 256 tokens, KV = 2 * 256 * 64 * 2 B =
    65 536 B a step; a step's attention 4 s (a d) 256 / c = 16 777 216 FLOPs (16.78 us);
    forward: 3 steps of max(0, 65.536 - 16.777) us; backward 3 of (131.072 - 33.554) us."""
    t = step_time(LONG, JOB, Layout(cp=4), flat_cluster(4))
    f = 4 * 1024 * 64 * 256 / 4 / 1e12
    kv = 2 * 256 * 64 * 2
    per_layer = 3 * ((kv / 1e9 - f) + (2 * kv / 1e9 - 2 * f))
    assert t.cp_per_mb == pytest.approx(2 * per_layer, rel=1e-12)
    assert per_layer == pytest.approx(438.829056e-6, rel=1e-9)
    cp = {c.group: c for c in t.comm}["cp"]
    # (c-1)/c * 2 s kv e forward, twice that backward, per layer: 589 824 B
    assert cp.bytes_per_step == 2 * 3 * (3 / 4) * 2 * 1024 * 64 * 2 == 2 * 589824
    # a fast link: the ring hides behind the blockwise attention
    fast = step_time(LONG, JOB, Layout(cp=4), flat_cluster(4, intra_bandwidth=1e12))
    assert fast.cp_per_mb == 0.0
    # full recomputation runs the forward, and its ring, again
    full = step_time(LONG, JOB, Layout(cp=4, recompute="full"), flat_cluster(4))
    assert full.cp_per_mb == pytest.approx(2 * (per_layer + 3 * (kv / 1e9 - f)), rel=1e-12)
    # the dense gradients are averaged over dp * cp, the cp group inside the node
    lay = Layout(dp=2, cp=4)
    assert {
        c.group: c.size
        for c in step_time(LONG, JOB.__class__(global_batch=2, seq=1024), lay, flat_cluster(8)).comm
    }["dp"] == 8
    assert not spans_nodes(lay, "cp", flat_cluster(8, devices_per_node=4))
    assert spans_nodes(lay, "dpep", flat_cluster(8, devices_per_node=4))


def test_ulysses_bytes_and_seconds_per_layer() -> None:
    """4 all-to-alls forward and 4 backward of 256 x 64 x 2 B = 32 768 B each: 3/4 of it
    sent, at 1 GB/s 24.576 us each, not overlapped."""
    t = step_time(LONG, JOB, Layout(cp=4, context="ulysses"), flat_cluster(4))
    assert t.cp_per_mb == pytest.approx(2 * 8 * 24.576e-6, rel=1e-12)
    cp = {c.group: c for c in t.comm}["cp"]
    assert cp.bytes_per_step == 2 * 8 * 0.75 * 32768


# zero 0 and 1: strategy 'cp' takes ZeRO over dp x cp; PTD-P (cp with pp > 1) zero=0 only
SPACE = SearchSpace(
    microbatch=(1,), schedules=("1f1b",), recompute=("none", "full"), zero=(0, 1), sp=(True,)
)


def test_search_takes_cp_at_long_sequences_only() -> None:
    model, cluster = hf.load("llama3-8b"), preset("h100", nodes=8)
    long = Job(global_batch=64, seq=131072, flash_attention=True, dropout=False)
    best = search(model, long, cluster, space=SPACE).best
    assert best is not None and best.layout.cp >= 8, best.layout.label()
    # tp inside a node and no recomputation: nothing fits at cp 1; with cp it does
    keep = SearchSpace(**{**SPACE.__dict__, "recompute": ("none",), "tp": (1, 2, 4, 8)})
    assert (
        search(model, long, cluster, space=SearchSpace(**{**keep.__dict__, "cp": (1,)})).best
        is None
    )
    assert search(model, long, cluster, space=keep).best is not None
    short = Job(global_batch=512, seq=4096, flash_attention=True, dropout=False)
    best = search(model, short, cluster, space=SPACE).best
    assert best is not None and best.layout.cp == 1, best.layout.label()


def test_cli_cp_options(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "layouts", "--model", "llama3-8b", "--gpus", "64xH100", "--seq", "131072"]
    argv += ["--batch", "64", "--cp", "1,16,32", "--context", "ring", "--microbatch", "1"]
    argv += ["--schedules", "1f1b", "--zero", "0,1", "--top", "3"]
    assert run_cli(argv) == 0
    out = capsys.readouterr().out
    top = out.splitlines()[4]  # the best layout: cp 16 or 32, ring, without a pipeline
    assert "cp16xpp1 ring" in top or "cp32xpp1 ring" in top, out
    ranked = [line for line in out.splitlines() if " ring " in line]
    # ZeRO under cp only without a pipeline (strategy 'cp'; PTD-P's ZeRO reduces over dp)
    assert all("xpp1 " in line for line in ranked if "zero" in line), out
