"""auto: the tuning table and the default rule (no processes needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plait import bench
from plait.comm import SUPPORTED, ops, tuner
from plait.comm.group import Group
from plait.comm.tree import double_tree, in_order_tree


def _row(collective: str, algorithm: str, nbytes: int, time_us: float) -> bench.Row:
    return bench.Row(collective, algorithm, 4, nbytes, time_us, 1.0, 1.0, 3, algorithm)


def test_tune_table_keeps_the_fastest_per_size_and_merges_runs(tmp_path: Path):
    rows = [
        _row("all_reduce", "naive", 4096, 10),
        _row("all_reduce", "ring", 4096, 20),
        _row("all_reduce", "naive", 65536, 30),
        _row("all_reduce", "ring", 65536, 40),
        _row("all_reduce", "naive", 1 << 20, 90),
        _row("all_reduce", "ring", 1 << 20, 50),
    ]
    table = bench.tune_table(rows)
    assert table == {"all_reduce": {4: [(65536, "naive"), (1 << 62, "ring")]}}
    path = tmp_path / "t.json"
    tuner.save(table, path, backend="gloo")
    try:
        tuner.load(path)
        assert tuner.choose("all_reduce", 100, 4) == "naive"
        assert tuner.choose("all_reduce", 65536, 4) == "naive"
        assert tuner.choose("all_reduce", 65537, 4) == "ring"
        assert tuner.choose("all_reduce", 1 << 40, 5) == "ring"  # nearest world measured
        assert tuner.choose("all_gather", 1 << 20, 4) == "ring"  # not in table: the rule
    finally:
        tuner.load(tmp_path / "missing.json")


@pytest.mark.parametrize("collective", list(SUPPORTED))
@pytest.mark.parametrize("world", [2, 4, 8, 64])
def test_default_rule_names_a_supported_algorithm(collective, world):
    for nbytes in (0, 4096, 1 << 20, 1 << 30):
        assert tuner.default_rule(collective, nbytes, world) in SUPPORTED[collective]


def test_bad_tuning_table_is_refused(tmp_path: Path):
    path = tmp_path / "t.json"
    path.write_text('{"version": 7}')
    with pytest.raises(ValueError, match="unknown tuning table version"):
        tuner.load(path)
    tuner.load(tmp_path / "missing.json")


SIZES = (0, 1, 4096, 65536, 256 << 10, 1 << 20, 16 << 20, 1 << 30)


@pytest.mark.parametrize("backend", ["nccl", "xccl", "fake"])
def test_auto_on_a_device_backend_is_native_for_every_collective_and_size(tmp_path, backend):
    tuner.load(tmp_path / "missing.json")
    for collective in SUPPORTED:
        for world in (2, 3, 4, 8, 64):
            for nbytes in SIZES:
                got = tuner.choose(collective, nbytes, world, backend=backend)
                assert got == "native", (collective, world, nbytes, got)
                assert tuner.choose(collective, nbytes, world, shm=True, backend=backend) == got
    # gloo keeps the rules measured there
    assert tuner.choose("all_gather", 1 << 20, 2) == "ring"
    assert tuner.choose("all_reduce", 4096, 2, shm=True) == "shm"


def test_a_table_measured_on_gloo_is_ignored_on_nccl_and_said_once(tmp_path, caplog):
    path = tmp_path / "gloo.json"
    tuner.save({"all_reduce": {2: [(1 << 62, "ring")]}}, path, backend="gloo")
    saved = json.loads(path.read_text())
    assert saved["backend"] == "gloo" and saved["torch"] == torch.__version__
    try:
        tuner.load(path)
        assert tuner.choose("all_reduce", 4096, 2) == "ring"  # used where it was measured
        with caplog.at_level("WARNING", logger="plait"):
            for _ in range(3):
                assert tuner.choose("all_reduce", 4096, 2, backend="nccl") == "native"
        said = [r.getMessage() for r in caplog.records if "tuning table" in r.getMessage()]
        assert len(said) == 1, said
        assert f"{path} was measured on backend 'gloo'" in said[0]
        assert "on a 'nccl' group ignores it and uses device_rule" in said[0]
    finally:
        tuner.load(tmp_path / "missing.json")


def test_a_table_measured_on_nccl_is_used_on_nccl_and_not_on_gloo(tmp_path, caplog):
    path = tmp_path / "nccl.json"
    table = {"all_reduce": {8: [(65536, "tree"), (1 << 62, "native")]}}
    tuner.save(table, path, backend="nccl")
    try:
        tuner.load(path)
        assert tuner.choose("all_reduce", 4096, 8, backend="nccl") == "tree"
        assert tuner.choose("all_reduce", 1 << 20, 8, backend="nccl") == "native"
        assert tuner.choose("all_reduce", 4096, 2, backend="nccl") == "tree"  # nearest world
        assert tuner.choose("all_gather", 4096, 8, backend="nccl") == "native"  # not measured
        with caplog.at_level("WARNING", logger="plait"):
            assert tuner.choose("all_reduce", 4096, 2) == tuner.default_rule("all_reduce", 4096, 2)
        assert "measured on backend 'nccl'" in caplog.text
    finally:
        tuner.load(tmp_path / "missing.json")


def test_a_group_on_nccl_resolves_auto_to_native_and_keeps_plaits_algorithms_by_name(tmp_path):
    """The group-level path: ``ops`` reads the group's backend (no NCCL here: a group object
    whose backend says nccl; nothing is sent)."""
    tuner.load(tmp_path / "missing.json")
    group = Group(pg=None, ranks=[0, 1, 2, 3], global_rank=0, name="t", backend="nccl", timeout=5)
    gloo = Group(pg=None, ranks=[0, 1, 2, 3], global_rank=0, name="g", backend="gloo", timeout=5)
    try:
        for collective in SUPPORTED:
            for nbytes in SIZES:
                assert ops._choose(collective, "auto", nbytes, group) == "native"
                assert ops._choose(collective, "auto", nbytes, gloo) == tuner.default_rule(
                    collective, nbytes, 4
                )
            for name in SUPPORTED[collective]:
                if name != "shm":
                    assert ops._choose(collective, name, 4096, group) == name
    finally:
        group.shutdown()
        gloo.shutdown()


@pytest.mark.parametrize("n", range(1, 20))
def test_double_binary_tree_shapes(n):
    for parent, children in double_tree(n):
        roots = [r for r in range(n) if parent[r] < 0]
        assert len(roots) == 1
        assert all(len(c) <= 2 for c in children)
        for r in range(n):  # every rank reaches the root
            seen, x = set(), r
            while parent[x] >= 0:
                assert x not in seen
                seen.add(x)
                x = parent[x]
    if n % 2 == 0 and n > 2:  # an inner node of one tree is a leaf of the other
        (_, kids1), (_, kids2) = double_tree(n)
        assert not any(kids1[r] and kids2[r] for r in range(n))
    _, children = in_order_tree(n)
    assert all(not children[r] for r in range(0, n, 2))  # even ranks are its leaves


def test_sizes_parse():
    assert bench.parse_size("4K") == 4096 and bench.parse_size("64MiB") == 64 << 20
    assert bench.size_range(4096, 65536) == [4096, 16384, 65536]
