"""Overlap on a device backend, as an ordering record (not a timing): on PyTorch's fake
backend, which plait treats as a device backend like NCCL, an asynchronous native
collective hands the backend's ``Work`` to the caller's ``Handle`` before it completes,
and DDP and FSDP wait for it on the caller's thread where their docstrings say:
DDP's bucket all-reduces are issued during backward and waited at its end; FSDP's
prefetched all-gather of the next unit is issued before the current unit computes and
waited when the next unit starts; its reduce-scatters are issued in each unit's
post-backward and waited at the end of backward.

Every backend call goes through :class:`_Recorder`, whose ``Work`` reports itself
incomplete until waited and logs which thread waited."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import plait
from plait import comm
from plait.comm import native
from plait.strategies.data_parallel import grad_sync
from tests import meta_device_fns as fns

pytestmark = pytest.mark.timeout(60)


class _Work:
    """A backend ``Work`` that is incomplete until waited, logging the wait."""

    def __init__(self, real: Any, log: list[tuple[str, ...]], name: str) -> None:
        self.real, self.log, self.name, self.done = real, log, name, False

    def wait(self, timeout: Any = None) -> bool:
        self.log.append(("wait", self.name, threading.current_thread().name))
        self.done = True
        return bool(self.real.wait())

    def is_completed(self) -> bool:
        return self.done

    def get_future(self) -> Any:
        return self.real.get_future()


class _Recorder:
    """Wraps the backend calls plait's native collectives make, logging each issue."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[str, ...]] = []
        dist = native.dist
        for name, real in (
            ("all_reduce", dist.all_reduce),
            ("broadcast", dist.broadcast),
        ):
            monkeypatch.setattr(dist, name, self._wrap(name, real))
        monkeypatch.setattr(
            native, "_all_gather_single", self._wrap("all_gather", native._all_gather_single)
        )
        monkeypatch.setattr(
            native,
            "_reduce_scatter_single",
            self._wrap("reduce_scatter", native._reduce_scatter_single),
        )

    def _wrap(self, name: str, real: Any) -> Any:
        def issue(*args: Any, **kwargs: Any) -> Any:
            work = real(*args, **kwargs)
            self.log.append(("issue", name, threading.current_thread().name))
            return _Work(work, self.log, name) if kwargs.get("async_op") else work

        return issue

    def mark(self, *entry: str) -> None:
        self.log.append(entry)

    def kinds(self, *kinds: str) -> list[tuple[str, ...]]:
        return [e for e in self.log if e[0] in kinds]


@pytest.fixture
def fake() -> Iterator[plait.comm.Group]:
    with fns.fake_world(8) as world:
        yield world


def test_an_async_native_collective_returns_its_handle_before_completion(fake, monkeypatch):
    rec = _Recorder(monkeypatch)
    main = threading.current_thread().name
    x = torch.empty(16, device="meta")
    calls = {
        "all_reduce": lambda: comm.all_reduce(x, "avg", group=fake, async_op=True),
        "broadcast": lambda: comm.broadcast(x, 1, group=fake, async_op=True),
        "all_gather": lambda: comm.all_gather(
            torch.empty(8 * 16, device="meta"), x, group=fake, async_op=True
        ),
        "reduce_scatter": lambda: comm.reduce_scatter(
            torch.empty(2, device="meta"), x, "avg", group=fake, async_op=True
        ),
    }
    for name, call in calls.items():
        rec.log.clear()
        handle = call()
        assert handle is not None
        # issued on this thread, not waited, and the handle says it is still running
        assert rec.log == [("issue", name, main)], name
        assert not handle.is_completed(), name
        handle.wait()
        assert rec.log == [("issue", name, main), ("wait", name, main)], name
        assert handle.is_completed(), name


def test_a_native_collective_keeps_issue_order_behind_queued_plait_work(fake, monkeypatch):
    """A plait algorithm's asynchronous collective runs on the worker thread; a native
    one issued after it starts only once that one is done (backends match by order)."""
    rec = _Recorder(monkeypatch)
    x = torch.empty(16, device="meta")
    ring = comm.all_reduce(x, "sum", group=fake, algorithm="ring", async_op=True)
    idle_at_issue: list[bool] = []
    real_issue = native.dist.all_reduce

    def checking(*args: Any, **kwargs: Any) -> Any:
        idle_at_issue.append(fake.idle())
        return real_issue(*args, **kwargs)

    monkeypatch.setattr(native.dist, "all_reduce", checking)
    handle = comm.all_reduce(x, "sum", group=fake, algorithm="native", async_op=True)
    assert ring is not None and ring.is_completed() and idle_at_issue == [True]
    assert handle is not None
    handle.wait()
    assert [e[:2] for e in rec.log] == [("issue", "all_reduce"), ("wait", "all_reduce")]


def _mlp(layers: int = 4, width: int = 8) -> nn.Sequential:
    with torch.device("meta"):
        return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def test_ddp_issues_bucket_all_reduces_during_backward_and_waits_at_its_end(fake, monkeypatch):
    rec = _Recorder(monkeypatch)
    real_value_of = grad_sync.value_of

    def value_of(future: Any) -> Any:
        rec.mark("wait", "bucket", threading.current_thread().name)
        return real_value_of(future)

    monkeypatch.setattr(grad_sync, "value_of", value_of)
    model = _mlp()
    for i, layer in enumerate(model):
        layer.register_full_backward_hook(lambda *_, i=i: rec.mark("backward", str(i)))
    mesh = plait.Mesh(dp=4, ranks=range(4))
    # a bucket per parameter: 8 all-reduces per step
    ddp = plait.DistributedDataParallel(model, mesh=mesh, bucket_mb=1e-7, check_finite=None)
    x = torch.empty(4, 8, device="meta", requires_grad=True)
    for _ in range(2):  # the second step runs with the buckets rebuilt in backward order
        rec.log.clear()
        ddp(x).sum().backward()
        log = rec.kinds("issue", "wait", "backward")
        issues = [i for i, e in enumerate(log) if e[:2] == ("issue", "all_reduce")]
        waits = [i for i, e in enumerate(log) if e[:2] == ("wait", "bucket")]
        backward = [i for i, e in enumerate(log) if e[0] == "backward"]
        assert len(issues) == len(waits) == 8, log
        # the first buckets are on the wire while earlier layers still compute ...
        assert issues[0] < backward[-1], log
        # ... and every wait comes after the last gradient, on the caller's thread
        assert min(waits) > max(backward), log
        assert {log[i][2] for i in issues + waits} == {threading.current_thread().name}


def test_fsdp_prefetches_the_next_gather_and_waits_reduce_scatters_at_the_end(fake, monkeypatch):
    rec = _Recorder(monkeypatch)
    model = _mlp()
    for i, layer in enumerate(model):
        layer.register_forward_hook(lambda *_, i=i: rec.mark("forward", str(i)))
        layer.register_full_backward_hook(lambda *_, i=i: rec.mark("backward", str(i)))
    mesh = plait.Mesh(dp=4, ranks=range(4))
    plait.fully_shard(model, mesh=mesh, wrap={nn.Linear})
    x = torch.empty(4, 8, device="meta", requires_grad=True)
    main = threading.current_thread().name
    for step in range(2):
        rec.log.clear()
        model(x).sum().backward()
        log = [e[:2] for e in rec.log]
        assert {e[2] for e in rec.log if e[0] in ("issue", "wait")} == {main}
        if step == 0:
            continue  # the first step records the order the prefetches follow
        forward_end = log.index(("forward", "3"))
        fwd, bwd = log[: forward_end + 1], log[forward_end + 1 :]
        # forward: layer i+1's all-gather is issued before layer i computes and waited
        # after it; backward: the same for the units whose gathers were freed after
        # forward (the last two stay gathered from forward to backward)
        for phase, part, layers in (("forward", fwd, "012"), ("backward", bwd, "21")):
            for i in layers:
                before = part[: part.index((phase, i))]
                assert before.count(("issue", "all_gather")) > before.count(
                    ("wait", "all_gather")
                ), f"no gather in flight while layer {i} runs its {phase}: {log}"
        scatters = [i for i, e in enumerate(bwd) if e == ("issue", "reduce_scatter")]
        scatter_waits = [i for i, e in enumerate(bwd) if e == ("wait", "reduce_scatter")]
        last_backward = max(i for i, e in enumerate(bwd) if e[0] == "backward")
        assert len(scatters) == len(scatter_waits) == 4, bwd
        # reduce-scatters leave during backward and are all waited after it
        assert scatters[0] < last_backward < min(scatter_waits), bwd


def test_ddp_check_finite_reads_nothing_on_the_host_before_a_bucket_leaves(fake, monkeypatch):
    """The default ``check_finite="raise"`` on a device backend keeps its flags on the
    device: on ``meta`` (where any host read raises) every bucket's all-reduce is issued
    and the step stops only at the one read per step, after all of them were waited."""
    rec = _Recorder(monkeypatch)
    model = _mlp()
    mesh = plait.Mesh(dp=4, ranks=range(4))
    ddp = plait.DistributedDataParallel(model, mesh=mesh, bucket_mb=1e-7)
    assert ddp.check_finite == "raise" and ddp.flags_on_device
    x = torch.empty(4, 8, device="meta", requires_grad=True)
    rec.log.clear()  # the wrap-time broadcast
    with pytest.raises(
        NotImplementedError, match="check_finite reads one agreed flag per step on the host"
    ) as info:
        ddp(x).sum().backward()
    assert [e[:2] for e in rec.kinds("issue")] == [("issue", "all_reduce")] * 8
    assert len(rec.kinds("wait")) == 0  # waited through the futures, then the one read
    assert any(entry.name == "_averages_finite" for entry in info.traceback)


def test_fsdp_side_streams_order_issue_and_wait_through_events(monkeypatch):
    """The CUDA-only protocol of ``fsdp/streams.py``, with stand-in streams recording what
    is asked of them (no GPU here): the side stream waits for the compute stream before
    the block, records an event after it, and a wait makes the compute stream wait for
    that event after the collective's own wait. Off CUDA there are no side streams."""
    from plait.strategies.fsdp import streams

    assert streams.for_device(torch.device("cpu")) is None
    assert streams.for_device(torch.device("meta")) is None
    log: list[str] = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name, self.device = name, torch.device("cuda", 0)

        def wait_stream(self, other: Stream) -> None:
            log.append(f"{self.name} waits for {other.name}")

        def record_event(self) -> str:
            log.append(f"event on {self.name}")
            return f"event of {self.name}"

        def wait_event(self, event: str) -> None:
            log.append(f"{self.name} waits for {event}")

    compute, side = Stream("compute"), Stream("all_gather")
    current = [compute]

    class Use:
        def __init__(self, stream: Stream) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            current.append(self.stream)

        def __exit__(self, *exc: object) -> None:
            current.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", Use)

    class Done:
        def wait(self) -> None:
            log.append(f"collective waited on {current[-1].name}")

    with streams.issued_on(side) as issued:
        log.append(f"issue on {current[-1].name}")
        handle = streams.ordered(Done(), issued)
    handle.wait()
    assert log == [
        "all_gather waits for compute",
        "issue on all_gather",
        "event on all_gather",
        "collective waited on compute",
        "compute waits for event of all_gather",
    ]
    with streams.issued_on(None) as plain:
        assert streams.ordered(handle, plain) is handle
