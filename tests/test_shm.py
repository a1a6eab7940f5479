"""The shared-memory transport: choice per peer, byte counts, large and mismatched messages,
mixed transports (ring_tree across simulated hosts), failures named in time, and no
segment left in /dev/shm. The collective grid over it is in test_collectives.py."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from plait import RankPool
from plait.comm import shm, transport, tuner
from plait.launch.pool import RankExited
from tests import shm_fns

pytestmark = pytest.mark.skipif(
    transport.unsupported("gloo") is not None, reason="no shared memory transport here"
)


def _segments() -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(transport.PREFIX))


@pytest.fixture(scope="module")
def shm_pools() -> Iterator[dict[int, RankPool]]:
    pools: dict[int, RankPool] = {}
    yield pools
    for pool in pools.values():
        pool.close()


def _pool(pools: dict[int, RankPool], world: int, **env: str) -> RankPool:
    key = (world, tuple(sorted(env.items())))
    pool = pools.get(key)  # type: ignore[call-overload]
    if pool is None or pool.closed:
        pool = RankPool(world, timeout=60, env={"PLAIT_TRANSPORT": "shm", **env})
        pools[key] = pool  # type: ignore[index]
    return pool


# --- in one process ------------------------------------------------------------------------
def test_mode_is_checked(monkeypatch):
    assert transport.parse_mode("SHM") == "shm"
    monkeypatch.setenv("PLAIT_TRANSPORT", "gloo")
    assert transport.parse_mode(None) == "gloo"
    monkeypatch.setenv("PLAIT_TRANSPORT", "tcp")
    with pytest.raises(ValueError, match="PLAIT_TRANSPORT='tcp'.*auto, shm, gloo"):
        transport.parse_mode(None)
    monkeypatch.setenv("PLAIT_SHM_RING_BYTES", "1000")
    with pytest.raises(ValueError, match="PLAIT_SHM_RING_BYTES='1000'"):
        transport._bytes_setting("PLAIT_SHM_RING_BYTES", 4096)


def test_stale_segments_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(dead.stdout)
    stale = tmp_path / f"{transport.PREFIX}{pid}-abcd-0-0"
    alive = tmp_path / f"{transport.PREFIX}{os.getpid()}-abcd-0-0"
    other = tmp_path / "someone-else"
    for p in (stale, alive, other):
        p.write_bytes(b"x")
    removed = transport.remove_stale(str(tmp_path))
    assert removed == [str(stale)]
    assert not stale.exists() and alive.exists() and other.exists()


def test_auto_picks_the_shared_memory_collectives(tmp_path, monkeypatch):
    monkeypatch.setenv("PLAIT_TUNE_FILE", str(tmp_path / "none.json"))
    tuner.load()
    assert tuner.choose("all_reduce", 4096, 2, shm=True) == "shm"
    assert tuner.choose("reduce_scatter", 1 << 26, 4, shm=True) == "shm"
    assert tuner.choose("all_reduce", 4096, 2) == tuner.default_rule("all_reduce", 4096, 2)
    # a table measured on gloo is not used for a group sharing memory, and vice versa
    table = {"all_reduce": {2: [(1 << 62, "ring")]}}
    tuner.save(table, tmp_path / "gloo.json", backend="gloo")
    tuner.load(tmp_path / "gloo.json")
    assert tuner.choose("all_reduce", 4096, 2) == "ring"
    assert tuner.choose("all_reduce", 4096, 2, shm=True) == "shm"
    tuner.save({"all_reduce": {2: [(1 << 62, "naive")]}}, tmp_path / "s.json", "gloo", "shm")
    tuner.load(tmp_path / "s.json")
    assert tuner.choose("all_reduce", 4096, 2, shm=True) == "naive"
    assert tuner.choose("all_reduce", 4096, 2) == tuner.default_rule("all_reduce", 4096, 2)
    tuner.load(tmp_path / "none.json")


def test_layout_leaves_room_for_every_signal_slot():
    first, stride, scratch = shm.layout(8, 7, 4096, 8192)
    assert first >= shm._SIGNALS + 128 * 8 and first % 4096 == 0
    assert scratch == first + 7 * stride


# --- on ranks -------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3])
def test_every_peer_on_this_host_goes_through_shared_memory(shm_pools, world):
    out = _pool(shm_pools, world).run(shm_fns.links, timeout=60)
    for r, o in enumerate(out):
        assert o["peers"] == [p for p in range(world) if p != r]
        assert o["shared"] is True
    assert all(o["files"] == [] or all(str(os.getpid()) not in f for f in o["files"]) for o in out)
    assert _segments() == []  # unlinked once every peer mapped them


@pytest.mark.parametrize("world", [2, 3])
def test_ring_counts_the_same_bytes_as_on_gloo(shm_pools, world):
    numel = 3001
    out = _pool(shm_pools, world).run(shm_fns.ring_bytes, numel, timeout=60)
    for sent, received in out:
        # 2(n-1)/n of the tensor, chunk by chunk (chunks differ by one element at most)
        assert abs(sent - 2 * (world - 1) / world * numel * 4) <= 2 * world * 4
        assert sent == received or world > 2


def test_messages_longer_than_the_ring(shm_pools):
    pool = _pool(shm_pools, 2, PLAIT_SHM_RING_BYTES="4096")
    assert pool.run(shm_fns.p2p_large, 300_001, 5, timeout=60) == [True, True]


def test_a_size_mismatch_is_named_not_copied(shm_pools):
    out = RankPool(2, timeout=5, env={"PLAIT_TRANSPORT": "shm"})
    try:
        res = out.run(shm_fns.size_mismatch, timeout=60)
    finally:
        out.close()
    assert "size mismatch" in res[1] and "rank 0" in res[1], res[1]
    assert "send" in res[0] and "rank 1" in res[0], res[0]


def test_ring_tree_mixes_transports_across_simulated_hosts(shm_pools):
    numel = 10_007
    out = _pool(shm_pools, 4, PLAIT_NODE_SIZE="2").run(shm_fns.ring_tree_mixed, numel, timeout=120)
    assert [o["peers"] for o in out] == [[1], [0], [3], [2]]  # node peers only
    assert not any(o["auto_shared"] for o in out)
    for o in out:
        assert o["close"]
        assert torch.equal(o["result"], out[0]["result"])  # bitwise the same everywhere


def test_disagreeing_ranks_are_named_without_exchanging(shm_pools):
    pool = RankPool(2, timeout=30, env={"PLAIT_TRANSPORT": "shm"})
    try:
        out = pool.run(shm_fns.disagree, timeout=60)
    finally:
        pool.close()
    for text in out:
        assert text.startswith("CollectiveMismatch"), text


# the collective timeout of the pools below: a failure named in time comes before it (the
# old behaviour, spinning on a dead or stopped peer, waited it out); the run's own timeout
# (2x) is the hang guard
COLLECTIVE_TIMEOUT_S = 60.0


@pytest.mark.parametrize("algorithm", ["shm", "ring"])
def test_a_killed_rank_is_named_before_the_timeout(algorithm):
    pool = RankPool(3, timeout=COLLECTIVE_TIMEOUT_S, env={"PLAIT_TRANSPORT": "shm"})
    try:
        out = pool.run(
            shm_fns.killed_mid_collective,
            algorithm,
            may_exit=[1],
            timeout=2 * COLLECTIVE_TIMEOUT_S,
        )
    finally:
        pool.close()
    assert isinstance(out[1], RankExited)
    for r in (0, 2):
        assert out[r]["error"], out[r]
        # the dead peer (or the rank that gave up on it) is named: not a timeout
        assert not out[r]["error"].startswith("CollectiveTimeout"), out[r]
        assert out[r]["seconds"] < COLLECTIVE_TIMEOUT_S, out[r]  # about a second here
    named = [r for r in (0, 2) if "rank 1" in out[r]["error"]]
    assert named, out  # whoever waited on rank 1 names it; the other names whoever gave up


def test_a_stopped_rank_is_named_within_the_heartbeat_timeout():
    env = {"PLAIT_TRANSPORT": "shm", "PLAIT_HEARTBEAT_TIMEOUT": "1"}
    pool = RankPool(2, timeout=COLLECTIVE_TIMEOUT_S, env=env)
    try:
        out = pool.run(shm_fns.stopped_mid_collective, timeout=2 * COLLECTIVE_TIMEOUT_S)
    finally:
        pool.close()
    # named by its heartbeat (1 s), not by the collective timeout
    assert out[0]["error"].startswith("PeerUnresponsive"), out[0]
    assert "heartbeat timeout of 1s" in out[0]["error"], out[0]
    assert "rank 1" in out[0]["error"], out[0]
    assert out[0]["seconds"] < COLLECTIVE_TIMEOUT_S, out[0]  # about a second here


def test_no_segment_outlives_the_pools(shm_pools):
    for pool in shm_pools.values():
        pool.close()
    shm_pools.clear()
    assert _segments() == []


# --- /dev/shm too small or filled later (issue 26 item 16) ---------------------------------
def test_a_segment_reserves_every_byte_at_creation(tmp_path):
    """A sparse scratch window ended in SIGBUS when /dev/shm filled up before its first
    touch; now every block is reserved when the segment is made."""
    path = str(tmp_path / f"{transport.PREFIX}{os.getpid()}-test")
    first, stride, scratch_at = shm.layout(2, 1, 4096, 1 << 20)
    size = scratch_at + 2 * (1 << 20)
    seg = shm.Segment(path, size, create=True)
    try:
        assert os.stat(path).st_blocks * 512 >= size
    finally:
        seg.close()
        os.unlink(path)


def test_no_room_for_a_segment_names_the_directory_and_the_sizes(tmp_path, monkeypatch):
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    path = str(tmp_path / f"{transport.PREFIX}{os.getpid()}-full")
    with pytest.raises(OSError) as info:
        shm.Segment(path, 5 << 20, create=True)
    text = str(info.value)
    assert f"{tmp_path}: could not reserve 5,242,880 bytes" in text, text
    assert "bytes free of" in text and "No space left on device" in text, text
    assert "PLAIT_TRANSPORT=gloo" in text, text
