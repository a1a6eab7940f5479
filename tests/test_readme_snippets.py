"""The README as a user reads it: every Python block runs as written on ranks (the
quickstart under ``plait run`` in tests/test_quickstart.py, the others here, in order, on 4
ranks: the Hugging Face Llama under tp, the PTD-P line ``Mesh(pp=2, tp=2)``, context
parallelism), and every table cell is one short line (the full rows live in
docs/status.md and docs/porting.md)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
import torch

from plait.strategies.compose.check import mesh_sizes
from tests import readme_fns

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CELL_CHARS = 72  # a cell's text, links shown by their words
LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")


def python_blocks(page: Path = README) -> list[tuple[str, str]]:
    """``(where, code)`` of each python block of ``page``, ``where`` naming its line."""
    text = page.read_text()
    out = []
    for m in re.finditer(r"```python\n(.*?)```", text, flags=re.S):
        line = text.count("\n", 0, m.start()) + 2
        out.append((f"{page.relative_to(ROOT)}:{line}", m.group(1)))
    return out


def is_quickstart(code: str) -> bool:
    return "plait.shutdown()" in code and "train.py" in code


def test_every_python_block_is_run_by_a_test() -> None:
    blocks = python_blocks()
    quick = [w for w, c in blocks if is_quickstart(c)]
    assert len(quick) == 1, f"one quickstart (run by tests/test_quickstart.py): {quick}"
    assert len(blocks) >= 4, [w for w, _ in blocks]  # quickstart, HF tp, PTD-P, cp


def test_readme_blocks_run_as_written_on_4_ranks(ranks) -> None:
    pytest.importorskip("transformers")
    blocks = [(w, c) for w, c in python_blocks() if not is_quickstart(c)]
    results = ranks(4, readme_fns.run_blocks, blocks, timeout=300)
    for r in results:
        assert r["world"] == 4
        assert 3.0 < r["ptdp_loss"] < 7.0, r  # about ln 128 = 4.85 at random init
        assert r["cp_logits"] == [2, 16, 128], r  # 2 rows, 32 / cp 2 tokens, the vocabulary
    assert len({r["ptdp_loss"] for r in results}) == 1, results  # the mean on every rank
    print(f"README blocks, seconds per block on rank 0: {results[0]['seconds']}")


def test_ptdp_mesh_without_dp_means_dp_1(ranks) -> None:
    """``Mesh(pp=2, tp=2)`` trains exactly as ``Mesh(pp=2, dp=1, tp=2)`` (bitwise: the
    same work) and as one process (float64)."""
    assert mesh_sizes({"pp": 2, "tp": 2}) == (2, 1, 2, 1)
    assert mesh_sizes({"tp": 4}) == (1, 1, 4, 1)
    with pytest.raises(ValueError, match=r"\['xx'\] are not composed"):
        mesh_sizes({"pp": 2, "xx": 2})
    short = ranks(4, readme_fns.ptdp_mesh, False)
    full = ranks(4, readme_fns.ptdp_mesh, True)
    oracle = readme_fns.ptdp_oracle()
    for s, f in zip(short, full, strict=True):
        assert set(s["shape"]) == {"pp", "dp", "tp"} and s["shape"]["dp"] == 1, s["shape"]
        assert s["losses"] == f["losses"]
        for name, value in s["state"].items():
            assert torch.equal(value, f["state"][name]), name
            assert torch.allclose(value, oracle["state"][name], rtol=0, atol=1e-10), name
        assert s["losses"] == pytest.approx(oracle["losses"], abs=1e-10)


def table_cells(text: str) -> list[tuple[int, str]]:
    cells = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        for cell in re.split(r"(?<!\\)\|", line.strip().strip("|")):
            cells.append((number, LINK.sub(r"\1", cell.strip())))
    return cells


def test_readme_tables_have_one_short_line_a_cell() -> None:
    long = [
        f"line {n} ({len(c)} chars): {c[:60]}..."
        for n, c in table_cells(README.read_text())
        if len(c) > CELL_CHARS
    ]
    assert not long, (
        f"README.md table cells over {CELL_CHARS} characters (move the detail to "
        f"docs/status.md): " + "; ".join(long)
    )


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_docs_blocks_parse_and_name_what_exists(page: str) -> None:
    """Every python block of docs/ parses, and every plait module, ``from plait... import``
    name and ``plait.<attr>`` it uses exists (the README's blocks also run, above)."""
    plait = importlib.import_module("plait")
    for where, code in python_blocks(ROOT / "docs" / page):
        tree = ast.parse(code, filename=where)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("plait"):
                module = importlib.import_module(node.module or "")
                for alias in node.names:
                    if not hasattr(module, alias.name):  # else a submodule
                        importlib.import_module(f"{node.module}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("plait"):
                        importlib.import_module(alias.name)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "plait"
            ):
                assert hasattr(plait, node.attr), f"{where}: plait has no {node.attr}"
