"""The house stays as drawn: a lower layer never imports a higher one.

plait's modules sit in layers (docs/architecture.md draws them). Every ``import`` in
``plait/`` (at module level or inside a function: both are dependencies) may only point to
the same layer or a lower one (only the applications beside the front door, the demos and
the machine's measurements, import ``plait`` itself). The known exceptions are listed
below, each with its reason; the test fails when a new one appears and when a listed one is
gone (so the list only shrinks).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "plait"

# (module prefix, layer): the longest matching prefix decides; higher numbers sit higher.
LAYERS: list[tuple[str, int]] = [
    ("plait.launch.lifeline", 0),  # process plumbing: the standard library only
    ("plait.launch.rendezvous", 0),
    ("plait.launch.environment", 0),  # srun's and Kubeflow's variables: the standard library
    ("plait.comm", 1),  # groups, transports, collectives
    ("plait.runtime", 1),
    ("plait.cli_args", 0),  # argparse's range types: the standard library only
    ("plait.renames", 0),  # earlier names kept for one release: the standard library only
    ("plait.extras", 0),  # optional dependencies and the extra that installs each
    ("plait.settings", 0),  # the PLAIT_* settings and their parsers: the standard library only
    ("plait.mesh", 2),  # named groups, data, timeline, loss scaling
    ("plait.data", 2),
    ("plait.trace", 2),
    ("plait.amp", 2),
    ("plait.strategies.placement", 3),  # what strategies share
    ("plait.strategies.dcp_chunks", 3),  # shards as DCP chunks, for any strategy's state
    ("plait.strategies.consistency", 3),
    ("plait.strategies.reproducible", 3),  # the fixed summation tree every strategy follows
    ("plait.strategies.data_parallel", 4),  # strategies, data parallel first
    ("plait.precision", 4),  # one mixed-precision policy: DDP's hooks below, fsdp's above
    ("plait.strategies.zero", 5),
    ("plait.strategies.fsdp", 5),
    ("plait.strategies", 8),  # the package's front (it re-exports every strategy)
    ("plait.strategies.tensor", 6),  # model parallelism
    ("plait.strategies.pipeline", 6),
    ("plait.strategies.moe", 6),
    ("plait.strategies.context", 6),
    ("plait.strategies.whole_matrix", 6),  # steps whole parameters under the strategies above
    ("plait.checkpoint", 7),  # reads and writes every strategy's state
    ("plait.strategies.ps", 8),  # strategies that checkpoint or compose the others
    ("plait.strategies.compose", 8),
    ("plait.clip", 8),
    ("plait.clip_several", 8),
    ("plait.models", 9),  # models carry their plans: above the strategies that read them
    ("plait.plan", 9),  # the planner's arithmetic
    ("plait.prepare", 10),  # the front door and what runs on top of everything
    ("plait.launch", 10),
    ("plait.moe", 10),
    ("plait", 11),  # the package's front door; what uses plait as a user would sits beside it
    ("plait.plan.measure", 11),
    ("plait.demo", 11),
    ("plait.bench", 11),
    ("plait.cli", 12),
]

# (importer, imported): known upward imports, each with its reason. Remove a line when
# its import is gone; never add one without an issue that removes it.
KNOWN: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _layer(module: str) -> int:
    best = max((p for p, _ in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return dict(LAYERS)[best]


def _imports(modules: dict[str, pathlib.Path]) -> set[tuple[str, str]]:
    def resolve(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    edges = set()
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("plait"):
                assert node.module is not None
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    edges.add((name, resolve(full if full in modules else node.module)))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "plait":
                        edges.add((name, resolve(alias.name)))
    return edges


def upward_imports() -> set[tuple[str, str]]:
    modules = _modules()
    return {(a, b) for a, b in _imports(modules) if _layer(b) > _layer(a)}


def test_no_lower_layer_imports_a_higher_one():
    found = upward_imports()
    new = sorted(found - set(KNOWN))
    assert not new, "upward imports (a lower layer importing a higher one): " + ", ".join(
        f"{a} -> {b}" for a, b in new
    )


def test_known_exceptions_still_exist():
    gone = sorted(set(KNOWN) - upward_imports())
    assert not gone, f"these exceptions are gone: remove them from KNOWN: {gone}"


def test_every_module_has_a_layer():
    for name in _modules():
        assert _layer(name) >= 0


# Imports inside a function hide a dependency from the reader; plait keeps them only where
# they avoid a real cost, each with its reason on the line or the line above
# (``# deferred: ...``). Optional or heavy third-party packages a run may never need load
# where they are used, and the command line loads a subcommand's modules when it runs.
OPTIONAL = ("matplotlib", "transformers", "safetensors", "sklearn", "tqdm", "pydoc_data")
LAZY_FILES = {"plait/cli.py": "each subcommand loads its own modules when it runs"}


def deferred_imports_without_a_reason() -> list[str]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).as_posix()
        if rel in LAZY_FILES:
            continue
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        inner = {
            node
            for fn in ast.walk(tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(fn)
            if isinstance(node, (ast.Import, ast.ImportFrom))
        }
        for node in sorted(inner, key=lambda n: n.lineno):
            name = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            if (name or "").split(".")[0] in OPTIONAL:
                continue
            said = lines[max(0, node.lineno - 2) : node.end_lineno]  # the line above, and its own
            if not any("# deferred: " in line for line in said):
                out.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_every_import_inside_a_function_says_why():
    missing = deferred_imports_without_a_reason()
    assert not missing, (
        "imports inside functions without a '# deferred: <reason>' comment (move them to "
        "the top of the module, or say what importing them there avoids):\n" + "\n".join(missing)
    )


def test_no_package_exports_a_name_its_submodule_takes():
    """``import pkg.sub`` sets ``pkg.sub`` to the submodule, so a package that exports an
    object called ``sub`` from another module loses it (or its submodule) depending on which
    is imported first."""
    clashes = []
    for init in ROOT.rglob("__init__.py"):
        pkg = init.parent.relative_to(ROOT.parent).as_posix().replace("/", ".")
        subs = {p.stem for p in init.parent.glob("*.py")} | {
            p.name for p in init.parent.iterdir() if (p / "__init__.py").exists()
        }
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    name = alias.asname or alias.name
                    # from pkg.x import x (the submodule's own function) is the usual front
                    own = node.module == f"{pkg}.{name}" or node.module == pkg
                    if name in subs and not own:
                        clashes.append(f"{pkg}.{name} (from {node.module} import {alias.name})")
    assert not clashes, f"package exports named like one of its submodules: {clashes}"
