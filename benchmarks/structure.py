"""The package's structure, read from its source with `ast`: import circles, layers and the longest code.

Run from the repository root: ``python benchmarks/structure.py [--top N] [--json PATH]``. Every
import counts, the function-local ones too, since they tie modules together just the same. Prints
the strongly connected components of curvax's import graph (an import circle is a component of
more than one module), the imports that go against the layering (``LAYERS``: a lower layer never
imports a higher one; the core never imports the kfac-jax compatibility layer), the longest
classes and functions, and writes the figures as JSON. ``tests/test_structure.py`` asserts that
there are no circles and no layering violations.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "curvax"

# The layers, lowest first: a module may import modules of its own layer and of the layers
# below it, never of a layer above it. An entry names a module and, when it is a package, its
# submodules (the root package names only its own ``__init__``). Every module must be in one.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("curvax._compat", "curvax.linalg", "curvax.utils", "curvax.parallel", "curvax._generations")),
    ("tags and losses", ("curvax.tags", "curvax.losses")),
    ("tracing", ("curvax.tracing",)),
    ("detection", ("curvax.detection", "curvax.transforms", "curvax.patterns")),
    ("blocks", ("curvax.blocks", "curvax.stacked", "curvax.layers", "curvax.partitioned")),
    ("estimators", ("curvax.distributed", "curvax.estimators")),
    ("optimizer, preconditioner, operators, laplace", (
        "curvax.gradients", "curvax.step", "curvax.optimizer", "curvax.preconditioner",
        "curvax.operators", "curvax.laplace", "curvax.checkpoint",
    )),
    ("kfac-jax names", ("curvax.kfac_api", "curvax.kfac_ferminet_alpha")),
    ("public surface and applications", ("curvax", "curvax.autoencoder", "curvax.datasets", "curvax.demo", "curvax.cli")),
)

# The kfac-jax compatibility layer: only it and the root package (the public surface) may import it.
COMPAT = ("curvax.kfac_api", "curvax.kfac_ferminet_alpha")


def covers(entry: str, module: str) -> bool:
    """Whether a ``LAYERS``/``COMPAT`` entry names ``module``: itself, or a submodule of a package entry."""
    return module == entry or ("." in entry and module.startswith(entry + "."))


def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    """The dotted module name of a source file under ``root`` (a package's ``__init__`` is the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names, relative imports resolved against ``current``."""
    if node.level == 0:
        return node.module or ""
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(package: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in the file, function-local ones too)."""
    root = package.parent
    files = {module_name(p, root): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}

    def target(name: str) -> str | None:
        # The longest module of the package that `name` names (an attribute import names its module).
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
                if imported != package.name and not imported.startswith(package.name + "."):
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
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))

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


def layer_of(module: str, layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS) -> int | None:
    """The index in ``layers`` of the group whose most specific entry names ``module`` (None: unplaced)."""
    best: tuple[int, int] | None = None  # (entry length, layer index)
    for i, (_, entries) in enumerate(layers):
        for entry in entries:
            if covers(entry, module) and (best is None or len(entry) > best[0]):
                best = (len(entry), i)
    return None if best is None else best[1]


def unplaced(graph: dict[str, set[str]], layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS) -> list[str]:
    """The modules that no layer names."""
    return sorted(m for m in graph if layer_of(m, layers) is None)


def upward_imports(
    graph: dict[str, set[str]], layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS
) -> list[tuple[str, str]]:
    """The imports ``(module, imported)`` from a lower layer into a higher one."""
    out = []
    for module in sorted(graph):
        low = layer_of(module, layers)
        for imported in sorted(graph[module]):
            high = layer_of(imported, layers)
            if low is not None and high is not None and high > low:
                out.append((module, imported))
    return out


def compat_imports(graph: dict[str, set[str]], compat: tuple[str, ...] = COMPAT, surface: str = "curvax") -> list[tuple[str, str]]:
    """The imports ``(module, imported)`` of the compatibility layer by a core module (not ``surface``)."""
    def is_compat(m: str) -> bool:
        return any(covers(entry, m) for entry in compat)

    return [
        (module, imported)
        for module in sorted(graph)
        if module != surface and not is_compat(module)
        for imported in sorted(graph[module])
        if is_compat(imported)
    ]


def longest(kind: type | tuple[type, ...], top: int, package: pathlib.Path = PACKAGE) -> list[tuple[int, str]]:
    """The ``top`` longest definitions of ``kind`` (classes or functions) as ``(lines, "module:name")``."""
    sizes = []
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, kind):
                length = node.end_lineno - node.lineno + 1
                sizes.append((length, f"{module_name(path, package.parent)}:{node.name}"))
    return sorted(sizes, reverse=True)[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    graph = import_graph()
    found = circles(graph)
    upward = upward_imports(graph)
    compat = compat_imports(graph)
    outside = unplaced(graph)
    classes = longest(ast.ClassDef, args.top)
    functions = longest((ast.FunctionDef, ast.AsyncFunctionDef), args.top)
    lines = sum(len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py"))
    print(f"{len(graph)} modules, {lines} lines")
    print(f"import circles: {len(found)}")
    for component in found:
        print(f"  {len(component)} modules: {', '.join(component)}")
    print(f"layers (lowest first): {' < '.join(name for name, _ in LAYERS)}")
    print(f"imports against the layering: {len(upward)}")
    for module, imported in upward:
        print(f"  {module} -> {imported}")
    print(f"core imports of the compatibility layer: {len(compat)}")
    for module, imported in compat:
        print(f"  {module} -> {imported}")
    if outside:
        print(f"modules in no layer: {', '.join(outside)}")
    print("longest classes:")
    for n, name in classes:
        print(f"  {n:5d}  {name}")
    print("longest functions:")
    for n, name in functions:
        print(f"  {n:5d}  {name}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({
            "modules": len(graph), "lines": lines,
            "circles": found, "upward_imports": upward, "compat_imports": compat, "unplaced": outside,
            "longest_classes": classes, "longest_functions": functions,
        }, indent=1) + "\n")


if __name__ == "__main__":
    main()
