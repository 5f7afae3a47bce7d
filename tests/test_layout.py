"""The package layout is the architecture: layers import only downwards, and nothing circles.

Read from the source with ``ast`` (function-level imports included, since a lazy import is still
a dependency), so the test needs nothing importable and fails on the first upward arrow or
circle with the modules that form it. docs/design.md §2 explains the layers.

An import through a string (``importlib.import_module("kvstore.x")``, ``__import__``, a lazy
table such as ``kvstore._EXPORTS``, a ``"module:attr"`` or ``"module.Class"`` handed to a
loader) is a dependency too: any string constant that names a project module counts as an
import of it. Docstrings and other bare string statements are prose, not edges.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Container
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvstore",)

#: Rank of each layer, lowest first: a module may import its own layer or lower ones.
#: Within one layer, only modules of the same package (or the ground) import each other.
#: Each layer is one folder, except the ground: the package top's modules and two leaf
#: packages (security, ops) that the block codec and every layer above use.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("ground", ("kvstore.errors", "kvstore.constants", "kvstore.config", "kvstore.config_loader",
                "kvstore.command_flags", "kvstore.keys", "kvstore.block", "kvstore.block_batch",
                "kvstore.api", "kvstore.records", "kvstore.metrics", "kvstore.reader_metrics",
                "kvstore.gc_tuning", "kvstore.process_priority", "kvstore.security", "kvstore.ops",
                "kvstore.protos", "kvstore.command_output")),
    ("index", ("kvstore.index",)),
    ("node", ("kvstore.node",)),
    ("coordinator", ("kvstore.coordinator",)),
    ("client", ("kvstore.client",)),
    ("cluster", ("kvstore.cluster",)),
    ("workers", ("kvstore.workers",)),
    ("frontend", ("kvstore.frontend",)),
    ("integrations", ("kvstore.integrations",)),
    ("cli", ("kvstore.cli",)),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


#: ``pkg.mod``, ``pkg.mod.attr`` or ``pkg.mod:attr``: how code names a module in a string.
DOTTED_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*)?")


def module_named_by(text: str, known: Container[str]) -> str | None:
    """The project module a string names: the whole string, or the part before ``:attr`` or
    the last ``.attr``.

    A top package alone does not count: ``"kvstore"`` is also the program's, the Serve
    application's and the loggers' name, and the package's own ``__init__`` has no layer.
    """
    if not DOTTED_NAME.fullmatch(text):
        return None
    dotted = text.partition(":")[0]
    for candidate in (dotted, dotted.rpartition(".")[0]):
        if candidate in known and candidate not in PACKAGES:
            return candidate
    return None


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports, anywhere in the file, by statement or by name."""
    out: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    prose = {id(node.value) for node in ast.walk(tree)
             if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from pkg import mod`` names a module; ``from mod import name`` names the module
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known
                     else node.module for a in node.names]
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in prose):
            named = module_named_by(node.value, known)
            names = [] if named is None else [named]
        else:
            continue
        out.update(n for n in names if n.split(".")[0] in PACKAGES)
    if path.is_relative_to(ROOT):
        out.discard(module_name(path))  # generated protobuf code names itself as it registers
    return out


def layer_of(module: str) -> tuple[int, str]:
    for rank, (name, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank, name
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")


def package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else parts[0]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = all_modules()
    return {m: imports_of(p, known) for m, p in known.items()}


def test_every_project_import_names_a_module_that_exists(graph):
    known = set(graph)
    missing = sorted((m, dep) for m, deps in graph.items() for dep in deps if dep not in known
                     and dep not in PACKAGES)
    assert not missing, f"imports of modules that do not exist: {missing}"


def test_every_module_has_a_layer(graph):
    for module in graph:
        if module not in PACKAGES:
            layer_of(module)


def test_no_module_imports_upward_or_sideways(graph):
    bad = []
    for module, deps in graph.items():
        if module in PACKAGES:
            continue
        rank, name = layer_of(module)
        for dep in deps:
            if dep in PACKAGES:
                if module != "kvstore.cli.main":
                    bad.append(f"{module} imports the package {dep} itself")
                continue
            dep_rank, dep_name = layer_of(dep)
            sideways = (dep_rank == rank and name != "ground"
                        and package_of(dep) != package_of(module))
            if dep_rank > rank or sideways:
                bad.append(f"{module} ({name}) imports {dep} ({dep_name})")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_the_import_graph_has_no_circles(graph):
    """Tarjan's strongly connected components: any component of two or more is a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_layering_check_catches_an_upward_import(graph):
    """The check itself can fail: a node module importing the cluster wiring is refused."""
    graph = {**graph, "kvstore.node.block_pool": graph["kvstore.node.block_pool"] |
    {"kvstore.cluster.names"}}
    with pytest.raises(AssertionError, match="kvstore.node.block_pool"):
        test_no_module_imports_upward_or_sideways(graph)


def test_the_circle_check_catches_a_circle(graph):
    graph = {**graph, "kvstore.errors": graph["kvstore.errors"] | {"kvstore.block"}}
    with pytest.raises(AssertionError, match="kvstore.block"):
        test_the_import_graph_has_no_circles(graph)


def test_imports_through_strings_are_edges(tmp_path):
    """importlib, ``__import__``, lazy tables and ``module:attr`` strings name modules;
    docstrings, the bare package name and other text do not."""
    source = tmp_path / "lazy.py"
    source.write_text(
        '"""Mentions kvstore.node.block_pool in prose only."""\n'
        "import importlib\n"
        "EXPORTS = {'connect': 'kvstore.cluster.lifecycle'}\n"
        "def load():\n"
        "    'And kvstore.coordinator.core here.'\n"
        "    importlib.import_module('kvstore.keys')\n"
        "    __import__('kvstore.errors')\n"
        "    return ('kvstore.cli.main:main', 'kvstore.frontend.routing.PrefixAffinityRouter',\n"
        "            'kvstore', 'kvstore: error: ', 'kvstore.no_such_module.x', 'kvstore-node')\n")
    assert imports_of(source, all_modules()) == {
        "kvstore.cluster.lifecycle", "kvstore.keys", "kvstore.errors", "kvstore.cli.main",
        "kvstore.frontend.routing"}


def test_the_circle_check_catches_a_circle_made_through_a_string(graph, tmp_path):
    """The block codec loading the batch codec by name closes a circle: the batch codec
    imports the block codec with a statement."""
    assert "kvstore.block" in graph["kvstore.block_batch"]
    known = all_modules()
    lazy_block = tmp_path / "block.py"
    lazy_block.write_text(known["kvstore.block"].read_text() + "\n\n"
                          "def _batch_codec():\n"
                          "    import importlib\n\n"
                          "    return importlib.import_module('kvstore.block_batch')\n")
    graph = {**graph, "kvstore.block": imports_of(lazy_block, known)}
    with pytest.raises(AssertionError, match="kvstore.block_batch"):
        test_the_import_graph_has_no_circles(graph)


def test_public_api_at_the_package_top_loads_lazily():
    """``from kvstore import ...`` gives the documented names; ``import kvstore`` alone stays
    light (an operator command must not pay for Ray or torch it does not use)."""
    code = (
        "import sys, kvstore\n"
        "assert 'ray' not in sys.modules and 'torch' not in sys.modules, 'heavy import'\n"
        "from kvstore import (BlockHasher, ClusterStore, KVStore, KVStoreConfig, LocalStore,\n"
        "                     Namespace, connect, load_config, start, stop)\n"
        "assert connect.__module__ == 'kvstore.cluster.lifecycle'\n"
        "assert sorted(kvstore.__all__) == sorted(kvstore._EXPORTS)\n"
        "ns = Namespace('m', 'float32', 4, 1, 1, 8)\n"
        "assert len(BlockHasher(ns).block_keys(list(range(8)))) == 2\n"
        "try:\n"
        "    kvstore.no_such_name\n"
        "except AttributeError as exc:\n"
        "    assert 'no_such_name' in str(exc)\n"
        "else:\n"
        "    raise SystemExit('unknown names must raise AttributeError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


#: What an operator command without a model loads, and what it unpickles to reach the cluster's
#: actors (``ray.get_actor`` imports the actor's module): the coordinator, and the store node's
#: thin actor class (the node itself is built inside the actor process).
CONTROL_PLANE = ("kvstore.cli.main", "kvstore.cli.status", "kvstore.cluster.lifecycle",
                 "kvstore.cluster.operations", "kvstore.coordinator.actor", "kvstore.metrics",
                 "kvstore.cluster.store_node_actor")


@pytest.mark.parametrize("module", CONTROL_PLANE)
def test_the_control_plane_imports_no_torch(module):
    """torch's import is most of a ``kvstore status``'s start-up (and of the coordinator's):
    the modules those load keep to ``kvstore.records`` and never pull torch in."""
    code = (f"import sys, {module}\n"
            "if 'torch' in sys.modules:\n"
            "    raise SystemExit('torch was imported: python -X importtime shows by whom')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
