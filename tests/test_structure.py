"""The shape of the code: engine/ and fleetgui/ import each other without cycles and only down the floors.

Imports are read statically (``ast`` over the .py files, nothing is imported). Every import counts -- at module
level, inside functions, in try/except -- except those under ``if TYPE_CHECKING:`` (annotations only).
``from pkg import name`` counts as an import of ``pkg.name`` when that is a module, else of ``pkg``; importing a
package means importing its ``__init__``.
"""

from __future__ import annotations

import ast
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "fleetgui")

# Lowest floor first: a module may import only modules on its own floor or lower. A module's floor is that of
# its longest matching prefix (matched on whole dotted components: "engine.cli" does not match "engine.clidoc").
FLOORS = [
    ["engine", "engine.errors", "engine.hashing", "engine.files", "engine.config", "engine.progress",
     "engine.pinned", "engine.hostcpu", "engine.limits", "engine.tuning"],
    ["engine.models", "engine.manifest", "engine.fleetkey", "engine.launch", "engine.transport", "engine.documents"],
    ["engine.export", "engine.kernels"],
    ["engine.runtime", "engine.runtime.interfaces"],
    ["engine.runtime.stages"],
    ["engine.runtime.relay", "engine.runtime.decode"],
    ["engine.fleet"],
    ["engine.session", "engine.serve", "engine.conversation"],
    ["engine.bench"],
    ["engine.cli"],
    ["fleetgui"],
]
EXACT_ONLY = {"engine", "engine.runtime"}  # the package __init__ alone, not everything under it
LEAVES = {"engine.cli"}  # only the entry points reach these
SIBLINGS = [("engine.runtime.relay", "engine.runtime.decode")]  # must not import each other
# (importer, imported): no module under the first reaches one under the second, directly or through others, though
# the floors would allow it.  A worker runs shards without the export's code.
NEVER_REACHES = [("engine.runtime", "engine.export")]
ENGINE_FORBIDDEN = ("fleetgui", "PySide6", "pyqtgraph")  # the engine never reaches the GUI
HEAVY = ("torch", "transformers", "nncf", "gguf", "accelerate", "safetensors", "PySide6", "pyqtgraph",
         "openvino._offline_transformations")  # heavy optional dependencies: fine to import lazily


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def discover() -> dict[str, Path]:
    """Module name -> file, for every .py file in the packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


MODULES = discover()


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def walk_imports(tree: ast.AST):
    """Yield (import node, inside a function?) for every import outside `if TYPE_CHECKING:` blocks."""
    stack = [(tree, False)]
    while stack:
        node, in_function = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
            continue
        if isinstance(node, ast.If) and is_type_checking(node):
            children = node.orelse
        else:
            children = list(ast.iter_child_nodes(node))
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((child, inner) for child in reversed(children))


def targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names one import statement imports (relative imports resolved)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".")
        if MODULES[module].name != "__init__.py":
            package = package[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    if base.split(".")[0] not in PACKAGES:  # third-party: keep the names, e.g. openvino._offline_transformations
        return [f"{base}.{alias.name}" for alias in node.names]
    found = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES]
    if len(found) < len(node.names):  # some names are attributes of base, not submodules
        found.append(base)
    return found


def internal(name: str) -> str | None:
    """The project module a dotted name lands in (longest existing module prefix), if any."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in MODULES:
            return ".".join(parts)
        parts.pop()
    return None


def collect() -> list[tuple[str, str, str, bool, int, bool]]:
    """Every import: (importer, imported name, file:line, project module?, line, inside a function?)."""
    rows = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        where = path.relative_to(ROOT).as_posix()
        for node, in_function in walk_imports(tree):
            for name in targets(module, node):
                target = internal(name) if name.split(".")[0] in PACKAGES else None
                rows.append((module, target or name, f"{where}:{node.lineno}", target is not None,
                             node.lineno, in_function))
    return rows


IMPORTS = collect()
EDGES = [(a, b, where) for a, b, where, inside, _, _ in IMPORTS if inside and a != b]


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (mutual reachability; the graph is small)."""
    reach = {}
    for root in graph:
        seen, todo = set(), [root]
        while todo:
            for child in graph[todo.pop()] - seen:
                seen.add(child)
                todo.append(child)
        reach[root] = seen
    components = {frozenset(b for b in reach[a] if a in reach[b]) | {a} for a in graph}
    return sorted(sorted(component) for component in components if len(component) > 1)


def floor_of(module: str) -> int | None:
    best = None
    for level, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            match = module == prefix if prefix in EXACT_ONLY else under(module, prefix)
            if match and (best is None or len(prefix) > len(best[1])):
                best = (level, prefix)
    return best and best[0]


def verdict(title: str, problems: list[str], count: int | None = None) -> None:
    """Fail with a readable list (no pytest repr of the list underneath)."""
    __tracebackhide__ = True
    if problems:
        raise AssertionError(f"{title} ({len(problems) if count is None else count}):\n  " + "\n  ".join(problems))


def test_no_import_cycles():
    graph = {module: set() for module in MODULES}
    for a, b, _ in EDGES:
        graph[a].add(b)
    problems, cycles = [], strongly_connected(graph)
    for component in cycles:
        problems.append("cycle: " + ", ".join(component))
        problems += [f"    {a} -> {b}  ({where})" for a, b, where in EDGES if {a, b} <= set(component)]
    verdict("import cycles", problems, len(cycles))


def test_imports_only_go_down_the_floors():
    problems = [f"{module}: matches no floor prefix, add it to a floor in FLOORS"
                for module in MODULES if floor_of(module) is None]
    for a, b, where in EDGES:
        fa, fb = floor_of(a), floor_of(b)
        if fa is not None and fb is not None and fb > fa:
            problems.append(f"up the floors: {a} -> {b}  ({where})")
        for leaf in LEAVES:
            if under(b, leaf) and not under(a, leaf):
                problems.append(f"imports the leaf {leaf}: {a} -> {b}  ({where})")
        for left, right in SIBLINGS:
            if (under(a, left) and under(b, right)) or (under(a, right) and under(b, left)):
                problems.append(f"siblings import each other: {a} -> {b}  ({where})")
    for a, b, where, _, _, _ in IMPORTS:
        if under(a, "engine") and any(under(b, name) for name in ENGINE_FORBIDDEN):
            problems.append(f"the engine imports the GUI: {a} -> {b}  ({where})")
    verdict("layering violations", problems)


def test_runtime_never_reaches_the_export():
    graph: dict[str, list[tuple[str, str]]] = {}
    for a, b, where in EDGES:
        graph.setdefault(a, []).append((b, where))
    problems = []
    for importer, imported in NEVER_REACHES:
        came_from: dict[str, tuple[str, str] | None] = {module: None for module in MODULES if under(module, importer)}
        todo = list(came_from)
        while todo:
            module = todo.pop()
            for target, where in graph.get(module, ()):
                if target not in came_from:
                    came_from[target] = (module, where)
                    todo.append(target)
        for module in sorted(m for m in came_from if under(m, imported)):
            chain, step = [module], came_from[module]
            while step:
                chain.append(f"{step[0]} ({step[1]})")
                step = came_from[step[0]]
            problems.append(f"{importer} reaches {imported}: " + " <- ".join(chain))
    verdict("imports the floors allow but the design does not", problems)


def test_every_module_has_a_docstring():
    missing = [path.relative_to(ROOT).as_posix() for path in MODULES.values()
               if not ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))]
    verdict("modules without a docstring", missing)


def comment_lines(path: Path) -> set[int]:
    with path.open("rb") as handle:
        return {token.start[0] for token in tokenize.tokenize(handle.readline) if token.type == tokenize.COMMENT}


def test_imports_inside_functions_are_deliberate():
    by_statement: dict[tuple[str, str, int], list[str]] = {}
    for a, b, where, _, line, in_function in IMPORTS:
        if in_function:
            by_statement.setdefault((a, where, line), []).append(b)
    comments = {module: comment_lines(path) for module, path in MODULES.items()}
    problems = [f"{where}  ({', '.join(names)})" for (module, where, line), names in by_statement.items()
                if not (line in comments[module] or line - 1 in comments[module])
                and not all(any(under(name, heavy) for heavy in HEAVY) for name in names)]
    verdict("imports inside functions without a comment saying why they are deferred", problems)


def test_results_are_data():
    """bench-results/ holds reports, each date with a README (command, commit, host), and no one-off scripts
    (the commit history keeps those, the README names where); of the code, only engine/tuning.py cites a result
    file, naming where each tuned value came from."""
    results = ROOT / "bench-results"
    for folder in sorted(p for p in results.iterdir() if p.is_dir()):
        readme = folder / "README.md"
        assert readme.exists(), f"{folder.name} has no README.md"
        text = readme.read_text()
        assert all(word in text.lower() for word in ("command", "commit", "host")), f"{folder.name}/README.md"
    scripts = [p.relative_to(results) for p in results.rglob("*") if p.suffix in (".py", ".patch", ".diff")]
    assert not scripts, f"one-off scripts in bench-results/: {scripts}"
    cite = re.compile(r"bench-results/\d{4}-\d\d-\d\d")  # a date's folder or a file in it
    citing = [p.relative_to(ROOT) for top in (*PACKAGES, "tests") for p in (ROOT / top).rglob("*.py")
              if cite.search(p.read_text(encoding="utf-8")) and p != ROOT / "engine" / "tuning.py"]
    assert not citing, f"code citing result files (cite docs/benchmarks.md, or a value in engine/tuning.py): {citing}"
