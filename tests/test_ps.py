"""The parameter server against the single-process oracle, and its failure modes.

Sync mode averages the workers' shard gradients (summed in worker-rank order) where the
oracle averages over the global batch in one reduction: float32 rounding only, so the
DDP tolerance (2e-5 absolute + 2e-4 relative after 5 steps) applies. One asynchronous
worker computes exactly what plain training computes, so that comparison is bitwise.
"""

from __future__ import annotations

import time

import pytest
import torch

from plait.launch.pool import RankExited
from plait.strategies.ps import Header, Kind, Liveness, MalformedMessage, Server, decode
from plait.strategies.ps.liveness import last_beat
from plait.strategies.zero import partition
from tests import ddp_fns, faultlog, ps_fns

STEPS = 5
TOL = {"rtol": 2e-4, "atol": 2e-5}


def _close(got: list[torch.Tensor], want: list[torch.Tensor], **tol: float) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **(tol or TOL))


@pytest.mark.parametrize(
    "world,servers", [(2, 1), (3, 1), (4, 1), (4, 2)], ids=["1s1w", "1s2w", "1s3w", "2s2w"]
)
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_sync_matches_single_process_oracle(ranks, world, servers, opt):
    want = ddp_fns.oracle(STEPS, opt)
    results = ranks(world, ps_fns.train_ps, STEPS, opt, {"mode": "sync", "servers": servers})
    assert [r["role"] for r in results] == ["server"] * servers + ["worker"] * (world - servers)
    for r in results:  # workers hold the last version, servers gathered it
        _close(r["params"], want)
    for r in results[servers:]:
        assert r["version"] == STEPS
        assert r["stats"].versions == list(range(STEPS))
    for r in results[:servers]:
        assert r["stats"].updates == STEPS
        assert r["stats"].staleness == {0: STEPS * (world - servers)}


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_async_with_one_worker_is_plain_training(ranks, opt):
    want = ps_fns.single_worker(STEPS, opt, "async")
    results = ranks(2, ps_fns.train_ps, STEPS, opt, {"mode": "async"})
    for r in results:
        for a, b in zip(r["params"], want, strict=True):
            assert torch.equal(a, b)
    assert results[0]["stats"].staleness == {0: STEPS}


def test_async_records_staleness_and_applies_every_push(ranks):
    results = ranks(4, ps_fns.train_ps, 6, "sgd", {"mode": "async"})
    server = results[0]["stats"]
    assert server.updates == server.gradients == 3 * 6
    assert sum(server.staleness.values()) == 18
    assert all(s >= 0 for s in server.staleness)
    for r in results[1:]:
        versions = r["stats"].versions
        assert versions == sorted(versions) and versions[-1] <= 18


@pytest.mark.parametrize("bound", [0, 2])
def test_ssp_never_exceeds_its_bound_under_a_straggler(ranks, bound):
    options = {"mode": "ssp", "staleness": bound}
    results = ranks(4, ps_fns.train_ps, 10, "sgd", options, step_sleep={3: 0.03})
    server = results[0]["stats"]
    assert server.clock_gaps, "no pull was answered"
    assert max(server.clock_gaps) <= bound
    assert server.ssp_waits > 0  # the straggler made the fast workers wait
    assert server.updates == 30
    # a fast worker's versions never run more than (bound + 1) * W updates ahead
    fast = results[1]["stats"].versions
    assert all(b - a <= (bound + 1) * 3 for a, b in zip(fast, fast[1:], strict=False))


def test_backup_workers_drop_the_late_gradient(ranks):
    options = {"mode": "sync", "backup_workers": 1}
    results = ranks(4, ps_fns.train_ps, 6, "sgd", options, step_sleep={3: 0.05})
    server = results[0]["stats"]
    assert server.dropped > 0
    assert server.gradients == 18
    assert server.updates + server.dropped >= 6
    assert results[3]["stats"].steps == 6  # the straggler ran every step, some were dropped


def test_sharding_round_trips_every_parameter(ranks):
    results = ranks(4, ps_fns.train_ps, 0, "sgd", {"mode": "sync", "servers": 3})
    model = ddp_fns.make_model()  # rank 0's model: every rank must end with it
    want = [p.detach() for p in model.parameters()]
    for r in results:
        for a, b in zip(r["params"], want, strict=True):
            assert torch.equal(a, b)


def test_partition_covers_each_element_once():
    numels = [6, 3, 10, 1]
    for servers in range(1, 8):
        pieces = partition(numels, servers)
        seen = {i: [0] * n for i, n in enumerate(numels)}
        sizes = []
        for part in pieces:
            sizes.append(sum(p.stop - p.start for p in part))
            for p in part:
                for k in range(p.start, p.stop):
                    seen[p.param][k] += 1
        assert all(c == 1 for counts in seen.values() for c in counts)
        assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(
    "raw,needle",
    [
        ([0x1234, 1, 0, 0, 5, 0, 0, 0], "not a plait parameter-server header"),
        ([0x504C4149, 42, 0, 0, 5, 0, 0, 0], "unknown kind 42"),
        ([0x504C4149, int(Kind.PARAMS), 0, 0, 5, 0, 0, 0], "only ['PUSH'"),
        ([0x504C4149, int(Kind.PUSH), 0, 1, 5, 0, 0, 0], "for shard 1"),
        ([0x504C4149, int(Kind.PUSH), 0, 0, 6, 0, 0, 0], "announces 6 elements"),
        ([0x504C4149, int(Kind.PUSH), -3, 0, 5, 0, 0, 0], "negative version"),
        ([0x504C4149, 1, 0], "not a plait parameter-server header"),
    ],
)
def test_malformed_headers_are_rejected_naming_the_sender(raw, needle):
    with pytest.raises(MalformedMessage, match="rank 7") as info:
        decode(
            torch.tensor(raw, dtype=torch.int64),
            sender=7,
            kinds=(Kind.PUSH, Kind.PULL),
            shard=0,
            length=5,
        )
    assert needle in str(info.value)
    assert info.value.sender == 7


def test_header_round_trips():
    h = Header(Kind.PUSH, version=12, shard=1, length=99, clock=4, lr=0.0123, extra=0)
    assert decode(h.encode(), sender=0, kinds=(Kind.PUSH,), shard=1, length=99) == h


def test_malformed_message_in_async_drops_only_its_sender(ranks):
    results = ranks(4, ps_fns.rogue, 4, {"mode": "async"}, 2)
    server = results[0]["stats"]
    assert list(server.failed_workers) == [2]
    assert "rank 2" in server.failed_workers[2]
    assert "not a plait parameter-server header" in server.failed_workers[2]
    assert results[1]["stats"].steps == results[3]["stats"].steps == 4
    assert server.updates == 8


def test_malformed_message_in_sync_stops_with_the_sender_named(ranks):
    results = ranks(3, ps_fns.rogue, 4, {"mode": "sync"}, 2)
    assert results[0]["role"] == "error"
    assert "WorkerFailed" in results[0]["error"] and "worker rank 2" in results[0]["error"]
    assert results[1]["role"] == "error"
    assert "worker rank 2 failed" in results[1]["error"]


def test_a_killed_worker_in_async_does_not_stop_the_others(ranks):
    results = ranks(
        4,
        ps_fns.guarded,
        "train_ps",
        6,
        "sgd",
        {"mode": "async", "timeout": 20},
        die_after={3: 2},
        may_exit=[3],
        timeout=60,
    )
    assert isinstance(results[3], RankExited) and results[3].exit_code == 17
    server = results[0]["stats"]
    assert list(server.failed_workers) == [3]
    assert "rank 3" in server.failed_workers[3]
    assert results[1]["stats"].steps == results[2]["stats"].steps == 6
    assert server.updates == 6 + 6 + 2


def test_a_killed_worker_in_sync_stops_everyone_naming_it(ranks):
    results = ranks(
        3,
        ps_fns.guarded,
        "train_ps",
        6,
        "sgd",
        {"mode": "sync", "timeout": 20},
        die_after={2: 2},
        may_exit=[2],
        timeout=60,
    )
    assert isinstance(results[2], RankExited)
    assert "worker rank 2 failed" in results[0]["error"]
    assert "worker rank 2 failed" in results[1]["error"]


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_server_restart_from_checkpoint_continues_from_the_saved_version(ranks, tmp_path, opt):
    want = ddp_fns.oracle(STEPS, opt)
    options = {"mode": "sync", "checkpoint_dir": str(tmp_path), "checkpoint_every": 1}
    first = ranks(3, ps_fns.train_ps, 3, opt, options)
    assert first[0]["stats"].checkpoints == 3
    resumed = ranks(3, ps_fns.train_ps, STEPS, opt, {**options, "resume": True})
    assert resumed[0]["stats"].start_version == 3
    assert resumed[0]["stats"].version == STEPS
    for r in resumed[1:]:
        assert r["stats"].versions == [3, 4]
    for r in resumed:
        _close(r["params"], want)


def test_checkpoint_on_request(ranks, tmp_path):
    options = {"mode": "sync", "checkpoint_dir": str(tmp_path)}
    ranks(3, ps_fns.train_ps, STEPS, "sgd", options, save_at=2)
    saved = torch.load(tmp_path / "server-0.pt", weights_only=True)
    assert saved["version"] == 2
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    "options,needle",
    [
        ({"mode": "ssp"}, "needs staleness"),
        ({"mode": "async", "staleness": 2}, "'ssp' only"),
        ({"mode": "async", "backup_workers": 1}, "'sync' only"),
        ({"mode": "sync", "backup_workers": 1}, "must be in 0..0"),
        ({"servers": 2}, "at least one server and one worker"),
        ({"mode": "hogwild"}, "mode must be one of"),
        ({"resume": True}, "need checkpoint_dir"),
        ({"slow_workers": {0: 3.0}}, "keys must be worker ranks"),
        ({"mode": "ssp", "staleness": 1, "max_staleness": 3}, "mode='async' only"),
        ({"mode": "async", "max_staleness": -1}, "integer >= 0"),
    ],
)
def test_bad_configuration_is_refused_up_front(ranks, options, needle):
    for message in ranks(2, ps_fns.validation_error, options):
        assert needle in message


# --- liveness: heartbeats, not receive timeouts; step-stamped pushes ------------------------


class _FakeGroup:
    """What a Server reads of its group outside the handler threads."""

    global_rank, rank, size, name, ranks, timeout = 0, 0, 3, "fake", [0, 1, 2], 30.0


def _server(
    mode: str, tmp_path=None, resume: bool = False, momentum=0.0, dtype=torch.float32, **extra
) -> Server:
    return Server(
        group=_FakeGroup(),  # type: ignore[arg-type]
        index=0,
        shard=torch.zeros(4, dtype=dtype),
        make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=momentum),
        workers=[1, 2],
        mode=mode,
        staleness=0,
        backup_workers=0,
        checkpoint_dir=tmp_path,
        checkpoint_every=1 if tmp_path is not None else 0,
        resume=resume,
        liveness=Liveness(timeout=5, read=lambda r: None),
        **extra,
    )


def _push(server: Server, worker: int, clock: int, stale: int = 0, grad=None) -> None:
    server._queued += 1
    header = Header(Kind.PUSH, server.version - stale, 0, 4, clock=clock, lr=0.1)
    server._push(worker, header, torch.ones_like(server.param) if grad is None else grad)


# --- staleness-aware asynchronous updates (issue 26.18) -------------------------------------

GRADS = [torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64) * (k + 1) for k in range(4)]


@pytest.mark.parametrize("aware", [True, False])
def test_async_divides_a_stale_gradient_by_its_staleness_momentum_included(aware):
    """Zhang et al.'s lr / staleness, applied to the gradient so that SGD's momentum buffer
    takes the stale gradient damped too; against one process in float64."""
    server = _server("async", momentum=0.9, dtype=torch.float64, staleness_aware=aware)
    stale = [0, 1, 3, 2]  # versions behind the server's at each push
    for clock, (k, g) in enumerate(zip(stale, GRADS, strict=True)):
        _push(server, 1, clock, stale=k, grad=g.clone())
    param = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    oracle = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    for k, g in zip(stale, GRADS, strict=True):
        param.grad = g / k if aware and k > 1 else g
        oracle.step()
    assert torch.equal(server.param.detach(), param.detach())
    assert server.stats.staleness == {0: 1, 1: 1, 3: 1, 2: 1}
    assert server.stats.scaled == (2 if aware else 0) and server.stats.refused == 0


def test_async_refuses_a_gradient_staler_than_max_staleness_and_says_so():
    server = _server("async", max_staleness=2)
    _push(server, 1, 0, stale=2)  # at the bound: applied
    with pytest.warns(RuntimeWarning, match=r"worker rank 1 with staleness 3 > max_staleness=2"):
        _push(server, 1, 1, stale=3)
    before = server.param.detach().clone()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per worker, counted every time
        _push(server, 1, 2, stale=5)
    assert torch.equal(server.param.detach(), before)
    assert (server.stats.updates, server.stats.refused, server.version) == (1, 2, 1)
    assert server.clocks[1] == 3  # refused stamps are consumed: a retry is a duplicate
    with pytest.warns(RuntimeWarning, match="worker rank 2"):
        _push(server, 2, 0, stale=4)


def test_a_push_whose_clock_was_applied_is_ignored_and_counted():
    server = _server("async")
    _push(server, 1, 0)
    _push(server, 1, 0)  # a retry of the same stamp
    _push(server, 1, 1)
    assert (server.stats.updates, server.stats.duplicates) == (2, 1)
    assert torch.allclose(server.param, torch.full((4,), -0.2))
    sync = _server("sync")
    _push(sync, 1, 0)
    _push(sync, 1, 0)  # pending for this version already
    _push(sync, 2, 0)
    assert (sync.stats.updates, sync.stats.duplicates, sync.version) == (1, 1, 1)
    assert torch.allclose(sync.param, torch.full((4,), -0.1))


def test_a_resumed_server_ignores_pushes_its_checkpoint_already_holds(tmp_path):
    first = _server("async", tmp_path)
    for clock in (0, 1):
        _push(first, 1, clock)
    resumed = _server("async", tmp_path, resume=True)
    assert resumed.version == 2 and resumed.clocks == {1: 2, 2: 0}
    _push(resumed, 1, 1)  # replayed after the restart: applied before it
    _push(resumed, 1, 2)
    assert (resumed.stats.updates, resumed.stats.duplicates) == (1, 1)
    assert torch.allclose(resumed.param, torch.full((4,), -0.3))  # three updates, none twice


def test_liveness_reads_the_heartbeat_key_and_tells_slow_from_dead():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set("plait/heartbeat/3", f"{time.time():.3f}")
    store.set("plait/heartbeat/4", f"{time.time() - 9:.3f}")
    live = Liveness(timeout=5, read=lambda r: last_beat(r, store))
    assert live.dead(3) is None
    why = live.dead(4)
    assert why is not None and "no heartbeat for 9." in why and "5s heartbeat timeout" in why
    assert live.dead(5) is None  # never beat: unknown, left to its connection


def test_a_slow_but_alive_worker_past_the_heartbeat_timeout_is_never_dropped(ranks):
    """Issue 16.5: a straggler silent for longer than the timeout, but beating, used to be
    dropped (gloo receive timeout) along with a healthy worker."""
    options = {"mode": "async", "timeout": 1.0}
    results = ranks(
        4, ps_fns.stall_worker, 4, options, slow_rank=3, pause_s=2.5, at_step=1, timeout=120
    )
    server = results[0]["stats"]
    assert server.failed_workers == {} and server.errors == []
    assert sorted(server.finished_workers) == [1, 2, 3]
    assert server.updates == server.gradients == 12 and server.duplicates == 0
    assert all(r["stats"].steps == 4 for r in results[1:])
    assert results[0]["beat"] is not None  # judged by a real heartbeat
    assert all(r["may_exit"] == b"1" for r in results[1:])


@pytest.mark.faults
def test_a_hung_worker_is_named_by_its_heartbeat_and_async_training_goes_on(ranks, tmp_path):
    timeout = 1.5
    results = ranks(
        4,
        ps_fns.hung_worker,
        6,
        {"mode": "async", "timeout": timeout},
        hung_rank=3,
        pid_file=str(tmp_path / "pid"),
        may_exit=[3],
        timeout=120,
    )
    assert isinstance(results[3], RankExited)
    server = results[0]["stats"]
    assert list(server.failed_workers) == [3]
    assert "no heartbeat" in server.failed_workers[3]
    detected = server.failed_at[3] - results[0]["stopped_at"]
    # never before the threshold, counted from the last beat (beats every 0.5 s)
    assert detected >= timeout - 0.6
    assert results[1]["stats"].steps == results[2]["stats"].steps == 6
    assert server.updates == 6 + 6 + 2 and server.errors == []
    faultlog.record(
        row=2,
        fault="SIGSTOP a parameter-server worker (async)",
        detected_after_s=round(detected, 3),
        named_correctly=True,
        recovered_after_s=0.0,
        state_equal=None,
        heartbeat_timeout_s=timeout,
    )


@pytest.mark.faults
def test_a_killed_server_is_named_by_every_worker_and_a_restart_resumes_exactly(ranks, tmp_path):
    """Row 21: the server dies (os._exit) mid-training; every worker raises ServerLost
    naming it; the job restarted with resume=True continues from the server's last
    checkpoint and ends where uninterrupted training ends (no update lost or doubled)."""
    steps = 8
    want = ddp_fns.oracle(steps, "sgd")
    options = {"mode": "sync", "checkpoint_dir": str(tmp_path), "checkpoint_every": 1}
    kill_file = tmp_path / "killed"
    first = ranks(
        3,
        ps_fns.killed_server,
        steps,
        "sgd",
        options,
        kill_at_version=2,
        kill_file=str(kill_file),
        may_exit=[0],
        timeout=120,
    )
    assert isinstance(first[0], RankExited) and first[0].exit_code == 17
    killed_at, killed_version = kill_file.read_text().split()
    assert int(killed_version) < steps
    for r in first[1:]:
        assert r["role"] == "error" and r["error"].startswith("ServerLost"), r
        assert "parameter server 0 (rank 0)" in r["error"] and r["server"] == 0
    detected = max(r["at"] for r in first[1:]) - float(killed_at)
    t0 = time.time()
    resumed = ranks(3, ps_fns.train_ps, steps, "sgd", {**options, "resume": True}, timeout=120)
    recovered = time.time() - t0
    server = resumed[0]["stats"]
    assert server.start_version >= int(killed_version) and server.version == steps
    assert server.duplicates == 0
    for r in resumed:
        _close(r["params"], want)
    faultlog.record(
        row=21,
        fault="parameter server killed (os._exit) at version >= 2, restarted with resume",
        detected_after_s=round(detected, 3),
        named_correctly=True,
        recovered_after_s=round(recovered, 3),
        state_equal=True,
        resumed_from_version=server.start_version,
    )


def test_under_plait_run_an_async_job_finishes_when_a_worker_dies():
    """Issue 16.5: async workers set plait/launch/may_exit/<rank> at wrap, so `plait run`
    lets one die; the server names it and the job ends with exit code 0."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "plait.cli", "run", "-n", "4", "--timeout", "240",
         "tests/scripts/ps_async_dies.py", "3"],
        cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "server: 14 updates, failed {3: 'rank 0 could not receive from worker rank 3" in (
        proc.stdout
    )
    assert proc.stdout.count(": 6 steps") == 2


def test_a_rank_with_another_model_is_refused_at_wrap_on_every_rank(ranks):
    for message in ranks(3, ps_fns.different_model, {"mode": "sync"}, 2, timeout=120):
        assert "ParameterServer" in message and "rank 2" in message


@pytest.mark.faults
def test_a_hung_server_is_named_by_every_worker_within_the_heartbeat_timeout(ranks, tmp_path):
    """Row 21, hang variant: the server stops (SIGSTOP), its connections stay open, so only
    its heartbeat tells; every worker raises ServerLost naming it."""
    timeout = 1.5
    results = ranks(
        3,
        ps_fns.hung_server,
        200,
        {"mode": "async", "timeout": timeout},
        stop_after_s=3.0,  # into serving: the wrap before it takes over 1 s here now
        pid_file=str(tmp_path / "pid"),
        may_exit=[0],
        timeout=120,
    )
    assert isinstance(results[0], RankExited)
    for r in results[1:]:
        assert r["role"] == "error" and r["error"].startswith("ServerLost"), r
        assert "parameter server 0 (rank 0)" in r["error"], r
        # usually the heartbeat tells; on a loaded machine a stopped server can be caught
        # first by a worker's bounded send or receive, which names it the same way
        assert any(
            w in r["error"] for w in ("no heartbeat", "could not send", "could not receive")
        ), r
        assert r["server"] == 0
    detected = max(r["at"] for r in results[1:]) - results[1]["stopped_at"]
    assert detected >= timeout - 0.6  # judged by the heartbeat, not sooner
    faultlog.record(
        row=21,
        fault="parameter server stopped (SIGSTOP): workers judge it by its heartbeat",
        detected_after_s=round(detected, 3),
        named_correctly=True,
        heartbeat_timeout_s=timeout,
    )
