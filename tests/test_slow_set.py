"""The end-to-end set (tests/conftest.py's SLOW) names tests that exist: a renamed test would
otherwise leave the set silently and run in neither `make test` nor `make test-slow`'s place
(it would run in `make test`, costing its time unannounced)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import SLOW, measured_slow

ROOT = Path(__file__).resolve().parent.parent


def test_every_slow_entry_names_an_existing_test_and_a_reason() -> None:
    for prefix, reason in SLOW.items():
        path, _, name = prefix.partition("::")
        source = (ROOT / path).read_text()
        assert reason.strip(), prefix
        if name:  # a function (or a prefix of one), maybe with a parametrization id
            function = re.escape(name.split("[")[0])
            assert re.search(rf"^def {function}", source, re.M), f"{prefix}: no such test"


def test_every_measured_entry_names_an_existing_test() -> None:
    measured = measured_slow()
    assert len(measured) > 10
    for nodeid, seconds in measured.items():
        path, _, name = nodeid.partition("::")
        function = re.escape(name.split("[")[0])
        source = (ROOT / path).read_text()
        assert re.search(rf"^(async )?def {function}\(", source, re.M), f"{nodeid}: no such test"
        assert seconds >= 7.5, nodeid


def test_make_test_leaves_the_slow_set_out_and_ci_runs_it() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "-m 'not slow'" in pyproject
    assert "pytest -q -m slow" in (ROOT / "Makefile").read_text()
    assert "make test-slow" in (ROOT / ".ci" / "run").read_text()
