"""A timeline of compute and communication per rank, viewable in chrome://tracing or Perfetto.

Like Horovod's timeline: a :class:`Tracer` per rank records :class:`Span` s (forward,
backward, each gradient bucket's all-reduce from launch to completion, the optimizer step)
on named *streams*, one row each in the viewer::

    tracer = Tracer(rank=world.rank)
    with tracer.span("forward"):                  # stream "compute"
        loss = model(x)
    token = tracer.begin("all_reduce", bucket=3)  # stream "comm"; an autograd hook
    ...
    tracer.end(token)                             # may run on the comm worker thread
    write_chrome("runs/timeline.json", gathered)  # one file, one row per (rank, stream)

:func:`overlap_report` then says how much of the communication was hidden behind backward.
Times are ``time.perf_counter_ns()``: CLOCK_MONOTONIC on Linux, shared by every process of
one host, so ranks of one host line up exactly; ranks on different hosts do not share it.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

#: What :meth:`Tracer.begin` returns when disabled; :meth:`Tracer.end` ignores it.
NO_TOKEN = 0

Interval = tuple[int, int]


@dataclass(frozen=True)
class Span:
    """One timed stretch on one rank: plain, picklable data."""

    name: str
    stream: str
    start_ns: int
    end_ns: int
    rank: int
    args: dict[str, object] = field(default_factory=dict, hash=False)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


class _SpanScope:
    __slots__ = ("tracer", "name", "stream", "args", "start_ns")

    def __init__(self, tracer: Tracer, name: str, stream: str, args: dict[str, object]) -> None:
        self.tracer, self.name, self.stream, self.args = tracer, name, stream, args
        self.start_ns = 0

    def __enter__(self) -> None:
        self.start_ns = time.perf_counter_ns()

    def __exit__(self, *exc: object) -> None:
        end_ns = time.perf_counter_ns()  # recorded even when the block raised: time was spent
        t = self.tracer
        span = Span(self.name, self.stream, self.start_ns, end_ns, t.rank, self.args)
        with t._lock:
            t._closed.append(span)


_DISABLED_SCOPE: AbstractContextManager[None] = contextlib.nullcontext()


class Tracer:
    """Records spans for one rank. Thread-safe; near-free when ``enabled=False``.

    ``origin_ns`` (the creation time) is where :meth:`chrome_events` puts 0.
    """

    def __init__(self, *, rank: int = 0, enabled: bool = True) -> None:
        self.rank = rank
        self.enabled = enabled
        self.origin_ns = time.perf_counter_ns()
        self._lock = threading.Lock()
        self._closed: list[Span] = []
        self._open: dict[int, tuple[str, str, int, dict[str, object]]] = {}
        self._last_token = NO_TOKEN

    def span(
        self, name: str, *, stream: str = "compute", **args: object
    ) -> AbstractContextManager[None]:
        """``with tracer.span("backward"): ...`` records the block as one span."""
        if not self.enabled:
            return _DISABLED_SCOPE
        return _SpanScope(self, name, stream, args)

    def begin(self, name: str, *, stream: str = "comm", **args: object) -> int:
        """Open a span and return its token for :meth:`end` (which any thread may call)."""
        if not self.enabled:
            return NO_TOKEN
        start_ns = time.perf_counter_ns()
        with self._lock:
            self._last_token += 1
            token = self._last_token
            self._open[token] = (name, stream, start_ns, args)
        return token

    def end(self, token: int) -> None:
        """Close the span ``token`` opened; ValueError if it is not open."""
        if token == NO_TOKEN:
            return
        end_ns = time.perf_counter_ns()
        with self._lock:
            opened = self._open.pop(token, None)
            if opened is not None:
                name, stream, start_ns, args = opened
                self._closed.append(Span(name, stream, start_ns, end_ns, self.rank, args))
        if opened is None:
            raise ValueError(
                f"rank {self.rank}: trace token {token} is not open on this tracer (never "
                f"returned by its begin(), or already ended); end each token exactly once"
            )

    def spans(self) -> list[Span]:
        """Closed spans in start order (spans still open are left out)."""
        with self._lock:
            closed = list(self._closed)
        return sorted(closed, key=_start)

    def clear(self) -> None:
        """Forget the closed spans; open ones stay open and are recorded when they end."""
        with self._lock:
            self._closed.clear()

    def chrome_events(self, origin_ns: int | None = None) -> list[dict[str, Any]]:
        """This rank's spans as Chrome trace events, ``ts`` 0 at ``origin_ns``
        (default: :attr:`origin_ns`; pass a common one to line ranks up)."""
        return chrome_trace_events(
            self.spans(), origin_ns=self.origin_ns if origin_ns is None else origin_ns
        )


def _start(span: Span) -> int:
    return span.start_ns


def _stream_order(stream: str) -> tuple[int, str]:
    known = ("compute", "comm")
    return (known.index(stream) if stream in known else len(known), stream)


def chrome_trace_events(spans: Iterable[Span], *, origin_ns: int) -> list[dict[str, Any]]:
    """Chrome Trace Event Format: metadata naming one process per rank and one thread per
    stream, then one complete ("X") event per span; times in microseconds from ``origin_ns``.

    ``tid`` is a small integer per stream (named by a ``thread_name`` event, and the stream
    is also the event's ``cat``): Perfetto ignores thread names given to string tids.
    """
    ordered = sorted(spans, key=_start)
    streams = sorted({s.stream for s in ordered}, key=_stream_order)
    tid = {stream: i for i, stream in enumerate(streams)}
    events: list[dict[str, Any]] = []
    for rank in sorted({s.rank for s in ordered}):
        events.append(_meta("process_name", rank, None, {"name": f"rank {rank}"}))
        events.append(_meta("process_sort_index", rank, None, {"sort_index": rank}))
        for stream in sorted({s.stream for s in ordered if s.rank == rank}, key=_stream_order):
            events.append(_meta("thread_name", rank, tid[stream], {"name": stream}))
            events.append(
                _meta("thread_sort_index", rank, tid[stream], {"sort_index": tid[stream]})
            )
    for s in ordered:
        events.append(
            {
                "name": s.name,
                "cat": s.stream,
                "ph": "X",
                "ts": (s.start_ns - origin_ns) / 1e3,
                "dur": (s.end_ns - s.start_ns) / 1e3,
                "pid": s.rank,
                "tid": tid[s.stream],
                "args": dict(s.args),
            }
        )
    return events


def _meta(name: str, pid: int, tid: int | None, args: dict[str, object]) -> dict[str, Any]:
    event: dict[str, Any] = {"name": name, "ph": "M", "pid": pid, "args": args}
    if tid is not None:
        event["tid"] = tid
    return event


def write_chrome(
    path: str | os.PathLike[str], tracers_or_span_lists: Iterable[Tracer | Iterable[Span]]
) -> None:
    """Merge ranks' spans into one trace file for chrome://tracing or ui.perfetto.dev.

    The earliest start over all ranks is 0 (one origin, so the ranks line up); the file is
    written to a temporary file beside ``path`` and moved into place, never half-written.
    """
    spans: list[Span] = []
    for item in tracers_or_span_lists:
        spans.extend(item.spans() if isinstance(item, Tracer) else item)
    origin_ns = min((s.start_ns for s in spans), default=0)
    trace = {
        "traceEvents": chrome_trace_events(spans, origin_ns=origin_ns),
        "displayTimeUnit": "ms",
    }
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".trace-", suffix=".json.tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(trace, f, default=str)  # args that JSON cannot hold are written as text
        os.chmod(tmp, 0o644)  # mkstemp made it private; a trace is for sharing
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# --- overlap of communication with computation ----------------------------------------------
def interval_union(intervals: Iterable[Interval]) -> list[Interval]:
    """The same time as ``intervals``, as sorted, disjoint ``(start, end)`` pairs."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def total_length(union: Iterable[Interval]) -> int:
    return sum(end - start for start, end in union)


def intersection_length(a: list[Interval], b: list[Interval]) -> int:
    """Time covered by both ``a`` and ``b``, each a union (sorted and disjoint)."""
    i = j = covered = 0
    while i < len(a) and j < len(b):
        covered += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:  # the interval that ends first cannot meet anything later
            i += 1
        else:
            j += 1
    return covered


@dataclass(frozen=True)
class OverlapReport:
    """How much communication computation hid. Seconds are per rank, averaged over ranks.

    Each rank's times are lengths of interval unions, so overlapping spans count once.
    """

    comm_s: float  # union of the comm stream's spans
    hidden_s: float  # comm_s ∩ union of the spans named in compute_names
    exposed_s: float  # comm_s - hidden_s: communication the step waited for
    total_s: float  # union of all spans: the traced wall time
    hidden_fraction: float  # hidden_s / comm_s (0.0 without communication)
    comm_share: float  # exposed_s / total_s (0.0 without spans)
    ranks: int

    def describe(self) -> str:
        return (
            f"comm {self.comm_s * 1e3:.2f} ms/rank, {self.hidden_fraction:.0%} hidden; "
            f"exposed comm {self.exposed_s * 1e3:.2f} ms = {self.comm_share:.1%} of "
            f"{self.total_s * 1e3:.2f} ms traced ({self.ranks} ranks)"
        )


def overlap_report(
    spans: Iterable[Span],
    *,
    comm_stream: str = "comm",
    compute_names: Iterable[str] = ("backward",),
) -> OverlapReport:
    """Communication hidden behind (and exposed beside) computation, from ranks' spans."""
    names = frozenset(compute_names)
    by_rank: dict[int, list[Span]] = {}
    for s in spans:
        by_rank.setdefault(s.rank, []).append(s)
    comm = hidden = total = 0
    for rank_spans in by_rank.values():
        comm_union = interval_union(
            (s.start_ns, s.end_ns) for s in rank_spans if s.stream == comm_stream
        )
        compute_union = interval_union(
            (s.start_ns, s.end_ns) for s in rank_spans if s.name in names
        )
        comm += total_length(comm_union)
        hidden += intersection_length(comm_union, compute_union)
        total += total_length(interval_union((s.start_ns, s.end_ns) for s in rank_spans))
    ranks = len(by_rank)
    per_rank_s = 1e-9 / max(ranks, 1)
    return OverlapReport(
        comm_s=comm * per_rank_s,
        hidden_s=hidden * per_rank_s,
        exposed_s=(comm - hidden) * per_rank_s,
        total_s=total * per_rank_s,
        hidden_fraction=hidden / comm if comm else 0.0,
        comm_share=(comm - hidden) / total if total else 0.0,
        ranks=ranks,
    )
