"""plait.trace: recording spans, Chrome trace files, overlap arithmetic (no processes needed)."""

from __future__ import annotations

import json
import pickle
import threading
from pathlib import Path

import pytest

from plait.trace import (
    NO_TOKEN,
    Span,
    Tracer,
    intersection_length,
    interval_union,
    overlap_report,
    total_length,
    write_chrome,
)

MS = 1_000_000  # ns


def _span(name: str, start_ms: float, end_ms: float, *, stream: str = "compute", rank: int = 0):
    return Span(name, stream, int(start_ms * MS), int(end_ms * MS), rank, {})


# --- recording ------------------------------------------------------------------------------
def test_span_and_begin_end_record_names_streams_args_in_start_order():
    tracer = Tracer(rank=3)
    with tracer.span("forward"):
        pass
    with tracer.span("backward", micro_batch=0):
        token = tracer.begin("all_reduce", bucket=1, bytes=4096)
    tracer.end(token)
    with tracer.span("optimizer_step", stream="optim"):
        pass
    spans = tracer.spans()
    assert [(s.name, s.stream) for s in spans] == [
        ("forward", "compute"),
        ("backward", "compute"),
        ("all_reduce", "comm"),
        ("optimizer_step", "optim"),
    ]
    assert all(s.rank == 3 and tracer.origin_ns <= s.start_ns <= s.end_ns for s in spans)
    assert [s.start_ns for s in spans] == sorted(s.start_ns for s in spans)
    forward, backward, comm, _ = spans
    assert forward.end_ns <= backward.start_ns <= comm.start_ns <= backward.end_ns <= comm.end_ns
    assert backward.args == {"micro_batch": 0} and comm.args == {"bucket": 1, "bytes": 4096}
    assert comm.duration_ns == comm.end_ns - comm.start_ns


def test_span_is_recorded_when_the_block_raises():
    tracer = Tracer()
    with pytest.raises(RuntimeError), tracer.span("forward"):
        raise RuntimeError("boom")
    assert [s.name for s in tracer.spans()] == ["forward"]


def test_open_spans_are_left_out_and_survive_clear():
    tracer = Tracer()
    token = tracer.begin("all_reduce")
    with tracer.span("backward"):
        pass
    assert [s.name for s in tracer.spans()] == ["backward"]
    tracer.clear()
    assert tracer.spans() == []
    tracer.end(token)
    assert [s.name for s in tracer.spans()] == ["all_reduce"]


def test_end_on_another_thread():
    tracer = Tracer(rank=1)
    token = tracer.begin("all_reduce", bucket=0)
    worker = threading.Thread(target=tracer.end, args=(token,))
    worker.start()
    worker.join()
    (span,) = tracer.spans()
    assert (span.name, span.stream, span.rank, span.args) == (
        "all_reduce",
        "comm",
        1,
        {"bucket": 0},
    )


def test_concurrent_begin_end_loses_nothing():
    tracer = Tracer()
    threads, per_thread = 8, 500

    def work(i: int) -> None:
        for j in range(per_thread):
            tracer.end(tracer.begin("all_reduce", thread=i, j=j))

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    keys = {(s.args["thread"], s.args["j"]) for s in tracer.spans()}
    assert len(keys) == threads * per_thread


def test_disabled_tracer_records_nothing():
    tracer = Tracer(enabled=False)
    with tracer.span("forward"):
        token = tracer.begin("all_reduce")
    assert token == NO_TOKEN
    tracer.end(token)  # no error: the token of a disabled tracer
    assert tracer.spans() == [] and tracer.chrome_events() == []


def test_bad_tokens_raise():
    tracer = Tracer(rank=2)
    with pytest.raises(ValueError, match="rank 2: trace token 12345 is not open"):
        tracer.end(12345)
    token = tracer.begin("all_reduce")
    tracer.end(token)
    with pytest.raises(ValueError, match="already ended"):
        tracer.end(token)
    other = Tracer()
    with pytest.raises(ValueError):
        other.end(tracer.begin("x"))  # a token of another tracer


def test_spans_pickle_as_plain_data():
    span = Span("all_reduce", "comm", 10, 20, 1, {"bucket": 2})
    assert pickle.loads(pickle.dumps([span])) == [span]
    assert hash(span) == hash(Span("all_reduce", "comm", 10, 20, 1, {"other": 1}))


# --- Chrome trace ---------------------------------------------------------------------------
def test_chrome_events_fields_and_metadata():
    tracer = Tracer(rank=1)
    with tracer.span("backward"):
        tracer.end(tracer.begin("all_reduce", bucket=0))
    events = tracer.chrome_events()
    meta = [e for e in events if e["ph"] == "M"]
    complete = [e for e in events if e["ph"] == "X"]
    assert {(e["name"], e["pid"], e.get("tid"), e["args"].get("name")) for e in meta} >= {
        ("process_name", 1, None, "rank 1"),
        ("thread_name", 1, 0, "compute"),
        ("thread_name", 1, 1, "comm"),
    }
    backward, comm = complete
    assert (backward["name"], backward["cat"], backward["pid"], backward["tid"]) == (
        "backward",
        "compute",
        1,
        0,
    )
    assert (comm["name"], comm["cat"], comm["tid"], comm["args"]) == (
        "all_reduce",
        "comm",
        1,
        {"bucket": 0},
    )
    spans = tracer.spans()
    for event, span in zip(complete, spans, strict=True):
        assert event["ts"] == pytest.approx((span.start_ns - tracer.origin_ns) / 1e3)
        assert event["dur"] == pytest.approx(span.duration_ns / 1e3)
        assert isinstance(event["ts"], float) and event["ts"] >= 0
    shifted = tracer.chrome_events(origin_ns=tracer.origin_ns - 5_000)  # 5 us earlier
    assert shifted[-1]["ts"] == pytest.approx(complete[-1]["ts"] + 5.0)


def test_write_chrome_merges_ranks_on_one_origin(tmp_path: Path):
    rank0 = Tracer(rank=0)
    with rank0.span("forward"):
        pass
    rank1 = Tracer(rank=1)  # created later: its own origin_ns differs
    assert rank1.origin_ns > rank0.origin_ns
    with rank1.span("forward"):
        pass
    gathered = pickle.loads(pickle.dumps(rank1.spans()))  # as a parent gets them from a rank
    by_hand = [_span("all_reduce", 0.5, 2.0, stream="comm", rank=2)]
    path = tmp_path / "runs" / "timeline.json"
    write_chrome(path, [rank0, gathered, by_hand])

    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ms"
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    assert {e["pid"] for e in complete} == {0, 1, 2}
    spans = rank0.spans() + rank1.spans() + by_hand
    origin = min(s.start_ns for s in spans)
    assert min(e["ts"] for e in complete) == 0.0
    for span in spans:  # every rank measured from the same origin
        (event,) = [e for e in complete if e["pid"] == span.rank]
        assert event["ts"] == pytest.approx((span.start_ns - origin) / 1e3)
    assert [p.name for p in path.parent.iterdir()] == ["timeline.json"]  # no temp file left


def test_write_chrome_replaces_and_handles_no_spans(tmp_path: Path):
    path = tmp_path / "t.json"
    path.write_text("old")
    write_chrome(path, [Tracer()])
    assert json.loads(path.read_text()) == {"traceEvents": [], "displayTimeUnit": "ms"}


# --- overlap --------------------------------------------------------------------------------
def test_interval_helpers():
    assert interval_union([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9)]) == [(0, 4), (5, 7), (9, 9)]
    assert total_length(interval_union([(0, 10), (5, 15)])) == 15
    a = interval_union([(0, 10), (20, 30)])
    b = interval_union([(5, 25), (28, 40)])
    assert intersection_length(a, b) == 5 + 5 + 2
    assert intersection_length(a, []) == 0
    assert intersection_length([(0, 5)], [(5, 10)]) == 0


def _comm(start_ms: float, end_ms: float, rank: int = 0) -> Span:
    return _span("all_reduce", start_ms, end_ms, stream="comm", rank=rank)


def test_overlap_fully_hidden():
    report = overlap_report([_span("backward", 0, 10), _comm(2, 8)])
    assert report.comm_s == pytest.approx(6e-3) and report.hidden_s == pytest.approx(6e-3)
    assert report.hidden_fraction == pytest.approx(1.0) and report.comm_share == 0.0
    assert report.total_s == pytest.approx(10e-3) and report.ranks == 1


def test_overlap_half_hidden():
    report = overlap_report([_span("backward", 0, 10), _comm(6, 14)])
    assert report.hidden_fraction == pytest.approx(0.5)
    assert report.exposed_s == pytest.approx(4e-3)
    assert report.total_s == pytest.approx(14e-3)
    assert report.comm_share == pytest.approx(4 / 14)


def test_overlap_not_hidden_and_only_named_compute_counts():
    spans = [_span("forward", 0, 10), _span("backward", 10, 20), _comm(20, 25)]
    spans.append(_span("optimizer_step", 20, 25))
    report = overlap_report(spans)
    assert report.hidden_s == 0.0 and report.hidden_fraction == 0.0
    assert report.comm_share == pytest.approx(5 / 25)
    both = overlap_report(spans, compute_names=("backward", "optimizer_step"))
    assert both.hidden_fraction == pytest.approx(1.0)


def test_overlapping_comm_spans_count_once():
    # two buckets in flight at once (2..8 and 4..12): 10 ms of comm, not 14
    spans = [_span("backward", 0, 10), _comm(2, 8), _comm(4, 12)]
    spans += [_span("backward", 10, 11)]  # touching backward spans merge as well
    report = overlap_report(spans)
    assert report.comm_s == pytest.approx(10e-3)
    assert report.hidden_s == pytest.approx(9e-3)
    assert report.total_s == pytest.approx(12e-3)


def test_overlap_several_ranks_are_averaged_per_rank():
    spans = [_span("backward", 0, 10, rank=0), _comm(0, 10, rank=0)]  # fully hidden
    # rank 1: backward at the same clock times, but its comm is after it: not hidden by rank 0
    spans += [_span("backward", 0, 10, rank=1), _comm(10, 20, rank=1)]
    report = overlap_report(spans)
    assert report.ranks == 2
    assert report.comm_s == pytest.approx(10e-3)  # (10 + 10) / 2 ranks
    assert report.hidden_s == pytest.approx(5e-3)  # (10 + 0) / 2
    assert report.total_s == pytest.approx(15e-3)  # (10 + 20) / 2
    assert report.hidden_fraction == pytest.approx(0.5)
    assert report.comm_share == pytest.approx(10 / 30)
    assert "50% hidden" in report.describe()


def test_overlap_without_spans_or_comm_is_zero():
    empty = overlap_report([])
    assert (empty.comm_s, empty.hidden_fraction, empty.comm_share, empty.ranks) == (0, 0, 0, 0)
    no_comm = overlap_report([_span("backward", 0, 1)])
    assert no_comm.hidden_fraction == 0.0 and no_comm.total_s == pytest.approx(1e-3)
