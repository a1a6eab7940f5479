"""Draw docs/architecture.md's folder map and import table from the code.

Run from the repository root: ``python docs/architecture_map.py`` prints two Markdown
sections; ``--write`` puts them in place of docs/architecture.md's own (from "## Folder map"
to the end) (the folder map, one line per module from its docstring, and which room imports
which). Imports under ``if TYPE_CHECKING:`` are left out (they cost nothing at run time);
imports inside functions are counted and marked.
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import sys
from collections import defaultdict
from typing import TextIO

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "plait"


# A room is a folder of plait, or a top-level module; the strategies and plan/measure
# folders are rooms of their own.
def room_of(module: str) -> str:
    parts = module.split(".")
    if parts[:2] == ["plait", "strategies"] and len(parts) > 2:
        path = PKG / "strategies" / parts[2]
        return ".".join(parts[:3]) if path.is_dir() else "plait.strategies"
    if parts[:3] == ["plait", "plan", "measure"]:
        return "plait.plan.measure"
    if len(parts) == 1:
        return "plait"
    return ".".join(parts[:2])


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):`~?([^`]+)`")


def first_line(tree: ast.Module) -> str:
    doc = ROLE.sub(lambda m: m.group(1).rsplit(".", 1)[-1], ast.get_docstring(tree) or "")
    doc = doc.replace("``", "")
    line = " ".join(doc.strip().split("\n\n")[0].split())
    return line if len(line) <= 110 else line[:107].rstrip() + "..."


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(tree: ast.Module, module: str, is_pkg: bool) -> list[tuple[str, bool]]:
    """(imported plait module, inside a function) for every run-time import."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and is_type_checking(node):
            for stmt in node.orelse:
                visit(stmt, in_function)
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function = True
        if isinstance(node, ast.Import):
            found.extend((a.name, in_function) for a in node.names if a.name.startswith("plait"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_pkg else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            if base.startswith("plait"):
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    is_module = (ROOT / sub.replace(".", "/")).is_dir() or (
                        ROOT / (sub.replace(".", "/") + ".py")
                    ).is_file()
                    found.append((sub if is_module else base, in_function))
        for child in ast.iter_child_nodes(node):
            visit(child, in_function)

    visit(tree, False)
    return found


def _names(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names) or "-"


def main() -> None:
    if "--write" in sys.argv[1:]:
        page = ROOT / "docs" / "architecture.md"
        head = page.read_text().split("## Folder map\n")[0]
        buf = io.StringIO()
        draw(buf)
        page.write_text(head + buf.getvalue())
    else:
        draw(sys.stdout)


def draw(out: TextIO) -> None:
    files = sorted(PKG.rglob("*.py"))
    out.write("## Folder map\n\n```\n")
    for path in files:
        tree = ast.parse(path.read_text())
        rel = path.relative_to(ROOT).as_posix()
        out.write(f"{rel:<44} {first_line(tree)}\n")
    out.write("```\n\n")
    edges: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for path in files:
        module = module_name(path)
        tree = ast.parse(path.read_text())
        src = room_of(module)
        for target, in_function in imports(tree, module, path.name == "__init__.py"):
            dst = room_of(target)
            if dst != src:
                edges[src][dst][1 if in_function else 0] += 1
    out.write("## Which room imports which\n\n")
    out.write("| room | imports at module level | imports only inside functions |\n")
    out.write("| --- | --- | --- |\n")
    for src in sorted({room_of(module_name(p)) for p in files}):
        top = sorted(d for d, (m, f) in edges[src].items() if m)
        late = sorted(d for d, (m, f) in edges[src].items() if f and not m)
        out.write(f"| `{src}` | {_names(top)} | {_names(late)} |\n")


if __name__ == "__main__":
    main()
