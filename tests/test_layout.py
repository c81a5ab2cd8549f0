"""Import rules of the library, checked on its source (every import statement, inner ones too).

* no import cycles between fastjudge modules;
* ``backends`` and ``runtime`` reach nothing in ``judges`` or the applications, directly or
  through other modules;
* ``metrics`` loads without torch: no module its imports run imports torch or transformers at
  module level;
* the library never imports ``fastjudge.testing`` (the Python twins for tests and benchmarks);
* a module over 400 lines says why in its docstring, in a sentence starting "Over 400 lines:".

How imports become edges: ``import a.b`` and ``from a import b`` (``b`` a submodule) import
``a.b``; ``from a import name`` imports ``a``. Importing ``a.b`` also runs the ``__init__`` of
each package above it, so those count too, except the packages that contain the importer: they
are always initialised before it. ``fastjudge/__init__`` resolves its public names lazily from
strings, so it adds no edges of its own.
"""

from __future__ import annotations

import ast
import functools
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "python" / "fastjudge"
#: The compiled core, built from engine/; it has no Python source to parse.
EXTENSION_MODULES = {"fastjudge._engine"}

LOWER_LAYERS = ("fastjudge.backends", "fastjudge.runtime")
ABOVE_LOWER_LAYERS = ("fastjudge.judges", "fastjudge.cli", "fastjudge.serve", "fastjudge.rescore",
                      "fastjudge.rl", "fastjudge.demo", "fastjudge.builders", "fastjudge.bench")
MODEL_FREE = ("fastjudge.metrics",)
MODEL_PACKAGES = {"torch", "transformers"}
TEST_TWINS = ("fastjudge.testing",)

MAX_LINES = 400
LENGTH_REASON = "Over 400 lines:"


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@dataclass(frozen=True)
class Source:
    path: Path
    is_package: bool

    @property
    def where(self) -> str:
        return self.path.relative_to(PACKAGE_DIR.parent.parent).as_posix()


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # dotted module name as written, relative imports resolved
    line: int
    context: str  # "module" (runs when the importer is imported), "function" or "TYPE_CHECKING"

    @property
    def at_import_time(self) -> bool:
        return self.context == "module"


@dataclass(frozen=True)
class Edge:
    target: str
    statement: Import
    where: str  # file:line of the statement
    via_init: bool  # the target is a package whose __init__ the statement runs


def _find_sources() -> dict[str, Source]:
    sources = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        sources[name] = Source(path, is_package)
    return sources


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_statements(tree: ast.Module):
    """(import node, context as in Import) for every import statement in the tree."""
    stack: list[tuple[ast.AST, str]] = [(tree, "module")]
    while stack:
        node, context = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, context
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            stack += [(n, "TYPE_CHECKING") for n in node.body] + [(n, context) for n in node.orelse]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and context == "module":
            stack += [(n, "function") for n in ast.iter_child_nodes(node)]
        else:
            stack += [(n, context) for n in ast.iter_child_nodes(node)]


def _targets(node: ast.Import | ast.ImportFrom, package: str, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        anchor = ".".join(parts[: len(parts) - node.level + 1])
        base = f"{anchor}.{base}" if base else anchor
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


@functools.lru_cache(maxsize=None)
def _parsed() -> tuple[dict[str, Source], dict[str, ast.Module], list[Import]]:
    sources = _find_sources()
    known = set(sources) | EXTENSION_MODULES
    trees, imports = {}, []
    for name, source in sources.items():
        text = source.path.read_text(encoding="utf-8")
        tree = trees[name] = ast.parse(text, filename=str(source.path))
        package = name if source.is_package else name.rpartition(".")[0]
        for node, context in _import_statements(tree):
            for target in dict.fromkeys(_targets(node, package, known)):
                imports.append(Import(name, target, node.lineno, context))
    return sources, trees, imports


@functools.lru_cache(maxsize=None)
def _graph() -> dict[str, list[Edge]]:
    """fastjudge module -> the fastjudge modules its imports run (first statement for each)."""
    sources, _, imports = _parsed()
    known = set(sources) | EXTENSION_MODULES
    graph: dict[str, dict[str, Edge]] = {name: {} for name in known}
    for imp in imports:
        if imp.target not in known:
            continue
        where = f"{sources[imp.importer].where}:{imp.line}"
        runs = [(imp.target, False)] + [
            (pkg, True) for pkg in _ancestors(imp.target)
            if not (imp.importer == pkg or imp.importer.startswith(pkg + "."))]
        for target, via_init in runs:
            seen = graph[imp.importer].get(target)
            # Keep the first statement, unless a later one runs at import time and it does not.
            if target != imp.importer and (
                    seen is None or (imp.at_import_time and not seen.statement.at_import_time)):
                graph[imp.importer][target] = Edge(target, imp, where, via_init)
    return {name: list(edges.values()) for name, edges in graph.items()}


_CONTEXT_NOTES = {"module": "", "function": "in a function", "TYPE_CHECKING": "under TYPE_CHECKING"}


def _describe(start: str, path: list[Edge]) -> str:
    hops = [f"    {start}"]
    for edge in path:
        notes = [_CONTEXT_NOTES[edge.statement.context],
                 "runs its __init__" if edge.via_init else ""]
        note = "; ".join(n for n in notes if n)
        hops.append(f"      -> {edge.target:<40} {edge.where}" + (f" ({note})" if note else ""))
    return "\n".join(hops)


def _shortest_path(graph, start: str, goal, allowed=lambda module: True) -> list[Edge] | None:
    """Fewest hops from ``start`` to a module for which ``goal`` holds, or None."""
    previous: dict[str, tuple[str, Edge] | None] = {start: None}
    queue = deque([start])
    while queue:
        module = queue.popleft()
        for edge in graph[module]:
            if goal(edge.target):
                path = [edge]
                while previous[module] is not None:
                    module, hop = previous[module]
                    path.append(hop)
                return path[::-1]
            if edge.target not in previous and allowed(edge.target):
                previous[edge.target] = (module, edge)
                queue.append(edge.target)
    return None


def _report(heading: str, problems: list[str]) -> None:
    if problems:
        pytest.fail("\n".join([heading, *problems]), pytrace=False)


def _strongly_connected(graph: dict[str, list[Edge]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components in no particular order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, edges = work[-1]
            edge = next(edges, None)
            if edge is not None:
                if edge.target not in index:
                    index[edge.target] = low[edge.target] = len(index)
                    stack.append(edge.target)
                    on_stack.add(edge.target)
                    work.append((edge.target, iter(graph[edge.target])))
                elif edge.target in on_stack:
                    low[module] = min(low[module], index[edge.target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                components.append(sorted(component))
    return components


def test_every_fastjudge_import_names_a_module():
    sources, _, imports = _parsed()
    known = set(sources) | EXTENSION_MODULES
    missing = sorted(f"    {sources[i.importer].where}:{i.line} imports {i.target}"
                     for i in imports
                     if i.target.partition(".")[0] == "fastjudge" and i.target not in known)
    _report("imports of fastjudge modules that do not exist:", missing)


def test_no_import_cycles():
    graph = _graph()
    reports = []
    for component in _strongly_connected(graph):
        if len(component) < 2:
            continue
        members = set(component)
        start = component[0]
        cycle = _shortest_path(graph, start, lambda m: m == start, allowed=members.__contains__)
        reports.append(f"  cycle among {', '.join(component)}:\n{_describe(start, cycle)}")
    _report("import cycles between fastjudge modules:", reports)


def test_backends_and_runtime_import_no_judge_or_application():
    graph = _graph()
    reports = []
    for module in sorted(m for m in graph if _within(m, LOWER_LAYERS)):
        path = _shortest_path(graph, module, lambda m: _within(m, ABOVE_LOWER_LAYERS))
        if path is not None:
            reports.append(_describe(module, path))
    _report("backends/runtime modules that import judges or applications, directly or through "
            "others (shortest chain each):", reports)


def test_model_free_metrics_import_no_model_package_at_import_time():
    sources, _, imports = _parsed()
    runs_at_import = {module: [e for e in edges if e.statement.at_import_time]
                      for module, edges in _graph().items()}
    heavy = {i.importer: i for i in imports
             if i.at_import_time and i.target.partition(".")[0] in MODEL_PACKAGES}
    reports = []
    for module in sorted(m for m in sources if _within(m, MODEL_FREE)):
        for start in [*_ancestors(module), module]:
            path = [] if start in heavy else _shortest_path(runs_at_import, start,
                                                             heavy.__contains__)
            if path is not None:
                end = path[-1].target if path else start
                culprit = heavy[end]
                reports.append(f"  importing {module} runs {culprit.target} "
                               f"({sources[end].where}:{culprit.line}):\n"
                               + _describe(start, path))
                break
    _report("model-free modules that load a model package:", reports)


def test_library_does_not_import_test_twins():
    sources, _, imports = _parsed()
    offenders = [f"    {sources[i.importer].where}:{i.line} imports {i.target}" for i in imports
                 if _within(i.target, TEST_TWINS) and not _within(i.importer, TEST_TWINS)]
    _report("library modules importing fastjudge.testing:", offenders)


def test_long_modules_state_why():
    sources, trees, _ = _parsed()
    lengths = {name: len(source.path.read_text(encoding="utf-8").splitlines())
               for name, source in sources.items()}
    long = sorted((n for n in sources if lengths[n] > MAX_LINES), key=lengths.get, reverse=True)
    print(f"modules over {MAX_LINES} lines:")
    for name in long:
        print(f"    {lengths[name]:5d}  {sources[name].where}")
    silent = [f"    {lengths[n]:5d}  {sources[n].where}" for n in long
              if LENGTH_REASON not in (ast.get_docstring(trees[n]) or "")]
    _report(f"modules over {MAX_LINES} lines whose docstring does not say why "
            f"(a sentence starting {LENGTH_REASON!r}):", silent)


def test_repository_root_shadows_no_installed_package():
    """`python -m pytest` puts the repository root first on ``sys.path``, so a directory or
    module there named like an installed distribution's top-level package replaces it for every
    import. transformers >= 5.25 imports the Hugging Face ``kernels`` package
    (``transformers/integrations/hub_kernels.py``), which a top-level ``kernels`` link once
    shadowed, breaking every Qwen3.5 model load."""
    import importlib.metadata

    installed = importlib.metadata.packages_distributions()
    root = PACKAGE_DIR.parent.parent
    importable = {p.stem if p.suffix == ".py" else p.name for p in root.iterdir()
                  if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())}
    shadowing = {name: installed[name] for name in importable if name in installed}
    assert not shadowing, f"repository-root entries shadow installed packages: {shadowing}"
