"""plait.plan's calibration of this machine and what the step time does with it: the
measured lines replace the ring formula, the optimizer step is added, ranks sharing cores
lend a pipeline bubble's share; Adam's step counters in the model states;
``plait.plan.measure.execute.supported``. Pure, in one process (the rank-side measurement runs in
benchmarks/plan_local.py and the memory test of tests/test_plan_local.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from plait.plan.costs import param_tensors, pipeline_actions, tp_calls
from plait.plan.hardware import Cluster, local_cpu
from plait.plan.layout import Job, Layout
from plait.plan.measure import calibrate, execute
from plait.plan.measure.calibrate import Calibration, Line, Overhead, fit_line
from plait.plan.measure.probe_runtime import split_overhead
from plait.plan.model import ModelSpec
from plait.plan.states import rank_states, step_counters
from plait.plan.time import bubble, collective_seconds, ring_seconds, step_time

SMALL = ModelSpec(layers=4, hidden=32, heads=4, vocab=64, seq_len=16)
JOB = Job(global_batch=16, seq=16, precision="fp32", dropout=False)


def cal(**kw: Any) -> Calibration:
    args: dict[str, Any] = dict(
        ranks=4,
        cores=2,
        transport="shm",
        links={
            "all_reduce": {2: Line(1e-4, 1e9, 4), 4: Line(2e-4, 5e8, 4)},
            "all_gather": {2: Line(5e-5, 2e9, 4), 4: Line(1e-4, 1e9, 4)},
            "reduce_scatter": {2: Line(5e-5, 2e9, 4), 4: Line(1e-4, 1e9, 4)},
            "p2p": {2: Line(3e-5, 4e9, 4)},
        },
        gemm=[(1024, 128, 512, 50e9), (1024, 128, 128, 50e9), (1024, 128, 32, 25e9)],
        adam=Line(1e-4, 1e8, 2),
    )
    args.update(kw)
    return Calibration(**args)


def cpu(calibration: Calibration | None = None, **kw: Any) -> Cluster:
    args: dict[str, Any] = dict(
        name="cpu",
        nodes=1,
        devices_per_node=4,
        peak_flops=1e10,
        memory_bytes=1e10,
        intra_bandwidth=1e9,
        intra_latency=1e-3,
        inter_bandwidth=1e9,
        inter_latency=1e-3,
        efficiency=1.0,
        shared_cores=2.0,
        calibration=calibration,
    )
    args.update(kw)
    return Cluster(**args)


def test_fit_line_recovers_a_line_and_clamps() -> None:
    pts = [(s, 2e-4 + s / 3e9) for s in (4e3, 6.4e4, 5e5, 2e6)]
    line = fit_line(pts)
    assert line.latency == pytest.approx(2e-4)
    assert line.bandwidth == pytest.approx(3e9)
    assert line.points == 4
    flat = fit_line([(1e3, 5e-3), (1e6, 1e-3)])  # falling: latency kept, slope from the end
    assert flat.latency >= 0 and flat.bandwidth > 0
    with pytest.raises(ValueError, match="2 or more"):
        fit_line([(1.0, 1.0)])


def test_calibration_round_trip_and_lookups(tmp_path: Path) -> None:
    c = cal(
        ddp=Overhead(5e-5, 1e-9), zero=Overhead(3e-5, 2e-9), tp_call={2: 1e-4}, pipe_action=2e-4
    )
    path = calibrate.save(c, tmp_path / "c.json")
    back = calibrate.load(path)
    assert back == c
    assert back.line("all_reduce", 4) == Line(2e-4, 5e8, 4)
    assert back.line("all_reduce", 8) == Line(2e-4, 5e8, 4)  # nearest measured size
    assert back.line("p2p", 2) == Line(3e-5, 4e9, 4)
    assert back.line("all_to_all", 4) is None
    assert back.gemm_flops(1.0) == 25e9  # clamped below
    assert back.gemm_flops(1e15) == 50e9  # clamped above
    mid = back.gemm_flops(2.0 * 1024 * 128 * 64)  # between the 32- and 128-wide shapes
    assert 25e9 < mid < 50e9
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="plait bench calibrate"):
        calibrate.load(tmp_path / "bad.json")
    print(calibrate.format_calibration(back))


def test_collectives_use_the_measured_line() -> None:
    c = cpu(cal())
    size = 1e6
    assert collective_seconds(c, "all_reduce", 4, size, inter_node=False) == pytest.approx(
        2e-4 + size / 5e8
    )
    assert collective_seconds(c, "p2p", 2, size, inter_node=False) == pytest.approx(
        3e-5 + size / 4e9
    )
    # not measured: the ring on the alpha-beta link
    assert collective_seconds(c, "all_to_all", 4, size, inter_node=False) == ring_seconds(
        "all_to_all", 4, size, 1e-3, 1e9
    )
    assert collective_seconds(cpu(None), "all_reduce", 4, size, inter_node=False) == (
        ring_seconds("all_reduce", 4, size, 1e-3, 1e9)
    )
    assert collective_seconds(c, "all_reduce", 1, size, inter_node=False) == 0.0


def test_tp_time_is_the_measured_all_reduces() -> None:
    c = cpu(cal(gemm=[]))
    lay = Layout(tp=4, microbatch=16)
    t = step_time(SMALL, JOB, lay, c)
    act = 16 * 16 * 32 * 4
    one = 2e-4 + act / 5e8
    # 4 per block, the embedding's 1, the head's 1 + the loss's 3 small ones
    small = 2e-4 + 16 * 16 * 4 / 5e8
    assert t.tp_per_mb == pytest.approx(4 * 4 * one + 2 * one + 3 * small)
    sp = step_time(SMALL, JOB, dataclasses.replace(lay, sp=True), c)
    rs_ag = 2 * (1e-4 + act / 1e9)  # a reduce-scatter and an all-gather over 4
    assert sp.tp_per_mb == pytest.approx(4 * 4 * rs_ag + 2 * one + 3 * small)


def test_optimizer_step_is_added_and_sharded_by_zero() -> None:
    c = cpu(cal())
    ddp = step_time(SMALL, JOB, Layout(dp=4, microbatch=4), c)
    zero = step_time(SMALL, JOB, Layout(dp=4, microbatch=4, zero=1), c)
    params = SMALL.num_params
    assert ddp.optimizer == pytest.approx(1e-4 + params / 1e8)
    assert zero.optimizer == pytest.approx(1e-4 + params / 4 / 1e8)
    assert ddp.total - zero.total == pytest.approx(ddp.optimizer - zero.optimizer)
    assert step_time(SMALL, JOB, Layout(dp=4, microbatch=4), cpu(None)).optimizer == 0.0


def test_gemm_slowdown_from_the_measured_rates() -> None:
    slow = cal(gemm=[(1024, 128, 512, 50e9), (1024, 128, 32, 25e9)])
    flat = cal(gemm=[(1024, 128, 512, 50e9), (1024, 128, 32, 50e9)])
    gpt = ModelSpec(layers=4, hidden=128, heads=4, vocab=96, seq_len=64)
    job = Job(global_batch=16, seq=64, precision="fp32", dropout=False)
    lay = Layout(tp=4, microbatch=16)  # 1024 tokens: the MLP's 1024 x 128 x 512 split in 4
    t_slow = step_time(gpt, job, lay, cpu(slow)).compute_per_mb
    t_flat = step_time(gpt, job, lay, cpu(flat)).compute_per_mb
    assert t_slow > t_flat
    one = step_time(gpt, job, Layout(dp=4, microbatch=4), cpu(slow)).compute_per_mb
    assert one == step_time(gpt, job, Layout(dp=4, microbatch=4), cpu(flat)).compute_per_mb


def test_ranks_sharing_cores_lend_the_bubble() -> None:
    from plait.strategies.pipeline.schedules import build
    from plait.strategies.pipeline.simulate import Costs, simulate

    for m, micro in ((8, 2), (1, 16)):
        lay = Layout(pp=4, schedule="1f1b", microbatch=micro)
        dedicated = step_time(SMALL, JOB, lay, cpu(None, shared_cores=0.0, intra_latency=0.0))
        shared = step_time(SMALL, JOB, lay, cpu(None, shared_cores=2.0, intra_latency=0.0))
        beta = bubble("1f1b", p=4, m=m)
        assert shared.microbatches == m
        assert dedicated.pipeline == pytest.approx(m * dedicated.per_microbatch / (1 - beta))
        # 4 ranks on 2 cores: a rank alone runs twice as fast; the schedule played at that
        # speed (a message's latency on the path) against all the work at the shared speed
        c, pp = shared.compute_per_mb, shared.pp_per_mb
        costs = Costs(f=c / 2 / 3, b=2 * c / 2 / 3, i=c / 2 / 3, w=c / 2 / 3, comm=pp / 2)
        path = simulate(build("1f1b", p=4, m=m), costs).makespan
        assert shared.pipeline == pytest.approx(max(m * (c + pp), path))
        assert shared.pipeline < dedicated.pipeline
    assert path > m * (c + pp)  # one micro-batch: the path is longer than the shared work
    assert cpu(None, shared_cores=2.0).alone_speedup == 2.0
    assert cpu(None, shared_cores=0.0).alone_speedup == 1.0
    assert cpu(None, shared_cores=8.0).alone_speedup == 1.0


def test_local_cpu_reads_a_calibration(tmp_path: Path) -> None:
    path = calibrate.save(cal(), tmp_path / "c.json")
    c = local_cpu(ranks=4, calibration=path)
    assert c.calibration == cal()
    assert c.peak_flops == 50e9  # the best matmul rate per rank, every rank busy
    assert (c.intra_latency, c.intra_bandwidth) == (3e-5, 4e9)  # the p2p line
    assert c.shared_cores >= 1
    assert c.to_dict()["calibration"]["transport"] == "shm"
    with pytest.raises(ValueError, match="plait bench calibrate -n 8"):
        local_cpu(ranks=8, calibration=path)


def test_adam_step_counters() -> None:
    gpt = ModelSpec(layers=8, hidden=64, heads=8, vocab=96, seq_len=16)
    # one per tensor: 12 per block, 2 for the embedding, 3 for the final LayerNorm + head
    assert step_counters(gpt, Layout(dp=4)) == [12 * 8 + 2 + 3]
    assert step_counters(gpt, Layout(dp=4, zero=1)) == [1]
    assert step_counters(gpt, Layout(dp=4, zero=3)) == [8 + 1]
    assert step_counters(gpt, Layout(pp=4, schedule="1f1b")) == [26, 24, 24, 27]
    moe = ModelSpec(layers=8, hidden=64, heads=8, vocab=96, seq_len=16, experts=4)
    assert step_counters(moe, Layout(ep=4)) == [4 * 12 + 4 * (9 + 4) + 5]
    states = rank_states(gpt, JOB, Layout(dp=4))[0]
    sgd = rank_states(gpt, dataclasses.replace(JOB, optimizer="sgd"), Layout(dp=4))[0]
    assert "step counters" in states.formula and "step counters" not in sgd.formula


def test_execute_supported_names_what_is_not_built() -> None:
    assert execute.supported(Layout(dp=4, microbatch=4), JOB) is None
    assert execute.supported(Layout(pp=2, tp=2, schedule="1f1b", microbatch=4), JOB) is None
    assert "micro-batch" in str(execute.supported(Layout(dp=4, microbatch=1), JOB))
    assert "recompute" in str(execute.supported(Layout(dp=4, microbatch=4, recompute="full"), JOB))
    assert "ZeRO-3" in str(execute.supported(Layout(dp=2, tp=2, zero=3, microbatch=8), JOB))
    # cp: build has no context parallelism; refused by name, with what to use instead
    why = execute.supported(Layout(dp=2, cp=2, context="ulysses", microbatch=4), JOB)
    assert why is not None and why.startswith("cp=2 (context parallelism) is not built")
    assert "strategy='cp', mesh=Mesh(cp=2, dp=2), context='ulysses'" in why
    # build refuses it before it looks at the world or the model
    with pytest.raises(ValueError, match=r"dp2xtp1xcp2xpp1 ring b4: cp=2 \(context"):
        execute.build(None, Layout(dp=2, cp=2, microbatch=4), JOB, None, None)  # type: ignore[arg-type]


def test_data_parallel_collectives_per_zero_stage() -> None:
    c = cpu(cal(adam=None))
    grads = SMALL.num_params * 4.0
    ddp = step_time(SMALL, JOB, Layout(dp=4, microbatch=4), c).dp
    zero1 = step_time(SMALL, JOB, Layout(dp=4, microbatch=4, zero=1), c).dp
    fsdp = step_time(SMALL, JOB, Layout(dp=4, microbatch=4, zero=3), c).dp
    assert ddp == pytest.approx(2e-4 + grads / 5e8)
    assert zero1 == pytest.approx(2 * (1e-4 + grads / 1e9))  # reduce-scatter + all-gather
    units = SMALL.layers + 1  # each block wrapped, and the root
    assert fsdp == pytest.approx(units * 3 * (1e-4 + grads / units / 1e9))


def test_pipeline_messages_with_and_without_scatter_gather() -> None:
    c = cpu(cal())
    lay = Layout(pp=2, tp=2, schedule="1f1b", microbatch=4)
    act = 4 * 16 * 32 * 4
    sg = step_time(SMALL, JOB, lay, c).pp_per_mb
    whole = step_time(SMALL, dataclasses.replace(JOB, pp_scatter_gather=False), lay, c)
    p2p = Line(3e-5, 4e9, 4)
    assert sg == pytest.approx(2 * p2p.seconds(act / 2) + 2 * (5e-5 + act / 2e9))
    assert whole.pp_per_mb == pytest.approx(2 * p2p.seconds(act))


def test_split_overhead_into_tensors_and_bytes() -> None:
    own = split_overhead((1e4, 30 * 5e-5 + 1e4 * 2e-9), (1e6, 30 * 5e-5 + 1e6 * 2e-9), 30)
    assert own.per_tensor == pytest.approx(5e-5)
    assert own.per_byte == pytest.approx(2e-9)
    assert own.seconds(10, 1e3) == pytest.approx(10 * 5e-5 + 1e3 * 2e-9)
    falling = split_overhead((1e4, 2e-3), (1e6, 1e-3), 10)  # noise: no byte cost
    assert falling.per_byte == 0.0 and falling.per_tensor == pytest.approx(2e-4)
    assert split_overhead((1e4, -1e-3), (1e6, -2e-3), 10) == Overhead(0.0, 0.0)
    with pytest.raises(ValueError, match="larger bytes second"):
        split_overhead((1e6, 1.0), (1e4, 1.0), 10)


def test_param_tensors_count_the_gpt_s() -> None:
    from plait.models import GPT, GPTConfig

    gpt = GPT(GPTConfig(vocab=64, layers=4, heads=4, width=32, seq_len=16))
    assert param_tensors(SMALL, Layout(), 4, 0, True, True) == len(list(gpt.parameters()))
    tied = dataclasses.replace(SMALL, tied=True)
    assert param_tensors(tied, Layout(), 4, 0, True, True) == 4 * 12 + 4
    assert param_tensors(SMALL, Layout(pp=2), 2, 0, False, True) == 2 * 12 + 3


def test_ddp_zero_and_fsdp_own_work_per_tensor_and_byte() -> None:
    c = cpu(cal(ddp=Overhead(1e-4, 1e-9), zero=Overhead(2e-4, 3e-9), fsdp=Overhead(4e-4, 5e-9)))
    grads, tensors = SMALL.num_params * 4, 4 * 12 + 5
    ddp = step_time(SMALL, JOB, Layout(dp=4, microbatch=4), c)
    assert ddp.strategy == pytest.approx(1e-4 * tensors + 1e-9 * grads)
    for stage in (1, 2):
        zero = step_time(SMALL, JOB, Layout(dp=4, microbatch=4, zero=stage), c)
        assert zero.strategy == pytest.approx(2e-4 * tensors + 3e-9 * grads)
    plain = step_time(SMALL, JOB, Layout(dp=4, microbatch=4), cpu(cal()))
    assert ddp.total - plain.total == pytest.approx(ddp.strategy)
    fsdp = step_time(SMALL, JOB, Layout(dp=4, zero=3, microbatch=4), c)
    assert fsdp.strategy == pytest.approx(4e-4 * tensors + 5e-9 * grads)
    # compose's own all-reduce over dp is not plait's DDP; no data parallelism: nothing
    assert (
        step_time(SMALL, JOB, Layout(dp=2, pp=2, schedule="1f1b", microbatch=2), c).strategy == 0.0
    )
    assert step_time(SMALL, JOB, Layout(tp=4, microbatch=16), c).strategy == 0.0
    assert step_time(SMALL, JOB, Layout(dp=4, microbatch=4), cpu(None)).strategy == 0.0


def test_tensor_parallel_calls_cost_their_own_work() -> None:
    c, base = cpu(cal(gemm=[], tp_call={2: 1e-4, 4: 3e-4})), cpu(cal(gemm=[]))
    lay = Layout(tp=4, microbatch=16)
    t, t0 = step_time(SMALL, JOB, lay, c), step_time(SMALL, JOB, lay, base)
    assert t.tp_calls_per_mb == 4 * 4 + 1 + 4  # blocks, embedding, head and loss
    assert t.tp_per_mb - t0.tp_per_mb == pytest.approx(21 * 3e-4)
    sp = step_time(SMALL, JOB, dataclasses.replace(lay, sp=True), c)
    assert sp.tp_calls_per_mb == 2 * 4 * 4 + 5
    assert c.calibration is not None and c.calibration.tp_call_seconds(8) == 3e-4
    assert tp_calls(Layout(tp=2, pp=2), 2, 0, True, False) == 2 * 4 + 1
    assert tp_calls(Layout(dp=4), 4, 0, True, True) == 0


def test_pipeline_actions_from_the_schedule() -> None:
    # 1F1B over 4 ranks: a middle rank runs F, B, two sends and two receives per micro-batch
    assert pipeline_actions(Layout(pp=4, schedule="1f1b", microbatch=2), 8) == 6.0
    assert pipeline_actions(Layout(pp=4, schedule="zb-h1", microbatch=2), 8) == 7.0
    assert pipeline_actions(Layout(pp=2, dp=2, schedule="gpipe", microbatch=2), 4) == 4.0
    assert pipeline_actions(Layout(dp=4), 1) == 0.0
    big = Layout(pp=64, v=2, schedule="interleaved", microbatch=1)
    assert pipeline_actions(big, 1024) == 2 * (2 + 4.0)  # too large to build: v (c + 4)
    lay = Layout(pp=4, schedule="1f1b", microbatch=2)
    c = cpu(cal(pipe_action=1e-4), shared_cores=0.0)
    t, t0 = step_time(SMALL, JOB, lay, c), step_time(SMALL, JOB, lay, cpu(cal(), shared_cores=0.0))
    assert t.runtime_per_mb == pytest.approx(6 * 1e-4)
    assert t.compute_per_mb - t0.compute_per_mb == pytest.approx(6 * 1e-4)
    assert t.pipeline == pytest.approx(8 * t.per_microbatch / (1 - t.bubble))


def test_runtime_probes_on_ranks(ranks: Any) -> None:
    from tests import plan_fns

    out = ranks(2, plan_fns.runtime_probes, timeout=120)
    assert out[0] == out[1]  # the slowest rank's figures, on every rank
    fields = out[0]["fields"]
    for key in ("ddp", "zero", "fsdp"):
        assert fields[key].per_tensor >= 0 and fields[key].per_byte >= 0
    assert set(fields["tp_call"]) == {2} and fields["tp_call"][2] >= 0
    assert fields["pipe_action"] >= 0
    probes = [row["probe"] for row in out[0]["raw"]]
    assert probes == ["ddp", "ddp", "zero1", "zero1", "fsdp", "fsdp", "tp", "pipeline"]
    for row in out[0]["raw"][:6]:
        assert row["strategy_s"] > 0 and row["reference_s"] > 0 and row["tensors"] == 29


def test_fastest_keeps_the_least_disturbed_figures() -> None:
    calm = cal(block_overhead=1e-4, pipe_action=2e-4, tp_call={2: 1e-4, 4: 5e-4})
    busy = cal(
        links={
            "all_reduce": {2: Line(3e-4, 1e9, 4), 4: Line(1e-4, 5e8, 4)},
            "p2p": {2: Line(3e-5, 4e9, 4)},
        },
        gemm=[(1024, 128, 512, 40e9), (1024, 128, 128, 60e9)],
        adam=Line(2e-4, 1e8, 2),
        block_overhead=3e-4,
        ddp=Overhead(1e-5, 1e-9),
        pipe_action=1e-4,
        tp_call={4: 3e-4},
    )
    best = calibrate.fastest([calm, busy])
    assert best.line("all_reduce", 2) == Line(1e-4, 1e9, 4)  # calm's
    assert best.line("all_reduce", 4) == Line(1e-4, 5e8, 4)  # busy's, faster here
    assert best.line("all_gather", 4) == Line(1e-4, 1e9, 4)  # only calm measured it
    assert dict(((m, k, n), r) for m, k, n, r in best.gemm)[(1024, 128, 128)] == 60e9
    assert best.adam == Line(1e-4, 1e8, 2)
    assert best.block_overhead == 1e-4 and best.pipe_action == 1e-4
    assert best.ddp == Overhead(1e-5, 1e-9) and best.zero is None
    assert best.tp_call == {2: 1e-4, 4: 3e-4}
    with pytest.raises(ValueError, match="do not mix"):
        calibrate.fastest([calm, cal(ranks=8)])


def test_pipeline_probe_fits_recover_wake_and_split() -> None:
    from plait.plan.measure import probe_pipeline as pp

    kw: dict[str, Any] = dict(busy_mb=0.02, cores=2.0, ranks=4, comm=2e-4, pipe_action=5e-5)
    for g, m in ((2, 4), (4, 8)):
        for name in ("1f1b", "gpipe", "interleaved"):
            none = pp.played(name, g, m, **kw)
            made = pp.played(name, g, m, wake=1e-3, **kw)
            assert made > none  # every woken action pays more work
            assert pp.fit_wake(name, g, m, makespan=made, **kw) == pytest.approx(1e-3, rel=1e-6)
            assert pp.fit_wake(name, g, m, makespan=none / 2, **kw) == 0.0  # faster than none
            assert pp.fit_wake(name, g, m, makespan=1e3, **kw) == 0.05  # the most it fits
        zb = pp.played("zb-h1", g, m, wake=1e-3, split=1.4, **kw)
        assert pp.fit_split(g, m, makespan=zb, wake=1e-3, **kw) == pytest.approx(1.4, abs=1e-6)
        assert pp.fit_split(g, m, makespan=zb / 3, wake=1e-3, **kw) == 1.0
    with pytest.raises(ValueError, match="g >= 2"):
        pp.fit_wake("1f1b", 1, 4, makespan=1.0, **kw)
    # fit() from probe rows: each message the p2p line for its bytes
    line = Line(1e-4, 1e9, 2)
    at: dict[str, Any] = dict(
        busy_mb=0.02, cores=2.0, ranks=4, comm=line.seconds(1e4), pipe_action=1e-4
    )
    steps = {
        "1f1b": pp.played("1f1b", 2, 4, wake=2e-3, **at),
        "gpipe": pp.played("gpipe", 2, 4, wake=5e-4, **at),
        "zb-h1": pp.played("zb-h1", 2, 4, wake=2e-3, split=1.2, **at),
    }
    rows = [{"g": 2, "m": 4, "busy_mb_s": 0.02, "message_bytes": 1e4, "steps_s": steps}]
    wake, split = pp.fit(rows, cores=2.0, ranks=4, p2p=line, pipe_action=1e-4)
    assert set(wake) == {"1f1b", "gpipe"}
    assert wake["1f1b"][2] == pytest.approx(2e-3, rel=1e-6)
    assert wake["gpipe"][2] == pytest.approx(5e-4, rel=1e-6)
    assert split[2] == pytest.approx(1.2, abs=1e-6)


def test_shared_cores_play_the_schedule_with_the_measured_wake() -> None:
    from plait.plan.costs import shared_cores_path
    from plait.strategies.pipeline.cores import run_on_cores
    from plait.strategies.pipeline.schedules import build
    from plait.strategies.pipeline.simulate import Costs

    lay = Layout(pp=4, schedule="1f1b", microbatch=2)
    woken = {
        x: step_time(SMALL, JOB, lay, cpu(cal(wake={"1f1b": {2: 0.0, 4: x}}, zb_split={4: 1.0})))
        for x in (0.0, 1e-3, 2e-3)
    }
    assert woken[0.0].pipeline < woken[1e-3].pipeline < woken[2e-3].pipeline
    t = woken[0.0]
    m, c, pp = t.microbatches, t.compute_per_mb, t.pp_per_mb
    # no wake: the schedule under processor sharing, 4 ranks on 2 cores, work = busy / 2
    f, b = c / 3 / 2, 2 * c / 3 / 2
    plain = run_on_cores(build("1f1b", p=4, m=m), Costs(f=f, b=b, comm=pp / 2), 2.0)
    assert t.pipeline == pytest.approx(max(s.end for s in plain))
    # a woken action: each compute action that reads a message (3 of the 4 ranks' F, 3 B)
    assert woken[1e-3].pipeline == pytest.approx(
        shared_cores_path(
            lay,
            m,
            c,
            t.tp_per_mb,
            pp / 2,
            runtime=t.runtime_per_mb,
            cores=2.0,
            ranks=4,
            split=1.0,
            wake=1e-3,
        )
    )
    # ZB-H1's backward costs what the calibration measured
    zb = Layout(pp=4, schedule="zb-h1", microbatch=2)
    even, heavy = (
        step_time(SMALL, JOB, zb, cpu(cal(wake={"1f1b": {4: 1e-4}}, zb_split={4: s})))
        for s in (1.0, 1.5)
    )
    assert heavy.pipeline > even.pipeline
    # a data-parallel layout has no pipeline to play
    dp = Layout(dp=4, microbatch=4)
    assert step_time(SMALL, JOB, dp, cpu(cal(wake={"1f1b": {4: 1e-3}}))).total == pytest.approx(
        step_time(SMALL, JOB, dp, cpu(cal())).total
    )


def test_pipeline_figures_round_trip_and_fastest() -> None:
    c = cal(wake={"1f1b": {2: 1e-4, 4: 3e-4}, "gpipe": {2: 6e-4}}, zb_split={2: 1.3, 4: 1.2})
    back = Calibration.from_dict(c.to_dict())
    assert back.wake == c.wake and back.zb_split == {2: 1.3, 4: 1.2}
    assert back.pipeline_figures("1f1b", 4) == (3e-4, 1.2)
    assert back.pipeline_figures("1f1b", 8) == (3e-4, 1.2)  # the nearest measured size
    assert back.pipeline_figures("gpipe", 4) == (6e-4, 1.2)  # its own wake
    assert back.pipeline_figures("zbv", 2) == (1e-4, 1.3)  # not measured: 1F1B's
    assert cal().pipeline_figures("1f1b", 4) is None
    other = cal(wake={"1f1b": {2: 4e-4, 4: 2e-4}}, zb_split={2: 1.5, 4: 1.1})
    best = calibrate.fastest([c, other])
    # fit from two timings: the mean of the calibrations that measured them
    assert best.wake["1f1b"] == pytest.approx({2: 2.5e-4, 4: 2.5e-4})
    assert best.wake["gpipe"] == {2: 6e-4}
    assert best.zb_split == pytest.approx({2: 1.4, 4: 1.15})
    assert "woken action" in calibrate.format_calibration(best)


def test_pipeline_probe_on_ranks(ranks: Any) -> None:
    from plait.plan.measure import probe_pipeline
    from tests import plan_fns

    out = ranks(2, plan_fns.pipeline_probe, timeout=180)
    assert out[0] == out[1]  # the slowest rank's figures, on every rank
    (row,) = out[0]
    assert (row["g"], row["m"]) == (2, 4)
    assert row["busy_mb_s"] > 0 and set(row["steps_s"]) == set(probe_pipeline.SCHEDULES)
    assert all(s > 0 for s in row["steps_s"].values())
    wake, split = probe_pipeline.fit(
        [row], cores=1.0, ranks=2, p2p=Line(1e-4, 1e9, 2), pipe_action=1e-4
    )
    assert set(wake) == {"1f1b", "gpipe", "interleaved"}
    assert all(0.0 <= per[2] <= 0.05 for per in wake.values()) and 1.0 <= split[2] <= 3.0


def test_tensor_parallel_residual_is_charged_per_call_and_element() -> None:
    from plait.plan.measure.calibrate import Residual

    lay = Layout(tp=4, microbatch=4)
    res = Residual(per_call=1e-4, per_element=1e-8)
    plain = step_time(SMALL, JOB, lay, cpu(cal()))
    charged = step_time(SMALL, JOB, lay, cpu(cal(tp_residual={2: Residual(0, 0), 4: res})))
    elements = 4 * JOB.seq * SMALL.hidden * SMALL.layers
    want = res.seconds(plain.tp_calls_per_mb, elements)
    assert charged.tp_per_mb - plain.tp_per_mb == pytest.approx(want)
    # a negative residual (the planner over-charged per call) never takes the term below 0
    over = step_time(SMALL, JOB, lay, cpu(cal(tp_residual={4: Residual(-1.0, 0.0)})))
    assert 0.0 < over.tp_per_mb < plain.tp_per_mb  # (the embedding's and head's remain)
    assert cal(tp_residual={2: res}).residual(8) == res  # the nearest measured size
    assert cal(tp_residual={2: res}).residual(1) is None and cal().residual(4) is None
    back = Calibration.from_dict(cal(tp_residual={4: res}).to_dict())
    assert back.tp_residual == {4: res}
    assert "tp residual" in calibrate.format_calibration(back)
    both = calibrate.fastest([cal(tp_residual={4: res}), cal(tp_residual={4: Residual(3e-4, 0)})])
    assert both.tp_residual[4].per_call == pytest.approx(2e-4)
    assert both.tp_residual[4].per_element == pytest.approx(0.5e-8)


def test_tensor_probe_fit_recovers_the_residual() -> None:
    from plait.plan.measure import probe_tensor
    from plait.plan.measure.calibrate import Residual

    base = cal(tp_call={2: 1e-4, 4: 2e-4}, block_overhead=1e-4)
    _, layers, _, width, seq = probe_tensor.MODEL
    want = {2: Residual(-2e-4, 3e-8), 4: Residual(1e-4, 5e-8)}  # per call: either sign
    rows = []
    for t, res in want.items():
        for r in probe_tensor.ROWS:
            plain = 0.01 * r
            guess, calls = probe_tensor.predicted(base, 4, t, r, plain)
            tp = guess + res.seconds(calls, r * seq * width * layers)
            rows.append({"t": t, "rows": r, "plain_s": plain, "tp_s": tp})
    got = probe_tensor.fit(rows, cal=base, ranks=4)
    for t, res in want.items():
        assert got[t].per_call == pytest.approx(res.per_call, rel=1e-6)
        assert got[t].per_element == pytest.approx(res.per_element, rel=1e-6)
    assert probe_tensor.sizes(8) == [2, 4, 8] and probe_tensor.sizes(6) == [2]


def test_tensor_probe_on_ranks(ranks: Any) -> None:
    from plait.plan.measure import probe_tensor
    from tests import plan_fns

    out = ranks(2, plan_fns.tensor_probe, timeout=180)
    assert out[0] == out[1]  # the slowest rank's figures, on every rank
    assert [(r["t"], r["rows"]) for r in out[0]] == [(2, r) for r in probe_tensor.ROWS]
    assert all(r["plain_s"] > 0 and r["tp_s"] > 0 for r in out[0])
