"""plait.plan: the model's parameters and FLOPs, Korthikanti's activation bytes, in-flight
micro-batches and bubbles against the pipeline simulator, per-rank model states, step time
terms, refusals, the search and `plait plan layouts`. Pure, in one process."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import pytest

from plait.models.gpt import GPT, GPTConfig, MoEConfig
from plait.plan import memory
from plait.plan.activations import activation_memory, in_flight, per_layer_bytes
from plait.plan.cli import add_parser
from plait.plan.hardware import Cluster, a100, fit_alpha_beta
from plait.plan.layout import Job, Layout, LayoutError, check
from plait.plan.model import ModelSpec, from_gpt_config, from_param_count, published
from plait.plan.search import SearchSpace, evaluate, search
from plait.plan.states import model_states, rank_params
from plait.plan.time import bubble, ring_seconds, spans_nodes, step_time
from plait.strategies.pipeline.schedules import build
from plait.strategies.pipeline.simulate import peak_per_rank, simulate

SMALL = ModelSpec(layers=4, hidden=32, heads=4, vocab=64, seq_len=16)


def flat_cluster(devices: int, **kw: Any) -> Cluster:
    """One node, round numbers: 1 TFLOP/s at efficiency 1, 1 GB/s, no latency."""
    args: dict[str, Any] = dict(
        name="flat",
        nodes=1,
        devices_per_node=devices,
        peak_flops=1e12,
        memory_bytes=1e12,
        intra_bandwidth=1e9,
        intra_latency=0.0,
        inter_bandwidth=1e9,
        inter_latency=0.0,
        efficiency=1.0,
    )
    return Cluster(**(args | kw))


# --- the model ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "config",
    [
        GPTConfig(),
        GPTConfig(layers=3, width=48, heads=6, vocab=50, seq_len=20, tied=True),
        GPTConfig(layers=4, moe=MoEConfig(num_experts=4), moe_every=2),
    ],
)
def test_parameter_count_is_the_gpts(config: GPTConfig) -> None:
    spec = from_gpt_config(config)
    real = sum(p.numel() for p in GPT(config).parameters())
    assert spec.num_params == real


def test_flops_are_narayanans_formula() -> None:
    m = published("175B")
    B, s, L, h, V = 8, 2048, m.layers, m.hidden, m.vocab
    model = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    full = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    assert m.flops_per_iteration(batch=B, seq=s) == pytest.approx(model, rel=1e-12)
    assert m.flops_per_iteration(batch=B, seq=s, recompute="full") == pytest.approx(full, rel=1e-12)
    sel = m.flops_per_iteration(batch=B, seq=s, recompute="selective")
    assert sel == pytest.approx(model + 4 * B * s * s * h * L, rel=1e-12)


def test_published_and_param_count_shapes() -> None:
    assert published("175B").num_params == pytest.approx(175e9, rel=0.01)
    assert published("1T").num_params == pytest.approx(1.0e12, rel=0.02)
    gpt3 = from_param_count(175e9)
    assert (gpt3.layers, gpt3.hidden, gpt3.heads) == (96, 12288, 96)
    assert from_param_count(7.5e9, layers=32).num_params == pytest.approx(7.5e9, rel=0.05)


def test_model_refusals() -> None:
    with pytest.raises(ValueError, match="hidden=30 is not a multiple of heads=4"):
        ModelSpec(layers=1, hidden=30, heads=4, vocab=8, seq_len=8)
    with pytest.raises(ValueError, match="experts=1"):
        ModelSpec(layers=1, hidden=8, heads=2, vocab=8, seq_len=8, experts=1)


# --- activations: Korthikanti et al., Table 2 -----------------------------------------------
def test_korthikanti_table_2() -> None:
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh, q = s * b * h, 5 * a * s / h

    def layer(**kw: Any) -> float:
        return per_layer_bytes(s=s, b=b, h=h, a=a, **kw)

    assert layer() == pytest.approx(sbh * (34 + q))
    assert layer(t=t) == pytest.approx(sbh * (10 + 24 / t + q / t))
    assert layer(t=t, sp=True) == pytest.approx(sbh * (34 / t + q / t))
    assert layer(t=t, sp=True, recompute="selective") == pytest.approx(sbh * 34 / t)
    assert layer(recompute="full") == pytest.approx(2 * sbh)
    # without dropout the 34 becomes 32 (two 1-byte masks) and 5 becomes 2: no mask and
    # no dropout output, the softmax output is what the product with V keeps (measured:
    # tests/test_plan_activations.py)
    assert layer(mask_bytes=0) == pytest.approx(sbh * (32 + 2 * a * s / h))


@pytest.mark.parametrize(
    ("schedule", "v"),
    [
        ("gpipe", 1),
        ("1f1b", 1),
        ("zb-h1", 1),
        ("interleaved", 2),
        ("interleaved", 3),
        ("zbv", 2),
        ("dualpipev", 2),
    ],
)
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8), (4, 12)])
def test_in_flight_matches_the_simulator(schedule: str, v: int, p: int, m: int) -> None:
    if schedule == "interleaved" and m % p:
        pytest.skip("interleaved needs m % p == 0")
    if schedule == "dualpipev" and m < 2 * p:
        pytest.skip("dualpipev needs m >= 2p")
    peaks = peak_per_rank(build(schedule, p=p, m=m, v=v))
    assert in_flight(schedule, p=p, m=m, v=v) == peaks[0]
    # every rank (interleaved at m = p runs every forward first: m v on each rank)
    assert [in_flight(schedule, p=p, m=m, v=v, rank=r) for r in range(p)] == list(peaks)
    if schedule not in ("zbv", "dualpipev"):  # the V puts the last stage on rank 0
        assert in_flight(schedule, p=p, m=m, v=v, last=True) == peaks[-1]


@pytest.mark.parametrize(
    ("schedule", "v"),
    [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2)],
)
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 16)])
def test_bubble_formulas_match_the_simulator(schedule: str, v: int, p: int, m: int) -> None:
    simulated = simulate(build(schedule, p=p, m=m, v=v)).bubble
    assert bubble(schedule, p=p, m=m, v=v) == pytest.approx(simulated, abs=2e-3)
    assert bubble(schedule, p=p, m=m, v=v, simulate=True) == simulated


def test_activation_memory_of_a_pipeline() -> None:
    m = published("175B")
    job = Job(global_batch=64, seq=2048)
    lay = Layout(tp=8, pp=8, v=3, schedule="interleaved", sp=True, recompute="selective")
    act = activation_memory(m, job, lay)
    sbh = 2048 * 12288
    assert act.per_layer == pytest.approx(34 * sbh / 8)
    assert act.layers_per_chunk == 4 and act.in_flight == 3 * 8 + 8 - 1
    # Korthikanti 4.2.3: the first stage keeps L (1 + (p-1)/(p v)) layers' worth
    assert act.blocks == pytest.approx(act.per_layer * 96 * (1 + 7 / 24))


# --- model states ---------------------------------------------------------------------------
def test_rank_params_add_up() -> None:
    m = SMALL
    assert rank_params(m, Layout()) == [(m.num_params, 0)]
    stages = rank_params(m, Layout(pp=2, schedule="1f1b"))
    assert sum(d for d, _ in stages) == m.num_params
    h, t = m.hidden, 4
    (d,) = [x for x, _ in rank_params(m, Layout(tp=t))]
    replicated = m.layers * 6 * h + m.seq_len * h + 2 * h
    assert t * d - (t - 1) * replicated == m.num_params
    tied = ModelSpec(layers=4, hidden=32, heads=4, vocab=64, seq_len=16, tied=True)
    two = rank_params(tied, Layout(pp=2, schedule="1f1b"))
    assert sum(d for d, _ in two) == tied.num_params + 64 * 32  # the last stage's copy


def test_expert_params_split_over_ep() -> None:
    m = ModelSpec(layers=2, hidden=16, heads=2, vocab=32, seq_len=8, experts=4, moe_every=2)
    ((d1, x1),) = rank_params(m, Layout())
    ((d2, x2),) = rank_params(m, Layout(ep=2))
    assert d1 + x1 == m.num_params and d2 == d1 and x2 == x1 // 2
    assert x1 == 4 * m.mlp_params()


def test_zero_figure_1_through_a_layout() -> None:
    """The ZeRO paper's 7.5B / 64 ranks figures, reached through model_states."""
    m = from_param_count(7.5e9, layers=32)
    job = Job(global_batch=64, seq=1024)
    for zero, name in enumerate(("ddp", "zero1", "zero2", "zero3")):
        got = model_states(m, job, Layout(dp=64, zero=zero))
        want = memory.estimate(num_params=m.num_params, world_size=64, strategy=name)
        assert got.total_bytes == pytest.approx(want.total_bytes)


# --- time -----------------------------------------------------------------------------------
def test_ring_and_placement() -> None:
    assert ring_seconds("all_reduce", 4, 4e9, 1e-3, 1e9) == pytest.approx(6e-3 + 6.0)
    assert ring_seconds("all_gather", 4, 4e9, 1e-3, 1e9) == pytest.approx(3e-3 + 3.0)
    assert ring_seconds("all_reduce", 1, 4e9, 1e-3, 1e9) == 0.0
    c = a100(4)
    lay = Layout(dp=2, tp=8, pp=2, schedule="1f1b")
    assert not spans_nodes(lay, "tp", c)
    assert spans_nodes(lay, "dp", c) and spans_nodes(lay, "pp", c)
    assert not spans_nodes(Layout(dp=4, tp=2, pp=4, schedule="1f1b"), "dp", c)


def test_step_time_of_one_rank_is_flops_over_peak() -> None:
    job = Job(global_batch=4, seq=16, precision="fp32")
    t = step_time(SMALL, job, Layout(microbatch=2), flat_cluster(1))
    flops = SMALL.flops_per_iteration(batch=4, seq=16)
    assert t.total == pytest.approx(flops / 1e12)
    assert t.mfu == pytest.approx(1.0) and t.bubble == 0 and t.microbatches == 2


def test_step_time_terms() -> None:
    job = Job(global_batch=8, seq=16, precision="fp32")
    c = flat_cluster(4)
    # data parallel: the gradients' ring all-reduce, 2(n-1)/n of 4 bytes x P
    dp = step_time(SMALL, job, Layout(dp=4), c)
    assert dp.dp == pytest.approx(2 * 3 / 4 * 4 * SMALL.num_params / 1e9)
    assert dp.total == pytest.approx(dp.pipeline + dp.dp)
    # tensor parallel: 4 all-reduces per block + embedding + head (+ the loss's 3 small)
    tp = step_time(SMALL, job, Layout(tp=4, microbatch=8), c)
    act = 8 * 16 * 32 * 4
    ar = 2 * 3 / 4 / 1e9
    want = (4 * SMALL.layers + 2) * ar * act + 3 * ar * 8 * 16 * 4
    assert tp.tp_per_mb == pytest.approx(want)
    # pipeline: m t_mb / (1 - bubble), the 1F1B bubble
    pp = step_time(SMALL, job, Layout(pp=2, schedule="1f1b", microbatch=2), c)
    assert pp.bubble == pytest.approx(1 / 5)
    assert pp.pipeline == pytest.approx(4 * pp.per_microbatch / (1 - 1 / 5))


# --- refusals -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (Layout(tp=3), "tp=3 does not divide heads=4"),
        (Layout(pp=3, schedule="1f1b"), r"pp\*v = 3\*1 = 3 does not divide layers=4"),
        (Layout(dp=3), r"global_batch=8 is not a multiple of dp\*ep\*microbatch"),
        (Layout(pp=2), "pp=2 needs a schedule"),
        (Layout(pp=2, schedule="1f1b", v=2), "runs one chunk per rank"),
        (Layout(pp=2, schedule="interleaved", v=2, microbatch=8), "multiple of pp=2"),
        (Layout(pp=2, schedule="1f1b", zero=2), "zero=2 with pp=2"),
        (Layout(ep=2), "the model has no experts"),
        (Layout(sp=True), "sp=True needs tp >= 2"),
        (Layout(tp=2, tp_mode="2d"), "tp=2 with tp_mode='2d'"),
        (Layout(v=2), "pp=1 runs no pipeline"),
        (Layout(pp=2, schedule="dualpipev", v=1), "runs v=2 chunks per rank"),
        (Layout(pp=2, schedule="dualpipev", v=2, microbatch=4), r"m >= 2\*pp = 4, got m=2"),
    ],
)
def test_refusals_name_the_constraint(layout: Layout, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        check(SMALL, Job(global_batch=8, seq=16), layout)


def test_world_and_seq_refusals() -> None:
    with pytest.raises(LayoutError, match="= 2 ranks, but the cluster has 4"):
        evaluate(SMALL, Job(global_batch=8, seq=16), Layout(dp=2), flat_cluster(4))
    with pytest.raises(LayoutError, match="seq=32 exceeds the model's seq_len=16"):
        check(SMALL, Job(global_batch=8, seq=32), Layout())


# --- search ---------------------------------------------------------------------------------
def test_search_ranks_fitting_layouts_by_time() -> None:
    job = Job(global_batch=8, seq=16, precision="fp32")
    r = search(SMALL, job, flat_cluster(4, inter_latency=1e-4, intra_latency=1e-4))
    times = [p.time.total for p in r.plans]
    assert times == sorted(times) and r.plans and all(p.fits for p in r.plans)
    labels = {p.layout.label() for p in r.plans}
    assert len(labels) == len(r.plans)
    assert {p.layout.world for p in r.plans} == {4}
    assert r.refused > 0 and any("does not divide" in x or "multiple" in x for x in r.refusals)
    # memory filter: with 1 MB per device nothing fits, and the table says so
    tight = search(SMALL, job, flat_cluster(4, memory_bytes=1e5))
    assert not tight.plans and tight.too_big


def test_ptdp_rule_on_the_1t_3072_gpu_case() -> None:
    """PTD-P: the best layout of the 1T model on 3072 A100s keeps tp within a node and
    puts the pipeline across nodes (found by cost, not by a rule in the search)."""
    space = SearchSpace(microbatch=(1, 2), recompute=("selective", "full"), chunks=(2, 4))
    r = search(published("1T"), Job(global_batch=3072, seq=2048), a100(384), space=space)
    best = r.best
    assert best is not None
    assert best.layout.tp <= 8 and not spans_nodes(best.layout, "tp", r.cluster)
    assert best.layout.pp > 1 and spans_nodes(best.layout, "pp", r.cluster)


KORTHIKANTI = [  # model, GPUs, t, p, batch, micro-batch, v, full-recompute s, SP+selective s
    ("22B", 8, 8, 1, 4, 4, 1, 1.42, 1.10),
    ("175B", 64, 8, 8, 64, 1, 3, 18.13, 13.75),
    ("530B", 280, 8, 35, 280, 1, 3, 49.05, 37.83),
    ("1T", 512, 8, 64, 512, 1, 1, 94.42, 71.49),
]


@pytest.mark.parametrize("row", KORTHIKANTI, ids=[r[0] for r in KORTHIKANTI])
def test_korthikanti_iteration_times_within_25_percent(row: tuple[Any, ...]) -> None:
    name, n, t, p, batch, b, v, full, selective = row
    sched = "none" if p == 1 else ("interleaved" if v > 1 else "1f1b")
    for rc, sp, published_s in (("full", False, full), ("selective", True, selective)):
        lay = Layout(
            dp=n // (t * p), tp=t, pp=p, v=v, schedule=sched, microbatch=b, recompute=rc, sp=sp
        )
        plan = evaluate(published(name), Job(global_batch=batch, seq=2048), lay, a100(n // 8))
        assert plan.fits, f"{name} {rc}: {plan.memory_bytes / 1e9:.1f} GB"
        assert plan.time.total == pytest.approx(published_s, rel=0.25)


def test_fit_alpha_beta_recovers_a_line() -> None:
    rows = [
        {
            "world_size": n,
            "bytes": s,
            "time_us": 1e6 * (2 * (n - 1) * 1e-4 + 2 * (n - 1) / n * s / 2e9),
        }
        for n in (2, 4)
        for s in (4096, 1 << 20, 1 << 24)
    ]
    fit = fit_alpha_beta(rows)
    assert fit.latency == pytest.approx(1e-4) and fit.bandwidth == pytest.approx(2e9)
    with pytest.raises(ValueError, match="need all-reduce timings"):
        fit_alpha_beta(rows[:1])


# --- the command ----------------------------------------------------------------------------
def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="plait")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


GPT_ARGS = [
    "plan",
    "layouts",
    "--model",
    "gpt",
    "--layers",
    "4",
    "--hidden",
    "64",
    "--heads",
    "4",
    "--seq-len",
    "32",
    "--cluster",
    "a100",
    "--devices-per-node",
    "4",
    "--batch",
    "16",
    "--precision",
    "fp32",
]


def test_cli_table_explain_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli([*GPT_ARGS, "--explain", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "layouts fit" in out and "m x t_mb / (1 - bubble)" in out and "MFU" in out
    assert run_cli([*GPT_ARGS, "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (
        data["plans"]
        and data["model"]["num_params"]
        == from_gpt_config(GPTConfig(layers=4, width=64, heads=4, seq_len=32)).num_params
    )
    first = data["plans"][0]
    assert math.isclose(
        first["memory_bytes"],
        first["states"]["total_bytes"] + first["activations"]["total"] + first["buffers"],
    )


def test_cli_memory_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["plan", "memory", "--params", "7.5B", "-n", "64"]) == 0
    assert "120.0" in capsys.readouterr().out
    assert run_cli([*GPT_ARGS[:2], "--model", "gpt", "--heads", "3", "--batch", "4"]) == 2
    assert "not a multiple of heads=3" in capsys.readouterr().err
    assert run_cli(["plan", "layouts", "--model", "2T", "--batch", "4"]) == 2
    assert "--model '2T'" in capsys.readouterr().err


# --- 2D / 2.5D / 3D tensor parallelism ------------------------------------------------------
def test_grid_modes_use_tensor_costs() -> None:
    from plait.plan.tensor_costs import linear_cost

    m = ModelSpec(layers=2, hidden=64, heads=8, vocab=96, seq_len=16)
    job = Job(global_batch=8, seq=16, precision="fp32")
    c = flat_cluster(8)
    for mode, depth in (("2.5d", 2), ("3d", 1)):
        lay = Layout(tp=8, tp_mode=mode, depth=depth, microbatch=8)
        t = step_time(m, job, lay, c)
        per_block = sum(
            linear_cost(
                mode,
                ranks=8,
                tokens=8 * 16,
                in_features=i,
                out_features=o,
                depth=depth if mode == "2.5d" else None,
            ).bytes_per_rank
            for i, o in ((64, 192), (64, 64), (64, 256), (256, 64))
        )
        head = linear_cost(
            mode,
            ranks=8,
            tokens=8 * 16,
            in_features=64,
            out_features=96,
            depth=depth if mode == "2.5d" else None,
        ).bytes_per_rank
        assert t.tp_per_mb == pytest.approx((2 * per_block + head) / 1e9)  # no latency
        shards = 4 if mode == "2.5d" else 8  # the weight grid: q^2 (depth copies), q^3
        held = evaluate(m, job, lay, c).states.dense_params
        assert held == pytest.approx(m.num_params / shards, rel=1e-3)
    space = SearchSpace(tp=(8,), tp_modes=("1d", "2d", "2.5d", "3d"), recompute=("none",))
    labels = {p.layout.label().split()[0] for p in search(m, job, c, space=space).plans}
    assert labels == {"dp1xtp8xpp1", "dp1xtp8(2.5d,d2)xpp1", "dp1xtp8(3d)xpp1"}


def test_grid_refusals() -> None:
    job = Job(global_batch=8, seq=16)
    with pytest.raises(LayoutError, match="depth=2 is 2.5D's"):
        check(SMALL, job, Layout(tp=4, depth=2))
    with pytest.raises(LayoutError, match="needs a cube number of ranks"):
        check(SMALL, job, Layout(tp=4, tp_mode="3d"))
    with pytest.raises(LayoutError, match="sp=True is 1D's"):
        check(SMALL, job, Layout(tp=4, tp_mode="2d", sp=True))
