"""Pipeline schedules as data, checked without processes: every schedule validates (or is
refused naming its constraint), the simulator reproduces the bubble formulas and the
in-flight bounds, the validator names what is broken, the partition keeps dense names.

Unit costs: a whole stage's F = 1, B = 2 (I = W = 1 when split); a stage cut into v chunks
costs 1/v of that per chunk (``Costs.per_chunk``).
"""

from __future__ import annotations

import pytest
import torch

from plait.models import GPT, GPTConfig
from plait.models.gpt import pipeline_plan
from plait.strategies.pipeline import (
    Action,
    Costs,
    Kind,
    ScheduleError,
    bubble_report,
    build,
    formula_bubble,
    layers_of,
    partition,
    simulate,
    table,
    validate,
)
from plait.strategies.pipeline.schedules import add_comms, default_chunks, one_f_one_b
from plait.strategies.pipeline.split import Stage, _simulated
from plait.trace import Span

PS = (1, 2, 3, 4, 8)


def ms(p: int) -> list[int]:
    return sorted({1, 2, p, p + 1, 2 * p, 2 * p + 1, 3 * p})


def allowed(name: str, p: int, m: int) -> bool:
    if name == "dualpipev":
        return m >= 2 * p
    return not (name == "interleaved" and m % p)


REFUSAL = {"interleaved": "not a multiple of p={p}", "dualpipev": "use at least {2p}"}


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"])
@pytest.mark.parametrize("p", PS)
def test_every_schedule_validates_or_is_refused(name, p):
    for m in ms(p):
        if allowed(name, p, m):
            sched = build(name, p=p, m=m)
            validate(sched)  # again, explicitly
            assert sched.stages == p * default_chunks(name)
            # every stage forwards and backwards every micro-batch exactly once
            for s in range(sched.stages):
                fw = [
                    a.mb for acts in sched.ranks for a in acts if a.kind is Kind.F and a.stage == s
                ]
                assert sorted(fw) == list(range(m))
        else:
            match = REFUSAL[name].replace("{p}", str(p)).replace("{2p}", str(2 * p))
            with pytest.raises(ScheduleError, match=match):
                build(name, p=p, m=m)


@pytest.mark.parametrize(
    ("name", "v", "match"),
    [
        ("gpipe", 2, "gpipe runs one stage per rank"),
        ("1f1b", 3, "1f1b runs one stage per rank"),
        ("zb-h1", 2, "zb-h1 runs one stage per rank"),
        ("interleaved", 1, "interleaving needs chunks >= 2"),
        ("zbv", 3, "exactly 2 chunks per rank"),
        ("dualpipev", 1, "exactly 2 chunks per rank in a V"),
    ],
)
def test_constraints_are_refused_by_name(name, v, match):
    with pytest.raises(ScheduleError, match=match):
        build(name, p=2, m=4, v=v)
    with pytest.raises(ScheduleError, match="microbatches=0"):
        build(name, p=2, m=0, v=v)


def test_dualpipev_refuses_too_few_microbatches():
    with pytest.raises(ScheduleError, match=r"microbatches=7 < 2p = 8 chunk-stages.*at least 8"):
        build("dualpipev", p=4, m=7)


def test_unknown_schedule():
    with pytest.raises(ScheduleError, match="unknown schedule 'dualpipe'"):
        build("dualpipe", p=2, m=2)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", PS)
def test_gpipe_and_1f1b_bubble_formula(name, p):
    for m in ms(p):
        sim = simulate(build(name, p=p, m=m), Costs(f=1, b=2))
        assert sim.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert sim.makespan == pytest.approx(3 * (m + p - 1))


@pytest.mark.parametrize("p", PS)
def test_interleaved_bubble_formula(p):
    for v in (2, 3, 4):
        for m in (p, 2 * p, 4 * p):
            sim = simulate(build("interleaved", p=p, m=m, v=v), Costs.per_chunk(v))
            assert sim.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12), (v, m)
            assert sim.bubble == pytest.approx(formula_bubble("interleaved", p, m, v))


@pytest.mark.parametrize("p", PS)
def test_zb_h1_idles_a_third_of_1f1b(p):
    """With F = I = W = 1 (B = 2) and m >= p each rank idles (p - 1), 1F1B 3 (p - 1)."""
    for m in ms(p):
        zb = simulate(build("zb-h1", p=p, m=m), Costs(f=1, b=2, i=1, w=1))
        ref = simulate(build("1f1b", p=p, m=m), Costs(f=1, b=2))
        if m >= p:
            assert all(x == pytest.approx(p - 1) for x in zb.idle), (m, zb.idle)
            assert all(x == pytest.approx(3 * (p - 1)) for x in ref.idle)
            assert zb.bubble == pytest.approx(formula_bubble("zb-h1", p, m))
        else:  # too few micro-batches to fill with W: still never worse than 1F1B
            assert max(zb.idle) <= max(ref.idle)
        assert max(zb.peak_in_flight.values()) <= p  # 1F1B's peak memory


@pytest.mark.parametrize("p", (2, 3, 4, 8))
def test_zbv_only_fill(p):
    """ZBV with m >= 2p idles (p - 1) chunk forwards = (p - 1) / 2 per rank: the length of
    its fill (rank p-1 waits that long for its first input), nothing more."""
    for m in (2 * p, 2 * p + 1, 3 * p):
        sim = simulate(build("zbv", p=p, m=m), Costs.per_chunk(2))
        assert all(x == pytest.approx((p - 1) / 2) for x in sim.idle), (m, sim.idle)
        zb = simulate(build("zb-h1", p=p, m=m), Costs(f=1, b=2, i=1, w=1))
        assert sim.bubble < zb.bubble
        assert sim.bubble < 0.1
        # memory: at most 2p chunk-micro-batches per rank = 1F1B's p whole ones
        assert max(sim.peak_per_rank) <= 2 * p


@pytest.mark.parametrize("p", (2, 3, 4, 8))
def test_dualpipev_bubble_is_the_dualpipe_readme_s(p):
    """The DualPipe README: bubble (PP/2 - 1)(F&B + B - 3W) per rank, PP = 2p chunk-stages,
    F, B, W of one chunk, F&B an overlapped pair. Timed as DualPipe runs a pair (one unit
    starting when both inputs are there, F&B = F + B: no overlap credit) the simulator
    gives exactly that on every rank whenever I = F and W <= F, for any m; as plait's
    runtime runs it (the pair's forward does not wait for its backward's gradient) one
    forward less per (p - 1): (p - 1)(2B - 3W)."""
    for f, w in ((1.0, 1.0), (0.5, 0.5), (1.0, 0.5), (2.0, 1.0), (1.0, 0.25), (3.0, 2.0)):
        i, b = f, f + w
        readme = (p - 1) * ((f + b) + b - 3 * w)
        for m in (2 * p, 2 * p + 1, 3 * p + 2):
            sched = build("dualpipev", p=p, m=m)
            paired = simulate(sched, Costs(f=f, b=b, i=i, w=w, pair=1.0))
            assert paired.idle == pytest.approx([readme] * p), (f, w, m)
            apart = simulate(sched, Costs(f=f, b=b, i=i, w=w))
            assert apart.idle == pytest.approx([(p - 1) * (2 * b - 3 * w)] * p), (f, w, m)
            assert apart.makespan == pytest.approx(paired.makespan - (p - 1) * f)
    # unit costs of a whole stage cut in two chunks: the textbook fraction, and ZBV's fill
    for m in (2 * p, 4 * p):
        sched = build("dualpipev", p=p, m=m)
        paired = simulate(sched, Costs(f=0.5, b=1, i=0.5, w=0.5, pair=1.0))
        assert paired.bubble == pytest.approx(formula_bubble("dualpipev", p, m))
        zbv = simulate(build("zbv", p=p, m=m), Costs.per_chunk(2))
        assert simulate(sched, Costs.per_chunk(2)).idle == pytest.approx(zbv.idle)


@pytest.mark.parametrize("p", (1, 2, 3, 4, 8))
def test_dualpipev_memory_and_pairs(p):
    """Every rank holds at most PP + 1 = 2p + 1 chunk-micro-batches (the README's
    activation column); rank r runs 2 (m - 2p + r + 1) + (p - r - 1) F&B pairs, the tip
    rank one fewer (its first forward and backward run apart, as in DualPipe)."""
    for m in (2 * p, 2 * p + 1, 3 * p):
        sched = build("dualpipev", p=p, m=m)
        assert simulate(sched).peak_per_rank == (2 * p + 1,) * p
        for r in range(p):
            want = 2 * (m - 2 * p + r + 1) + (p - r - 1) - (r == p - 1)
            assert len(sched.pairs[r]) == want, (m, r)
            compute = sched.compute(r)
            for k in sched.pairs[r]:  # a forward, then a backward of the rank's other chunk
                f, b = compute[k], compute[k + 1]
                assert f.kind is Kind.F and b.kind in (Kind.B, Kind.I)
                assert f.stage != b.stage
    text = str(build("dualpipev", p=2, m=4, comms=False))
    assert text.splitlines()[1].startswith("rank 1: 1F0 2F0 1F1 2F1 1F2 2B0 2F2& 1B0 1F3& 2B1")


@pytest.mark.parametrize("p", PS)
def test_in_flight_gpipe_m_1f1b_at_most_p(p):
    for m in ms(p):
        g = simulate(build("gpipe", p=p, m=m))
        assert set(g.peak_in_flight.values()) == {m}
        f = simulate(build("1f1b", p=p, m=m))
        assert f.peak_in_flight == {s: min(m, p - s) for s in range(p)}


def test_validator_names_the_rule():
    good = one_f_one_b(2, 2)
    ranks = [list(a) for a in good.ranks]

    def refused(r: list[list[Action]], match: str) -> None:
        with pytest.raises(ScheduleError, match=match):
            validate(good.with_ranks(r))

    missing = [list(ranks[0]), [a for a in ranks[1] if a != Action(Kind.F, 1, 1)]]
    refused(missing, r"rank 1 forwards micro-batch 1 on stage 1 0 times")
    early = [[Action(Kind.B, 0, 0), *[a for a in ranks[0] if a != Action(Kind.B, 0, 0)]], ranks[1]]
    refused(early, r"rank 0 step \d+ \(0B0\) runs before 0F0")
    wrong = [ranks[0] + [Action(Kind.F, 1, 0)], ranks[1]]
    refused(wrong, r"stage 1 is on rank 1, not on rank 0")
    mixed = [ranks[0], [*ranks[1], Action(Kind.W, 1, 0)]]
    refused(mixed, r"B x1, I x0, W x1")
    # a receive left out: the send has no partner
    comm = add_comms(good)
    r0 = list(comm.ranks[0])
    r1 = list(comm.ranks[1])
    del r1[r1.index(Action(Kind.RECV_F, 1, 0))]
    with pytest.raises(
        ScheduleError, match=r"0SEND_F0\): needs exactly one matching 1RECV_F0 on rank 1, found 0"
    ):
        validate(comm.with_ranks([r0, r1]))


def test_validator_finds_deadlock():
    # rank 0 waits for the gradient of mb 0 before forwarding mb 1; rank 1 forwards mb 1
    # before its backward of mb 0: a cycle
    from plait.strategies.pipeline.actions import B, F, Schedule

    bad = Schedule(
        "cycle",
        2,
        2,
        1,
        (0, 1),
        ((F(0, 0), B(0, 0), F(0, 1), B(0, 1)), (F(1, 0), F(1, 1), B(1, 0), B(1, 1))),
    )
    with pytest.raises(ScheduleError, match=r"deadlock.*rank 0 at step .* waits for 1SEND_B0"):
        validate(bad)


def test_actions_print_and_parse():
    for text in ("2F0", "13B7", "0I12", "1W3", "1SEND_B3", "2RECV_F10"):
        assert str(Action.parse(text)) == text
    with pytest.raises(ValueError, match="<stage><kind><microbatch>"):
        Action.parse("F0")
    assert str(build("1f1b", p=2, m=2, comms=False)).startswith("rank 0: 0F0 0F1 0B0 0B1")


def test_table_shows_the_staircase():
    text = table(build("gpipe", p=3, m=2), width=3)
    lines = text.splitlines()
    assert lines[1].startswith("rank 0 | 0F0 0F1 .")
    assert lines[2].startswith("rank 1 | .   1F0 1F1")
    assert lines[3].startswith("rank 2 | .   .   2F0 2F1 2B0 2B0")


def test_png(tmp_path):
    pytest.importorskip("matplotlib")
    from plait.strategies.pipeline import draw_png

    sim = simulate(build("zbv", p=2, m=4), Costs.per_chunk(2))
    path = draw_png(sim.slots, str(tmp_path / "zbv.png"), p=2, title="zbv")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_measured_costs_drive_the_simulation():
    sched = build("1f1b", p=2, m=3)
    # stage 1 twice as slow: makespan grows by its extra work, bubble moves to rank 0
    costs = Costs(per_stage={("F", 0): 1, ("B", 0): 2, ("F", 1): 2, ("B", 1): 4})
    sim = simulate(sched, costs)
    assert sim.busy == (9, 18)
    assert sim.idle[1] == pytest.approx(3)  # only its wait for the first activation
    assert sim.makespan == pytest.approx(21)


def test_bubble_report_from_spans():
    sched = build("gpipe", p=2, m=2)
    slots = simulate(sched, Costs(f=1, b=2)).slots
    spans = [
        Span(
            s.action.kind.value,
            "compute",
            int(s.start * 1e9),
            int(s.end * 1e9),
            s.rank,
            {"stage": s.action.stage, "mb": s.action.mb},
        )
        for s in slots
    ]
    rep = bubble_report(sched, spans)
    assert rep.measured == pytest.approx(1 / 3)
    assert rep.simulated == pytest.approx(1 / 3)
    assert rep.formula == pytest.approx(1 / 3)
    assert "bubble measured 33.3%" in rep.describe()


def small_gpt(tied: bool = False, layers: int = 4) -> GPT:
    return GPT(GPTConfig(vocab=13, layers=layers, heads=2, width=16, seq_len=6, tied=tied))


def test_partition_keeps_dense_names_and_function():
    model = small_gpt(tied=True)
    layers = layers_of(model, pipeline_plan(model))
    assert [x.name for x in layers] == ["embed", *(f"blocks.{i}" for i in range(4)), "head"]
    for by in ("params", [1, 5]):
        part = partition(layers, 3, by=by)
        stages = [Stage(layers[a:b], s) for s, (a, b) in enumerate(part.bounds)]
        keys = [k for st in stages for k in st.state_dict()]
        assert keys == list(model.state_dict())
        x = torch.randint(0, 13, (2, 6))
        y = x
        for st in stages:
            y = st(y)
        torch.testing.assert_close(y, model(x), rtol=0, atol=0)
        assert "stage 0" in str(part) and "params (" in str(part)
    part = partition(layers, 3, by="params")
    assert max(part.params) < sum(part.params) * 0.5


def test_a_cut_fitted_to_the_schedule_shortens_its_simulated_step():
    # GPT with 6 blocks in ZBV's 4 stages at p = 2: the balanced cut's simulated makespan
    # falls when a layer moves; "params" keeps the balanced cut (what the planner models)
    model = small_gpt(layers=6)
    layers = layers_of(model, pipeline_plan(model))
    sched = build("zbv", p=2, m=4)
    weights = [float(x.numel()) for x in layers]
    plain = partition(layers, 4, by="params")
    fitted = partition(layers, 4, by="schedule", schedule=sched)
    assert partition(layers, 4, by="params", schedule=sched).bounds == plain.bounds
    assert fitted.bounds != plain.bounds
    assert _simulated(weights, fitted.bounds, sched) < _simulated(weights, plain.bounds, sched)
    with pytest.raises(ValueError, match="by='schedule' needs the schedule"):
        partition(layers, 4, by="schedule")


def test_partition_refusals():
    model = small_gpt(layers=2)
    layers = layers_of(model, pipeline_plan(model))
    with pytest.raises(ValueError, match="5 stages from 4 layers"):
        partition(layers, 5)
    with pytest.raises(ValueError, match="split points \\[2, 1\\] must be 2 increasing"):
        partition(layers, 3, by=[2, 1])
    with pytest.raises(ValueError, match="needs sample="):
        partition(layers, 2, by="time")
    with pytest.raises(TypeError, match="no pipeline plan for a Linear"):
        layers_of(torch.nn.Linear(2, 2))
    part = partition(layers, 2, by="time", sample=torch.randint(0, 13, (2, 6)))
    assert part.seconds is not None and "fwd+bwd time" in str(part)


def test_receives_follow_the_senders_order():
    """A pair's messages arrive in order: a receive posted out of the sender's order could
    wait behind a message whose receive comes only later (ZBV m=5 hung that way)."""
    sched = build("zbv", p=2, m=5)
    r1 = list(sched.ranks[1])
    i, j = r1.index(Action.parse("1RECV_F2")), r1.index(Action.parse("2RECV_B0"))
    assert i < j  # posted early, because rank 0 sends 0F2 before 3I0's gradient
    r1[i], r1[j] = r1[j], r1[i]
    with pytest.raises(ScheduleError, match="rank 1 posts 2RECV_B0 where rank 0 sends"):
        validate(sched.with_ranks([sched.ranks[0], r1]))


def test_split_returns_stages_and_partition():
    from plait.strategies.pipeline import split

    model = small_gpt(layers=2)
    stages, part = split(model, stages=2, by=[2], plan=pipeline_plan(model))
    assert [s.layer_names for s in stages] == [["embed", "blocks.0"], ["blocks.1", "head"]]
    assert str(part).splitlines()[0].startswith("stage 0: embed, blocks.0 |")


def test_gap_between_actions_is_measured_and_simulated():
    """A runtime that loses 0.25 between actions: the report finds the gap, and the
    simulator with it reproduces the measured bubble."""
    sched = build("gpipe", p=1, m=2)
    sim = simulate(sched, Costs(f=1, b=2, gap=0.25))
    assert sim.makespan == pytest.approx(6 + 3 * 0.25)
    spans = [
        Span(
            s.action.kind.value,
            "compute",
            int(s.start * 1e9),
            int(s.end * 1e9),
            s.rank,
            {"stage": s.action.stage, "mb": s.action.mb},
        )
        for s in sim.slots
    ]
    rep = bubble_report(sched, spans)
    assert rep.gap_seconds == pytest.approx(0.25)
    assert rep.measured == pytest.approx(0.75 / 6.75)
    assert rep.simulated == pytest.approx(0.0)
    assert rep.simulated_with_gap == pytest.approx(rep.measured)


def spans_of(slots) -> list[Span]:
    """Tracer spans for simulated slots: one per action, and a wait wherever a rank idles
    between two actions (as the runtime records them)."""
    spans = []
    for r in {s.rank for s in slots}:
        mine = sorted((s for s in slots if s.rank == r), key=lambda s: s.start)
        for prev, s in zip([None, *mine], mine, strict=False):
            if prev is not None and s.start > prev.end:
                spans.append(Span("wait", "comm", round(prev.end * 1e9), round(s.start * 1e9), r))
            args = {"stage": s.action.stage, "mb": s.action.mb}
            kind = s.action.kind.value
            spans.append(Span(kind, "compute", round(s.start * 1e9), round(s.end * 1e9), r, args))
    return spans


def test_replay_uses_each_action_s_own_time_and_the_message_latency():
    """A step whose action times vary from one micro-batch to the next and whose messages
    take 0.1 to arrive: the simulator with mean costs misses both, the replay (each
    action's own time, the latency found in the trace) gives the measured bubble back."""
    sched = build("1f1b", p=2, m=4)
    times = {a: (1.0 + 0.7 * (a.mb % 2)) * (2 if a.kind is Kind.B else 1) for a in sched.compute(0)}
    times |= {a: 1.0 + 0.5 * (a.mb == 3) for a in sched.compute(1)}
    truth = simulate(sched, Costs(per_action=times, comm=0.1))
    spans = spans_of(truth.slots)
    rep = bubble_report(sched, spans)
    assert rep.latency_seconds == pytest.approx(0.1, abs=1e-6)
    assert rep.gap_seconds == pytest.approx(0.0, abs=1e-6)
    assert rep.measured == pytest.approx(truth.bubble, abs=1e-6)
    assert rep.replayed == pytest.approx(rep.measured, abs=1e-6)
    assert abs(rep.simulated - rep.measured) > 0.01  # the means alone do not explain it


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"])
def test_ranks_sharing_cores(name):
    """Processor sharing: with a core per rank it is the plain simulator; on one core the
    step is the sum of all work (someone always computes); a measured step's work, read
    back from its slots, is each action's cost; the report's shared-cores simulation of a
    step made that way gives its bubble back."""
    from plait.strategies.pipeline.cores import run_on_cores, work_of
    from plait.strategies.pipeline.simulate import run

    p = 4
    sched = build(name, p=p, m=8)
    costs = Costs(gap=0.1, comm=0.05, per_stage={("F", 0): 0.7, ("B", p - 1): 2.5})
    key = lambda s: (s.rank, str(s.action), round(s.start, 9), round(s.end, 9))  # noqa: E731
    assert sorted(map(key, run(sched, costs))) == sorted(map(key, run_on_cores(sched, costs, p)))
    unit = Costs(f=1, b=2, i=1, w=1)
    one = run_on_cores(sched, unit, 1)
    assert max(s.end for s in one) == pytest.approx(sum(unit.of(s.action) for s in one))
    shared = run_on_cores(sched, costs, 1.5)
    work = work_of(shared, 1.5)
    assert all(work[s] == pytest.approx(costs.of(s.action)) for s in shared)
    spans = spans_of(run_on_cores(sched, Costs(per_stage=costs.per_stage), 2))
    rep = bubble_report(sched, spans, cores=2)
    assert rep.cores == 2 and rep.simulated_on_cores is not None
    assert rep.simulated_on_cores == pytest.approx(rep.measured, abs=1e-6)
    assert bubble_report(sched, spans, cores=p).simulated_on_cores is None  # a core each
