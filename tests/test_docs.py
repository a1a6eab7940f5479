"""The README and the docs stay true to the tree: links resolve, the quickstart names what
exists, the architecture page maps every module. (The docs site itself is checked by
``mkdocs build --strict``, which ``make test`` runs first: see the Makefile's docs-check.)"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _relative_links(path: Path) -> list[str]:
    found = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # an address elsewhere, or a heading of this page
        found.append(target.split("#", 1)[0])
    return found


@pytest.mark.parametrize("page", ["README.md", "benchmarks/README.md"])
def test_links_of_the_readmes_resolve(page: str) -> None:
    """Every relative link of the two READMEs names a file of this tree (the docs pages'
    links are checked by the strict MkDocs build)."""
    path = ROOT / page
    links = _relative_links(path)
    assert links, f"{page} links nowhere"
    missing = [t for t in links if not (path.parent / t).exists()]
    assert not missing, f"{page}: links to files that do not exist: {missing}"


def test_readme_is_short_and_links_every_docs_page() -> None:
    text = (ROOT / "README.md").read_text()
    lines = text.count("\n")
    assert lines <= 300, f"README.md has {lines} lines; move detail into docs/ (limit 300)"
    linked = {Path(t).name for t in _relative_links(ROOT / "README.md") if t.startswith("docs/")}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"benchmarks.md"}
    assert not pages - linked, f"docs pages the README does not link: {sorted(pages - linked)}"


def test_readme_quickstart_names_what_exists() -> None:
    """The quickstart compiles, and every module, name and ``plait.<attr>`` it uses exists
    (tests/test_quickstart.py runs it under ``plait run -n 4``)."""
    blocks = _python_blocks((ROOT / "README.md").read_text())
    assert blocks, "README.md has no python block"
    tree = ast.parse(blocks[0])
    plait = importlib.import_module("plait")
    used = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
                used += 1
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "plait"
        ):
            assert hasattr(plait, node.attr), f"plait has no {node.attr}"
            used += 1
    assert used >= 8, f"the quickstart uses only {used} plait names"


def test_architecture_page_maps_every_module() -> None:
    """docs/architecture.md's folder map lists every module of plait/ and no module that
    is gone; regenerate it with ``python docs/architecture_map.py --write`` after moving files."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    mapped = set(re.findall(r"^(plait/\S+\.py)\b", page, flags=re.M))
    actual = {p.relative_to(ROOT).as_posix() for p in (ROOT / "plait").rglob("*.py")}
    assert mapped == actual, (
        f"docs/architecture.md is stale: missing {sorted(actual - mapped)}, "
        f"gone {sorted(mapped - actual)}; run python docs/architecture_map.py --write"
    )
