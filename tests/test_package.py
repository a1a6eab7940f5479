"""plait installs like a package: a LICENSE its metadata names (the SPDX string), a typed
package (``py.typed``), and dependencies scoped to what each part imports: a module-level
import is torch, safetensors or the standard library; anything else is imported inside the
function that needs it and installed by an extra that names it."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from plait.extras import EXTRAS, require

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CORE = {"torch", "safetensors", "numpy"}  # pyproject's dependencies, by import name
MODULE_OF = {"scikit-learn": "sklearn", "pyyaml": "yaml", "pillow": "PIL"}


def _name(requirement: str) -> str:
    dist = re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0].lower()
    return MODULE_OF.get(dist, dist.replace("-", "_"))


def _third_party_imports() -> dict[str, dict[str, set[str]]]:
    """{"top" | "inner": {import root: files}} over plait/ (relative imports left out)."""
    std = set(sys.stdlib_module_names) | {"plait", "__future__"}
    found: dict[str, dict[str, set[str]]] = {"top": {}, "inner": {}}
    for path in (ROOT / "plait").rglob("*.py"):
        tree = ast.parse(path.read_text())
        top_level = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                roots = [node.module.split(".")[0]]
            else:
                continue
            where = "top" if id(node) in top_level else "inner"
            for root in roots:
                if root not in std:
                    found[where].setdefault(root, set()).add(str(path.relative_to(ROOT)))
    return found


def test_license_file_and_spdx_metadata() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert PROJECT["license"] == "Apache-2.0"  # the SPDX string, not the deprecated table
    assert PROJECT["license-files"] == ["LICENSE"]
    assert (ROOT / "plait" / "py.typed").exists()


def test_core_dependencies_are_what_modules_import_at_load() -> None:
    declared = {_name(r) for r in PROJECT["dependencies"]}
    assert declared == CORE, declared
    top = _third_party_imports()["top"]
    assert set(top) <= CORE, {k: sorted(v) for k, v in top.items() if k not in CORE}


def test_every_optional_import_is_installed_by_an_extra() -> None:
    extras = {
        _name(r): name for name, reqs in PROJECT["optional-dependencies"].items() for r in reqs
    }
    inner = _third_party_imports()["inner"]
    missing = {k: sorted(v) for k, v in inner.items() if k not in CORE and k not in extras}
    assert not missing, f"imported by plait, installed by no extra: {missing}"
    for module, extra in EXTRAS.items():  # the extra require() names installs the module
        names = {_name(r) for r in PROJECT["optional-dependencies"][extra]}
        assert module in names, (module, extra, names)


def test_a_missing_extra_is_named() -> None:
    with pytest.raises(ImportError, match=r"plait\[hf\]"):
        require("transformers.no_such_module_here", why="a Hugging Face model")


def test_torch_range_holds_the_torch_that_runs() -> None:
    spec = next(r for r in PROJECT["dependencies"] if _name(r) == "torch")
    low = re.search(r">=\s*([\d.]+)", spec)
    high = re.search(r"<\s*([\d.]+)", spec)
    assert low and high, spec
    import torch

    version = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    assert tuple(int(x) for x in low.group(1).split(".")[:2]) <= version
    assert version < tuple(int(x) for x in high.group(1).split(".")[:2]), (spec, version)
