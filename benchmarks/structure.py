"""The package's structure, read from its source with `ast`: import circles and the longest code.

Run from the repository root: ``python benchmarks/structure.py [--json PATH]``. Every import
counts, the function-local ones too, since they tie modules together just the same. Prints the
strongly connected components of curvax's import graph (an import circle is a component of more
than one module), the longest classes and functions, and writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "curvax"


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}

    def target(name: str) -> str | None:
        # The longest curvax module that `name` names (an attribute import names its module).
        while name:
            if name in files:
                return name
            name = name.rpartition(".")[0]
        return None

    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = resolve(name, is_package, node)
                names = [f"{base}.{alias.name}" for alias in node.names] or [base]
            else:
                continue
            for imported in names:
                if not imported.startswith("curvax"):
                    continue
                found = target(imported)
                # A package's own __init__ importing its submodules is how a package is made;
                # a submodule importing its parent package's __init__ is a real edge.
                if found and found != name and not (is_package and found.startswith(name + ".")):
                    graph[name].add(found)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def longest(kind: type, top: int) -> list[tuple[int, str]]:
    sizes = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, kind):
                length = node.end_lineno - node.lineno + 1
                sizes.append((length, f"{module_name(path)}:{node.name}"))
    return sorted(sizes, reverse=True)[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    graph = import_graph()
    found = circles(graph)
    classes = longest(ast.ClassDef, args.top)
    functions = longest((ast.FunctionDef, ast.AsyncFunctionDef), args.top)  # type: ignore[arg-type]
    lines = sum(len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py"))
    print(f"{len(graph)} modules, {lines} lines")
    print(f"import circles: {len(found)}")
    for component in found:
        print(f"  {len(component)} modules: {', '.join(component)}")
    print("longest classes:")
    for n, name in classes:
        print(f"  {n:5d}  {name}")
    print("longest functions:")
    for n, name in functions:
        print(f"  {n:5d}  {name}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({
            "modules": len(graph), "lines": lines,
            "circles": found,
            "longest_classes": classes, "longest_functions": functions,
        }, indent=1) + "\n")


if __name__ == "__main__":
    main()
