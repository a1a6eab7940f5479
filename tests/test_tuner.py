"""auto: the tuning table and the default rule (no processes needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait import bench
from plait.comm import SUPPORTED, tuner
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
