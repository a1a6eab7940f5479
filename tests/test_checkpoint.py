"""Checkpoints: transactions (per-step directories, latest, keep_last, agreement on root and
step), integrity (SHA-256 per file and per block, range reads verified, refusal naming file
and rank, fallback, format v2 read whole), faults during
save (rank killed inside the writer, coordinator killed before the rename, disk full),
async save, and the simple per-rank form. Resharding is in test_checkpoint_reshard.py."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import torch

import plait
from plait import RankPool, checkpoint
from plait.checkpoint import blocks, transaction
from plait.launch.pool import RankExited
from tests import checkpoint_fns, faultlog


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_simple_form_round_trip_and_full_state_dict_keys(ranks, tmp_path: Path):
    results = ranks(2, checkpoint_fns.simple_form, str(tmp_path / "ck"))
    keys = sorted(checkpoint_fns.Net().state_dict())
    for same, full_keys in results:
        assert same and full_keys == keys
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["latest", "owner.json", "step-0"]
    assert sorted(p.name for p in (tmp_path / "ck" / "step-0").iterdir()) == [
        "manifest.json",
        "part-0-of-2.safetensors",
        "part-1-of-2.safetensors",
    ]


def test_per_rank_state_needs_the_saving_world_size(ranks, tmp_path: Path):
    root = tmp_path / "ck"
    ranks(2, checkpoint_fns.save_small, str(root))
    (got,) = ranks(1, checkpoint_fns.load_state, str(root))
    assert got["error"].startswith("ValueError") and "saved by 2 ranks" in got["error"]


def test_steps_latest_and_keep_last(ranks, tmp_path: Path):
    root = tmp_path / "run"
    saved = ranks(2, checkpoint_fns.save_steps, str(root), [10, 20, 30, 40], 2)[0]
    assert checkpoint.committed_steps(root) == [40, 30]
    assert (root / "latest").read_text().strip() == "step-40"
    assert not [p for p in root.iterdir() if p.name.endswith(".partial")]
    latest, older = (
        ranks(2, checkpoint_fns.load_params, str(root)),
        ranks(2, checkpoint_fns.load_params, str(root), step=30),
    )
    for got in latest:
        assert got["step"] == 40 and _equal(got["params"], saved[40])
    for got in older:
        assert got["step"] == 30 and _equal(got["params"], saved[30])
    missing = ranks(2, checkpoint_fns.load_params, str(root), step=10)
    assert all(m["error"] == "CheckpointCorrupt" and "step-10" in m["message"] for m in missing)


def test_ranks_that_pass_different_roots_or_steps_are_named(ranks, tmp_path: Path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    messages = ranks(2, checkpoint_fns.save_with_arguments, [a, b], [1, 1])
    for m in messages:
        assert "rank 1 has" in m and a in m and b in m, m
    messages = ranks(2, checkpoint_fns.save_with_arguments, [a, a], [1, 2])
    for m in messages:
        assert "'step': 2" in m and "rank 1" in m, m
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_rank_that_cannot_encode_its_state_fails_every_rank(ranks, tmp_path: Path):
    mine, other = ranks(2, checkpoint_fns.unsavable_state_on_one_rank, str(tmp_path / "r"), 0)
    assert mine.startswith("TypeError") and "'rank0/bad'" in mine
    assert other.startswith("CheckpointError") and "rank(s) [0]" in other
    assert checkpoint.committed_steps(tmp_path / "r") == []


def test_no_checkpoint_at_all_is_refused(ranks, tmp_path: Path):
    (tmp_path / "run" / "step-3.partial").mkdir(parents=True)
    for got in ranks(2, checkpoint_fns.load_params, str(tmp_path / "run")):
        assert got["error"] == "FileNotFoundError"
        assert "no committed checkpoint" in got["message"] and "step-3.partial" in got["message"]


@pytest.mark.faults
@pytest.mark.parametrize("mode", ["flip", "truncate", "delete"])
def test_damaged_file_is_refused_naming_file_and_rank_then_fallback(ranks, tmp_path, mode):
    root = tmp_path / "run"
    saved = ranks(2, checkpoint_fns.save_steps, str(root), [1, 2], 3)[0]
    victim = root / "step-2" / transaction.part_name(1, 2)
    checkpoint_fns.corrupt(victim, mode)
    problems = checkpoint.verify(root)
    assert len(problems) == 1 and str(victim) in problems[0] and "rank 1" in problems[0]
    assert checkpoint.verify(root, step=1) == []
    t0 = time.monotonic()
    refused = ranks(2, checkpoint_fns.load_params, str(root))
    detected = time.monotonic() - t0
    for got in refused:
        assert got["error"] == "CheckpointCorrupt", got
        assert str(victim) in got["message"] and "written by rank 1" in got["message"]
        assert "fallback=True" in got["message"]
    t1 = time.monotonic()
    back = ranks(2, checkpoint_fns.load_params, str(root), fallback=True)
    recovered = time.monotonic() - t1
    equal = all(b["step"] == 1 and _equal(b["params"], saved[1]) for b in back)
    assert equal
    assert all(len(b["skipped"]) == 1 and str(victim) in b["skipped"][0] for b in back)
    faultlog.record(
        row=10,
        fault=f"{mode} one shard of the latest checkpoint (ws=2)",
        detected_after_s=round(detected, 3),
        named_correctly=True,
        recovered_after_s=round(recovered, 3),
        state_equal=equal,
    )


@pytest.mark.faults
def test_damaged_manifest_is_refused(ranks, tmp_path: Path):
    root = tmp_path / "run"
    ranks(2, checkpoint_fns.save_steps, str(root), [1, 2], 3)
    manifest = root / "step-2" / transaction.MANIFEST
    manifest.write_text(manifest.read_text().replace('"step": 2', '"step": 3'))
    for got in ranks(2, checkpoint_fns.load_params, str(root)):
        assert got["error"] == "CheckpointCorrupt" and str(manifest) in got["message"]


def _kill_during_save(ranks, tmp_path: Path, victim: int, point: str, row_fault: str) -> None:
    root = tmp_path / "run"
    with RankPool(2, timeout=30) as pool:
        results = pool.run(
            checkpoint_fns.die_during_save,
            str(root),
            victim,
            point,
            timeout=120,
            may_exit={victim},
        )
    assert isinstance(results[victim], RankExited)
    survivor = results[1 - victim]
    assert survivor["error"] is not None, "the surviving rank must fail the save"
    named = f"rank {victim}" in survivor["error"]
    assert checkpoint.committed_steps(root) == [1]
    assert (root / "latest").read_text().strip() == "step-1"
    assert (root / "step-2.partial").is_dir()  # left behind, never selected
    t0 = time.monotonic()
    back = ranks(2, checkpoint_fns.load_params, str(root))
    recovered = time.monotonic() - t0
    equal = all(b["step"] == 1 and _equal(b["params"], survivor["first"]) for b in back)
    assert equal
    faultlog.record(
        row=8,
        fault=row_fault,
        detected_after_s=round(survivor["after_s"], 3),
        named_correctly=named,
        recovered_after_s=round(recovered, 3),
        state_equal=equal,
        survivor_error=survivor["error"][:200],
    )


@pytest.mark.faults
def test_rank_killed_inside_the_writer_leaves_the_previous_checkpoint(ranks, tmp_path: Path):
    _kill_during_save(ranks, tmp_path, 1, "write", "SIGKILL rank 1 inside its file write (ws=2)")


@pytest.mark.faults
def test_coordinator_killed_before_the_rename_leaves_the_previous_checkpoint(ranks, tmp_path):
    _kill_during_save(
        ranks, tmp_path, 0, "rename", "SIGKILL the coordinator between manifest write and rename"
    )


@pytest.fixture
def small_disk(tmp_path: Path):
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", f"plait-ck-{uuid.uuid4().hex[:6]}", str(mount)],
        capture_output=True,
        timeout=30,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True, timeout=30)


@pytest.mark.faults
def test_disk_full_raises_on_every_rank_and_keeps_the_previous_checkpoint(ranks, small_disk):
    root = small_disk / "run"
    saved = ranks(2, checkpoint_fns.save_small, str(root))
    results = ranks(2, checkpoint_fns.save_big_then_report, str(root), 40_000)  # 160 kB/rank
    for got in results:
        assert got["error"] is not None and "No space left on device" in got["error"], got
    assert checkpoint.committed_steps(root) == [1]
    assert not [p for p in root.iterdir() if p.name.startswith("step-2")]  # partial removed
    back = ranks(2, checkpoint_fns.load_state, str(root))
    equal = all(b["step"] == 1 and _equal(b["state"], s) for b, s in zip(back, saved, strict=True))
    assert equal
    faultlog.record(
        row=9,
        fault="disk full during save (256 kB tmpfs, ws=2)",
        detected_after_s=round(max(g["after_s"] for g in results), 3),
        named_correctly=all("rank" in g["error"] for g in results),
        recovered_after_s=None,
        state_equal=equal,
    )


@pytest.mark.faults
def test_async_save_holds_the_values_at_the_call(ranks, tmp_path: Path):
    results = ranks(2, checkpoint_fns.async_save_then_update, str(tmp_path / "run"))
    for got in results:
        assert got["writing_when_updated"]
        assert _equal(got["loaded"], got["at_call"])
        assert not torch.equal(got["now"]["fc1.weight"], got["at_call"]["fc1.weight"])
    faultlog.record(
        row=19,
        fault="async save, parameters updated in place while the writer runs (ws=2)",
        detected_after_s=None,
        named_correctly=None,
        state_equal=True,
    )


@pytest.mark.faults
@pytest.mark.parametrize("at", ["wait", "next"])
def test_async_writer_error_surfaces_on_every_rank(ranks, tmp_path: Path, at: str):
    root = tmp_path / "run"
    for message in ranks(2, checkpoint_fns.async_error_surfaces, str(root), 1, at):
        assert "rank(s) [1]" in message and "No space left on device (injected)" in message
    assert checkpoint.committed_steps(root) == []


def test_single_process_round_trip_without_init(tmp_path: Path):
    s = checkpoint_fns.Net()
    opt = torch.optim.Adam(s.parameters(), lr=0.01)
    s(torch.randn(2, checkpoint_fns.FEATURES)).sum().backward()
    opt.step()
    checkpoint.save(tmp_path, step=1, model=s, optimizer=opt, extra={"t": torch.ones(2)})
    fresh = checkpoint_fns.Net()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.3)
    restored = checkpoint.load(tmp_path, model=fresh, optimizer=fresh_opt)
    assert _equal(fresh.state_dict(), s.state_dict())
    assert torch.equal(restored.extra["t"], torch.ones(2))
    assert fresh_opt.param_groups[0]["lr"] == 0.01
    with pytest.raises(TypeError, match="JSON"):
        checkpoint.save(tmp_path, step=2, model=s, extra={"bad": object()})
    assert checkpoint.committed_steps(tmp_path) == [1]
    shutil.rmtree(tmp_path / "step-1")
    with pytest.raises(FileNotFoundError):
        checkpoint.load(tmp_path, model=fresh)


def test_saving_a_step_again_replaces_it_and_a_stale_latest_falls_back(tmp_path: Path):
    checkpoint.save(tmp_path, {"v": torch.zeros(2)}, step=5, keep_last=None)
    checkpoint.save(tmp_path, {"v": torch.ones(2)}, step=5, keep_last=None)
    assert torch.equal(checkpoint.load(tmp_path)["v"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "owner.json", "step-5"]
    checkpoint.save(tmp_path, {"v": torch.full((2,), 7.0)}, step=7, keep_last=None)
    shutil.rmtree(tmp_path / "step-7")  # latest now names a missing checkpoint
    restored = checkpoint.load(tmp_path)
    assert restored.step == 5 and torch.equal(restored["v"], torch.ones(2))


def test_a_crash_while_replacing_a_step_keeps_the_old_copy(tmp_path: Path):
    checkpoint.save(tmp_path, {"v": torch.zeros(2)}, step=5)
    # what a crash between the two renames of a second save of step 5 leaves
    (tmp_path / "step-5").rename(tmp_path / "step-5.replaced")
    checkpoint.save(tmp_path, {"v": torch.ones(2)}, step=6)  # its prepare restores step 5
    assert checkpoint.committed_steps(tmp_path) == [6, 5]
    assert torch.equal(checkpoint.load(tmp_path, step=5)["v"], torch.zeros(2))


def test_another_model_is_refused_before_anything_is_copied(tmp_path: Path):
    model = checkpoint_fns.Net()
    checkpoint.save(tmp_path, step=1, model=model)
    other = checkpoint_fns.Net()
    other.fc2 = torch.nn.Linear(10, 5)  # another output width
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match=r"fc2.weight: checkpoint \(3, 10\), model \(5, 10\)"):
        checkpoint.load(tmp_path, model=other)
    assert _equal(other.state_dict(), before)


def test_atomic_write_replaces_whole_files(tmp_path: Path):
    target = tmp_path / "f.pt"
    checkpoint.save_atomic({"a": torch.arange(3)}, target)
    checkpoint.save_atomic({"a": torch.arange(5)}, target)
    assert torch.equal(torch.load(target)["a"], torch.arange(5))
    assert [p.name for p in tmp_path.iterdir()] == ["f.pt"]


def test_full_state_dict_of_a_plain_model():
    model = checkpoint_fns.Net()
    assert checkpoint.full_state_dict(model).keys() == model.state_dict().keys()
    with pytest.raises(RuntimeError, match="plait.init"):
        plait.DistributedDataParallel(model)


# --- per-block checksums and range reads (one process) ---------------------------------------
def _one_file(tmp_path: Path, tensors: dict[str, torch.Tensor], block: int) -> tuple[Path, dict]:
    """A committed single-rank checkpoint of ``tensors`` (the simple form) and its manifest."""
    checkpoint.save(tmp_path, tensors, step=1, block_bytes=block)
    directory = tmp_path / "step-1"
    return directory, transaction.read_manifest(directory)


def test_range_reads_touch_only_the_blocks_they_need_and_verify_them(tmp_path: Path):
    w = torch.arange(10_000, dtype=torch.float64)  # 80 000 bytes: 79 blocks of 1 KiB
    directory, manifest = _one_file(tmp_path, {"w": w, "b": torch.ones(3)}, 1024)
    name = transaction.part_name(0, 1)
    entry = manifest["files"][name]
    assert len(entry["blocks"]["rank0/w"]["sha256"]) == 79 and entry["block_bytes"] == 1024
    assert blocks.block_size(80_000, 1 << 20) == 16 << 10  # finer blocks for small tensors
    assert blocks.block_size(64 << 20, 1 << 20) == 1 << 20
    assert blocks.block_size(8 << 20, 1 << 20) == 128 << 10
    reader = blocks.RangeReader(directory, manifest, reader=0)
    got = reader.read(name, {"rank0/w": [(1000, 1100), (5000, 5001)], "rank0/b": None})
    assert torch.equal(got["rank0/w"][1000:1100], w[1000:1100]) and got["rank0/w"][5000] == 5000
    assert int(got["rank0/w"].count_nonzero()) == 101  # nothing else was filled in
    assert torch.equal(got["rank0/b"], torch.ones(3))
    # 800 bytes spanning 2 blocks, 8 bytes in 1 block, b's 12 bytes, the header
    assert reader.bytes_read == 2 * 1024 + 1024 + 12 + entry["header_bytes"]
    # a flipped bit in a block the ranges do not touch is not seen by them; verify sees it
    path = directory / name
    data = bytearray(path.read_bytes())
    start, header = blocks.split_header(data)
    data[8 + start + header["rank0/w"]["data_offsets"][0] + 8 * 3000] ^= 0x04
    path.write_bytes(bytes(data))
    again = blocks.RangeReader(directory, manifest, reader=0).read(name, {"rank0/w": [(0, 8)]})
    assert torch.equal(again["rank0/w"][:8], w[:8])
    with pytest.raises(checkpoint.CheckpointCorrupt, match=r"'rank0/w' block 23 \(file bytes"):
        blocks.RangeReader(directory, manifest, reader=0).read(name, {"rank0/w": [(2990, 3010)]})
    assert any("SHA-256" in p for p in checkpoint.verify(tmp_path))
    data[10] ^= 0x01  # inside the JSON header
    path.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointCorrupt, match="safetensors header"):
        blocks.RangeReader(directory, manifest, reader=0).read(name, {"rank0/b": None})


def test_a_checkpoint_without_block_checksums_is_read_whole(tmp_path: Path):
    """Format v2 (a SHA-256 per file only) still loads: every needed file is read whole
    and checked against its file SHA-256. An unknown format is refused by name."""
    model = checkpoint_fns.Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, checkpoint_fns.FEATURES)).sum().backward()
    opt.step()
    checkpoint.save(tmp_path, step=1, model=model, optimizer=opt)
    directory = tmp_path / "step-1"
    body = transaction.read_manifest(directory)
    assert body["format"] == "plait-checkpoint-v3"
    body["format"] = "plait-checkpoint-v2"
    body["files"] = {
        n: {k: e[k] for k in ("rank", "bytes", "sha256")} for n, e in body["files"].items()
    }
    (directory / transaction.MANIFEST).write_bytes(transaction.manifest_bytes(body))
    fresh = checkpoint_fns.Net()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.3)
    restored = checkpoint.load(tmp_path, model=fresh, optimizer=fresh_opt)
    assert _equal(fresh.state_dict(), model.state_dict())
    assert restored.bytes_read == restored.checkpoint_bytes and restored.rng_source == "saved"
    body["format"] = "plait-checkpoint-v9"
    (directory / transaction.MANIFEST).write_bytes(transaction.manifest_bytes(body))
    with pytest.raises(checkpoint.CheckpointCorrupt, match="plait-checkpoint-v9"):
        checkpoint.load(tmp_path, model=fresh)


def test_block_bytes_is_checked(tmp_path: Path):
    with pytest.raises(ValueError, match="block_bytes must be an int >= 1024"):
        checkpoint.save(tmp_path, {"x": torch.ones(2)}, step=1, block_bytes=100)


_SAVE_IN_ANOTHER_JOB = """
import sys, torch
from plait import checkpoint
checkpoint.save(sys.argv[1], step=int(sys.argv[2]), model=torch.nn.Linear(2, 2))
"""


def _other_job(root: Path, step: int, job: str) -> subprocess.CompletedProcess[str]:
    import os
    import sys

    return subprocess.run(
        [sys.executable, "-c", _SAVE_IN_ANOTHER_JOB, str(root), str(step)],
        env=dict(os.environ, PLAIT_JOB_ID=job),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.faults
def test_a_second_job_on_one_root_is_refused_naming_both(tmp_path: Path, monkeypatch):
    """Issue 26 item 16: two jobs sharing one root pruned each other's steps and pointed
    ``latest`` at each other's weights. The second is refused while the first runs; a
    job that has ended hands the root over."""
    monkeypatch.setenv("PLAIT_JOB_ID", "job-first")
    model = torch.nn.Linear(2, 2)
    checkpoint.save(tmp_path, step=1, model=model, keep_last=1)
    start = time.monotonic()
    other = _other_job(tmp_path, 2, "job-second")
    took = time.monotonic() - start
    assert other.returncode == 1, other.stderr
    assert "OwnedByAnotherJob" in other.stderr, other.stderr
    assert "belongs to job 'job-first'" in other.stderr and "it still runs" in other.stderr
    assert "this is job 'job-second'" in other.stderr, other.stderr
    assert checkpoint.committed_steps(tmp_path) == [1]
    assert checkpoint.read_latest(tmp_path) == 1
    faultlog.record(
        row=26,
        fault="#16 a second job saving into the same checkpoint root",
        detected_after_s=round(took, 2),
        named_correctly=True,
        state_equal=True,
        note="refused before touching the root (subprocess wall time incl. torch import)",
    )
    # a job that ended hands the root over: the next one resumes and saves there
    ended = tmp_path / "ended"
    assert _other_job(ended, 1, "job-ended").returncode == 0
    checkpoint.save(ended, step=2, model=model, keep_last=None)
    assert checkpoint.committed_steps(ended) == [2, 1]
